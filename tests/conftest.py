from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """The project's tiny default checkpoint, written once per test session."""
    from serving.tiny_model import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tiny"))


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where CUDA is; everything else runs everywhere."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """The project's tiny default checkpoint, written once per test session."""
    from serving.tiny_model import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tiny"))

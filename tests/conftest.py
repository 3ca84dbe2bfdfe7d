from __future__ import annotations

import pytest

DISTILL_PROMPT_LEN = 16


@pytest.fixture(scope="session")
def distilled_ckpt(tiny_ckpt, tmp_path_factory):
    """The tiny checkpoint with its lm_head refitted to a synthetic Markov language
    (training/fit_target_head.py) and its NextN draft distilled on that target's greedy choices
    after random prompts: drafts are accepted on prompts the draft never saw."""
    return distill(tiny_ckpt, tmp_path_factory.mktemp("distilled"))


@pytest.fixture(scope="session")
def distilled_vision_ckpt(tiny_vision_ckpt, tmp_path_factory):
    """The tiny --vision checkpoint distilled as distilled_ckpt (text prompts; the tower is
    kept): drafts are accepted after image prompts too, so EAGLE's steps there accept."""
    return distill(tiny_vision_ckpt, tmp_path_factory.mktemp("distilled_vision"))


def distill(src, out):
    from training.distill_nextn import train

    summary = train(
        str(src),
        str(out),
        steps=200,
        device="cpu",
        lr=5e-3,
        count=256,
        prompt_len=DISTILL_PROMPT_LEN,
        gen_len=32,
        batch_size=8,
        seed=0,
        fit_target_head=True,
        fit_tokens=65536,
    )
    assert summary["last_loss"] < summary["first_loss"]
    return out


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """The project's tiny default checkpoint, written once per test session."""
    from serving.tools.tiny_model import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_vision_ckpt(tmp_path_factory):
    """The tiny checkpoint with a vision tower (--vision), written once per test session."""
    from serving.tools.tiny_model import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tiny_vision"), vision=True)


@pytest.fixture(scope="session")
def v410_ckpt(tmp_path_factory):
    """The tiny preset with a vocabulary of 410 (its tokenizer too), which does not divide by
    4: at --tp-size 4 it is padded to 412 (serving/distributed.padded_vocab)."""
    from serving.tools import tiny_model

    tiny_model.PRESETS["tiny410"] = {**tiny_model.PRESETS["tiny"], "vocab_size": 410}
    try:
        return tiny_model.write_checkpoint(tmp_path_factory.mktemp("v410"), preset="tiny410")
    finally:
        del tiny_model.PRESETS["tiny410"]


@pytest.fixture(scope="session")
def v410_fp8(v410_ckpt, tmp_path_factory):
    """v410's config.json with the published quantization_config (block FP8) and its
    tokenizer, no weights: what a simulated rank reads."""
    import shutil

    from serving.tools.quantize_fp8 import write_fp8_config

    out = tmp_path_factory.mktemp("v410-fp8")
    for f in v410_ckpt.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    write_fp8_config(out)
    return out


@pytest.fixture(scope="session")
def scripted_ckpt(tiny_ckpt, tmp_path_factory):
    """The tiny checkpoint with a scripted greedy reply (tests/scripted_checkpoint.py), written
    once per session; every server started on it only reads it."""
    from tests.scripted_checkpoint import write_scripted_checkpoint

    return write_scripted_checkpoint(tiny_ckpt, tmp_path_factory.mktemp("scripted"))


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


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A checkpoint folder with the tiny tokenizer and a config, no weights: for the HTTP front."""
    import json

    from serving.tools.tokenizer_build import write_tokenizer_files

    out = tmp_path_factory.mktemp("front")
    write_tokenizer_files(out)
    config = {"model_type": "glm5_next", "architectures": ["Glm5NextForConditionalGeneration"]}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))

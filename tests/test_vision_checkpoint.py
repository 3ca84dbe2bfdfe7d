"""The tiny --vision checkpoint (serving/tools/tiny_model.py): transformers 5.17 loads it with
no missing or unexpected weight (but the NextN layer, which transformers drops), its tokenizer,
template and image processor are GLM's; our config and loader read the tower, never in FP8."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from serving.config import ModelConfig
from serving.front.images import ImageProcessorConfig
from serving.models.checkpoint_reader import CheckpointError
from serving.models.vision_loader import load_vision
from tests.tp_ranks import SMALL_MODEL


def test_transformers_loads_the_checkpoint_whole(tiny_vision_ckpt) -> None:
    from transformers import AutoTokenizer, Glm5NextForConditionalGeneration
    from transformers.models.glm5_next.image_processing_pil_glm5_next import (
        Glm5NextImageProcessorPil,
    )

    model, info = Glm5NextForConditionalGeneration.from_pretrained(
        tiny_vision_ckpt, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["mismatched_keys"]
    layers = model.config.text_config.num_hidden_layers  # the NextN layer only: transformers
    assert all(
        k.startswith(f"model.language_model.layers.{layers}.") for k in info["unexpected_keys"]
    )
    config = ModelConfig.from_pretrained(tiny_vision_ckpt)
    assert config.vision is not None and config.vision.depth == 2
    assert config.vision.out_hidden_size == config.hidden_size
    tower = load_vision(tiny_vision_ckpt, config, torch.float32, "cpu")
    theirs = model.model.visual.state_dict()
    assert all(torch.equal(theirs[k], v) for k, v in tower.state_dict().items())
    assert len(theirs) == len(tower.state_dict())

    processor = Glm5NextImageProcessorPil.from_pretrained(tiny_vision_ckpt)
    ours = ImageProcessorConfig.from_dict(
        json.loads((tiny_vision_ckpt / "preprocessor_config.json").read_text())
    )
    assert (processor.min_image_tokens, processor.max_image_tokens) == (4, 64)
    assert (ours.min_image_tokens, ours.max_image_tokens) == (4, 64)
    tokenizer = AutoTokenizer.from_pretrained(tiny_vision_ckpt)
    ids = tokenizer.convert_tokens_to_ids(["<|image|>", "<|begin_of_video|>"])
    assert ids == [config.image_token_id, config.video_start_token_id]
    assert model.config.image_token_id == config.image_token_id
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert "a<|begin_of_image|><|image|><|end_of_image|>" in text


def test_the_tower_is_never_fp8_and_must_be_whole(tiny_vision_ckpt, tmp_path) -> None:
    from serving.tools.quantize_fp8 import quantize_checkpoint

    fp8 = quantize_checkpoint(tiny_vision_ckpt, tmp_path / "fp8")
    tensors = load_file(str(fp8 / "model.safetensors"))
    assert all(
        v.dtype == torch.float32 for k, v in tensors.items() if k.startswith("model.visual.")
    )
    assert any(v.dtype == torch.float8_e4m3fn for v in tensors.values())
    config = ModelConfig.from_pretrained(fp8)
    assert (
        load_vision(fp8, config, torch.bfloat16, "cpu").merger.proj.weight.dtype == torch.bfloat16
    )

    for name, words in (
        ("model.visual.merger.proj.weight_scale_inv", "stored in FP8"),
        ("model.visual.extra.weight", "unknown tensor"),
    ):
        broken = dict(tensors, **{name: torch.ones(1)})
        save_file(broken, str(fp8 / "model.safetensors"))
        with pytest.raises(CheckpointError, match=words):
            load_vision(fp8, config, torch.float32, "cpu")
    del tensors["model.visual.merger.proj.weight"]
    save_file(tensors, str(fp8 / "model.safetensors"))
    with pytest.raises(CheckpointError, match="lacks model.visual.merger.proj.weight"):
        load_vision(fp8, config, torch.float32, "cpu")

    # a tower that cannot feed the text model is not served: text only (as the shipped small
    # model was before its tower was trained: transformers had saved its default tower); the
    # shipped model's tower now feeds its text width (training/train_vision.py)
    raw = json.loads((tiny_vision_ckpt / "config.json").read_text())
    raw["vision_config"]["out_hidden_size"] = 32
    assert ModelConfig.from_dict(raw).vision is None
    small = ModelConfig.from_pretrained(SMALL_MODEL)
    assert small.vision is not None and small.vision.out_hidden_size == small.hidden_size

"""Config validation and checkpoint loading: clear errors naming the field or tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from serving.config import ConfigError, ModelConfig
from serving.models.loader import CheckpointError, export_checkpoint, load_weights


def raw_config(tiny_ckpt) -> dict:
    return json.loads((tiny_ckpt / "config.json").read_text())


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "layer_types",
            ["linear_attention", "mamba", "linear_attention", "linear_attention"],
            "layer_types[1]='mamba'",
        ),
        ("index_topk", 30, "index_topk (30) must be divisible by index_kpool (4)"),
        ("mlp_layer_types", ["dense"] * 3, "mlp_layer_types has 3 entries"),
        ("indexer_types", ["full", "shared", "full", "full"], "indexer_types[1]='shared'"),
        ("qk_rope_head_dim", 64, "qk_rope_head_dim=64"),
        ("num_experts_per_tok", 99, "num_experts_per_tok (99)"),
    ],
)
def test_config_errors_name_the_field(tiny_ckpt, field, value, message):
    raw = raw_config(tiny_ckpt)
    raw["text_config"][field] = value
    with pytest.raises(
        ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")
    ):
        ModelConfig.from_dict(raw)


def test_missing_required_field(tiny_ckpt):
    raw = raw_config(tiny_ckpt)
    del raw["text_config"]["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig.from_dict(raw)


def test_flat_text_config_is_accepted(tiny_ckpt):
    raw = raw_config(tiny_ckpt)
    assert ModelConfig.from_dict(raw["text_config"]) == ModelConfig.from_dict(raw)


def _copy(tiny_ckpt, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, dst)
    return dst, load_file(str(dst / "model.safetensors"))


def test_unknown_tensor_is_named(tiny_ckpt, tmp_path):
    dst, tensors = _copy(tiny_ckpt, tmp_path)
    tensors["model.language_model.layers.0.self_attn.bogus.weight"] = torch.zeros(2)
    save_file(tensors, str(dst / "model.safetensors"))
    config = ModelConfig.from_pretrained(dst)
    with pytest.raises(CheckpointError, match="layers.0.self_attn.bogus.weight"):
        load_weights(dst, config, torch.float32)


def test_missing_tensor_is_named(tiny_ckpt, tmp_path):
    dst, tensors = _copy(tiny_ckpt, tmp_path)
    del tensors["model.language_model.layers.1.self_attn.indexer.wk.weight"]
    del tensors["model.language_model.layers.2.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(dst / "model.safetensors"))
    config = ModelConfig.from_pretrained(dst)
    with pytest.raises(CheckpointError, match=r"layers\.1\.self_attn\.indexer\.wk\.weight") as err:
        load_weights(dst, config, torch.float32)
    assert "layers.2.mlp.w13" in str(err.value)


def test_shape_mismatch_is_an_error(tiny_ckpt, tmp_path):
    dst, tensors = _copy(tiny_ckpt, tmp_path)
    name = "model.language_model.layers.0.self_attn.q_proj.weight"
    tensors[name] = torch.zeros(tensors[name].shape[0] + 1, tensors[name].shape[1])
    save_file(tensors, str(dst / "model.safetensors"))
    config = ModelConfig.from_pretrained(dst)
    with pytest.raises(CheckpointError, match="shape mismatch for .*q_proj.weight"):
        load_weights(dst, config, torch.float32)


def test_sharded_checkpoint_loads_the_same(tiny_ckpt, tmp_path):
    dst, tensors = _copy(tiny_ckpt, tmp_path)
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(dst / fname))
        weight_map.update({n: fname for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = ModelConfig.from_pretrained(dst)
    sharded, _ = load_weights(dst, config, torch.float32)
    single, _ = load_weights(tiny_ckpt, config, torch.float32)
    for (n, a), (_, b) in zip(sharded.named_parameters(), single.named_parameters()):
        assert torch.equal(a, b), n


def test_export_round_trip(tiny_ckpt):
    config = ModelConfig.from_pretrained(tiny_ckpt)
    target, draft = load_weights(tiny_ckpt, config, torch.float32, load_draft=True)
    exported = export_checkpoint(config, target, draft)
    on_disk = load_file(str(tiny_ckpt / "model.safetensors"))
    assert exported.keys() == on_disk.keys()
    for name, t in on_disk.items():
        assert torch.equal(exported[name], t), name


def test_bfloat16_load_keeps_float32_islands(tiny_ckpt):
    config = ModelConfig.from_pretrained(tiny_ckpt)
    target, _ = load_weights(tiny_ckpt, config, torch.bfloat16)
    params = dict(target.named_parameters())
    assert params["layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert params["layers.0.self_attn.A_log"].dtype == torch.float32
    assert params["layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32

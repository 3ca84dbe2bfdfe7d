"""Checkpoint tensor names -> our parameters: the glm5_next checkpoint's names (transformers'
and the original's, or flat text-only ones) mapped to a parameter of the target or the NextN
draft, and to the rows of it one tensor fills (one routed expert of a stacked tensor, one of
q/k/v of the fused conv). Under EP, other ranks' experts map to nothing."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from serving.config import ModelConfig
from serving.distributed import ParallelState, split
from serving.models.checkpoint_reader import CheckpointError

_SKIPPED = re.compile(r"^model\.visual\.|^visual\.")

# DeepSeek-style NextN copies of the shared embedding / head: the draft uses the target's.
_NEXTN_COPIES = re.compile(r"\.(embed_tokens\.weight|shared_head\.head\.weight)$")

_RENAMES = (
    (re.compile(r"\.hc_attn_(fn|base|scale)$"), r".attn_hc.\1"),
    (re.compile(r"\.hc_ffn_(fn|base|scale)$"), r".ffn_hc.\1"),
    (re.compile(r"\.self_attn\.o_norm\.weight$"), ".self_attn.o_norm"),
    (re.compile(r"\.indexer\.k_norm\.(weight|bias)$"), r".indexer.k_norm_\1"),
    (re.compile(r"\.shared_head\.norm\.weight$"), ".shared_head_norm.weight"),
)

_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")

_CONV = re.compile(r"\.self_attn\.([qkv])_conv1d\.weight$")


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: a parameter, or one expert's rows of a stacked one
    (and, held in FP8, their block scales: `scale_rows` of `<param>_scale_inv`)."""

    param: str
    expert: int | None = None
    rows: slice | None = None
    scale_rows: slice | None = None

    def view(self, data: torch.Tensor) -> torch.Tensor:
        if self.expert is not None:
            data = data[self.expert]
        return data if self.rows is None else data[self.rows]

    def scale_view(self, data: torch.Tensor) -> torch.Tensor:
        if self.expert is not None:
            data = data[self.expert]
        return data if self.scale_rows is None else data[self.scale_rows]


def map_name(
    name: str, config: ModelConfig, load_draft: bool, ps: ParallelState | None = None
) -> tuple[str, Target] | None:
    """Checkpoint name -> ("target"|"draft", Target), or None when skipped on purpose (also:
    another EP rank's expert). Rows and expert ids of the Target are this rank's."""
    ps = ps or ParallelState()
    if _SKIPPED.search(name):
        return None
    if name == "lm_head.weight":
        return "target", Target("lm_head.weight")
    for prefix in ("model.language_model.", "model."):
        if name.startswith(prefix):
            local = name[len(prefix) :]
            break
    else:
        raise CheckpointError(f"unexpected tensor {name!r} (not under model. or lm_head)")
    if local == "embed_tokens.weight":
        return "target", Target("embed_tokens")
    m = re.match(r"layers\.(\d+)\.(.*)$", local)
    if m is None:
        return "target", Target(local)
    layer, rest = int(m.group(1)), "." + m.group(2)
    role = "target"
    if layer >= config.num_hidden_layers:
        if layer > config.num_hidden_layers or config.num_nextn_predict_layers == 0:
            raise CheckpointError(f"tensor {name!r} is beyond the model's layers")
        if not load_draft or _NEXTN_COPIES.search(rest):
            return None
        role, prefix_out = "draft", ""
    else:
        prefix_out = f"layers.{layer}"
    for pattern, repl in _RENAMES:
        rest = pattern.sub(repl, rest)
    if em := _EXPERT.search(rest):
        expert, kind = int(em.group(1)), em.group(2)
        mine = split(config.n_routed_experts, ps.ep_size, ps.ep_rank)
        if not mine.start <= expert < mine.stop:
            return None
        expert -= mine.start
        base = rest[: em.start()] + ".mlp."
        if kind == "down_proj":
            return role, target_of(f"{prefix_out}{base}w2", expert)
        half = 0 if kind == "gate_proj" else 1
        inter = config.moe_intermediate_size // ps.moe_tp_size
        rows = slice(half * inter, (half + 1) * inter)
        nb = -(-inter // 128)  # block rows of each half's scales
        return role, target_of(
            f"{prefix_out}{base}w13", expert, rows, slice(half * nb, (half + 1) * nb)
        )
    if cm := _CONV.search(rest):
        part = "qkv".index(cm.group(1))
        qkv = config.kda_qkv_dim // ps.tp_size
        param = f"{prefix_out}{rest[: cm.start()]}.self_attn.conv_weight"
        return role, target_of(param, rows=slice(part * qkv, (part + 1) * qkv))
    return role, target_of(prefix_out + rest)


def target_of(
    param: str,
    expert: int | None = None,
    rows: slice | None = None,
    scale_rows: slice | None = None,
) -> Target:
    return Target(param.lstrip("."), expert, rows, scale_rows)

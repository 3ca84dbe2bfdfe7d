"""Random weights built in memory, on the target device: the init of the tiny, small and bench
checkpoints (serving/tools/tiny_model.py writes them to disk) and a simulated rank's shard
(--simulate-rank: no checkpoint is read).

Each parameter is drawn from its name: norms near 1, KDA gates and decay in their trained
ranges, projections with std 1/sqrt(fan_in), so activations stay in a sane range at any width.
The modules are built under the current ParallelState, so a rank gets its own shard's shapes;
the vocabulary's padding rows (serving/distributed.padded_vocab) are zero, as the loader leaves
them. Block FP8 (random_weights on a config with `quantization_config`): the modules a CUDA load
holds in FP8 get random values quantized per 128 x 128 block. Deterministic for a given seed,
device and ParallelState.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kernels.fp8 import quantize_weight
from serving.config import ModelConfig
from serving.distributed import state
from serving.layers.stacked_projections import stack_projections
from serving.models.fp8_loading import choose_and_hold, fp8_modules
from serving.models.fp8_weights import SCALE_SUFFIX
from serving.models.glm5_next import Glm5NextForCausalLM
from serving.models.nextn import NextNDraft
from serving.models.vision import VisionTower


def init_parameter(name: str, p: torch.Tensor, gen: torch.Generator) -> None:
    """Fill parameter `name` in place from `gen`."""
    p.copy_(draw(name, p, gen).to(p.dtype))


def draw(name: str, p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Parameter `name`'s random value (float32, p's shape and device) from `gen`."""

    def normal(std: float) -> torch.Tensor:
        return torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32) * std

    if name.endswith(("layernorm.weight", "norm.weight", "o_norm", "k_norm_weight")) or (
        name.endswith(("enorm.weight", "hnorm.weight"))
    ):
        value = 1.0 + normal(0.05)
    elif name.endswith(("k_norm_bias", ".base")):
        value = normal(0.05)
    elif name.endswith(".scale"):
        value = torch.ones(p.shape, device=p.device)
    elif name.endswith("A_log"):
        value = normal(0.3)
    elif name.endswith("dt_bias"):
        dt = torch.exp(
            torch.rand(p.shape, generator=gen, device=p.device) * math.log(100) + math.log(1e-3)
        )
        value = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    elif name.endswith("e_score_correction_bias"):
        value = normal(0.01)
    elif name.endswith("index_kpool_compress_ape"):
        value = normal(0.5)
    elif name == "embed_tokens":
        value = normal(1.0)
    elif name.endswith("conv_weight"):
        value = normal(0.3)
    else:  # projections: std 1/sqrt(fan_in)
        value = normal(p.shape[-1] ** -0.5)
    return value


def init_module(module: nn.Module, config: ModelConfig, gen: torch.Generator) -> None:
    """Every parameter of `module` from `gen`, in named_parameters order; padding rows zero.
    A weight held in block FP8 (its `<name>_scale_inv` beside it) gets its value quantized."""
    with torch.no_grad():
        params = dict(module.named_parameters())
        for name, p in params.items():
            if name.endswith(SCALE_SUFFIX):
                continue  # filled with its weight
            scale = params.get(name + SCALE_SUFFIX)
            if scale is not None:
                fill_fp8(name, p, scale, draw(name, p, gen))
                continue
            init_parameter(name, p, gen)
            shard = getattr(p, "shard", None)
            if getattr(p, "padded", False) and shard is not None:
                dim, _, rank = shard
                share = p.shape[dim]
                real = min(max(config.vocab_size - rank * share, 0), share)
                p.narrow(dim, real, share - real).zero_()


# experts quantized at a time: bounds the float32 temporaries of a stacked [E, ...] weight
FP8_CHUNK = 8


def fill_fp8(name: str, p: torch.Tensor, scale: torch.Tensor, value: torch.Tensor) -> None:
    """p (float8_e4m3fn) and its block scales from `value`, quantized as quantize_fp8 writes a
    checkpoint: a routed w13's gate and up halves apart (each with its own scale blocks)."""
    lead = value.shape[:-2]
    for e0 in range(0, lead.numel() if lead else 1, FP8_CHUNK):
        part = slice(e0, e0 + FP8_CHUNK)
        v, w8, s = (value[part], p[part], scale[part]) if lead else (value, p, scale)
        if name.endswith(".w13"):
            rows, nb = v.shape[-2] // 2, scale.shape[-2] // 2
            for half in (0, 1):
                q, qs = quantize_weight(v[..., half * rows : (half + 1) * rows, :])
                w8[..., half * rows : (half + 1) * rows, :] = q
                s[..., half * nb : (half + 1) * nb, :] = qs
        else:
            q, qs = quantize_weight(v)
            w8.copy_(q)
            s.copy_(qs)


def random_weights(
    config: ModelConfig,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    draft: bool = True,
    fp8_execution: bool | None = None,
    keep_bf16: frozenset[str] = frozenset(),
    fp8_linears: str = "timed",
) -> tuple[Glm5NextForCausalLM, NextNDraft | None]:
    """This rank's target (and NextN draft) with random weights, allocated on `device` only.

    A config with `quantization_config` (block FP8, as GLM-5.3-Flash is published) on CUDA, or
    with fp8_execution, gets what a CUDA load of that checkpoint holds (the loader's rules: every
    module with FP8 kernels, minus keep_bf16 and the projection shapes fp8_choice sends to the
    dense path) as random float8_e4m3fn weights with float32 block scales; kv_b and the rest in
    `dtype`. The target's `fp8_choice` records the decision (None: bf16 build). Built on the
    meta device first, so nothing is allocated twice."""
    if fp8_execution is None:
        fp8_execution = torch.device(device).type == "cuda"
    fp8 = fp8_execution and config.quantization is not None
    with torch.device("meta"):
        roles = {"target": Glm5NextForCausalLM(config, dtype)}
        if draft:
            roles["draft"] = NextNDraft(config, dtype)
    choice = None
    if fp8:
        holders = fp8_modules(roles, None, set(), config, draft, state(), keep_bf16)
        choice = choose_and_hold(holders, dtype, device, fp8_linears)
    gen = torch.Generator(device=device).manual_seed(seed)
    for module in roles.values():
        _materialize(module, device)
        init_module(module, config, gen)
        module.eval()
    roles["target"].fp8_choice = choice  # type: ignore[assignment]
    stack_projections(*roles.values())
    return roles["target"], roles.get("draft")  # type: ignore[return-value]


def random_vision(
    config: ModelConfig, dtype: torch.dtype, device: str, seed: int = 0
) -> VisionTower:
    """The vision tower of `config` with random weights (its own generator, so the text
    model's weights do not depend on it): norms near 1, biases small, projections with std
    1/sqrt(fan_in) over all of a kernel's inputs."""
    assert config.vision is not None
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    with torch.device(device):
        tower = VisionTower(config.vision, dtype)
    with torch.no_grad():
        for name, p in tower.named_parameters():
            value = torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32)
            if "norm" in name and name.endswith("weight"):
                value = 1.0 + 0.05 * value
            elif name.endswith("bias"):
                value = 0.02 * value
            else:
                value = value * p[0].numel() ** -0.5
            p.copy_(value.to(dtype))
    return tower.eval()


def _materialize(module: nn.Module, device: str) -> None:
    """Allocate a meta-built module's parameters on `device`, uninitialised. to_empty makes new
    Parameters: their marks (`shard`, `padded`: serving/layers/linear.py) are carried over."""
    marks = {name: dict(vars(p)) for name, p in module.named_parameters()}
    module.to_empty(device=device)
    for name, p in module.named_parameters():
        vars(p).update(marks[name])

"""Random weights built in memory, on the target device: the init of the tiny, small and bench
checkpoints (serving/tools/tiny_model.py writes them to disk) and a simulated rank's shard
(--simulate-rank: no checkpoint is read).

Each parameter is drawn from its name: norms near 1, KDA gates and decay in their trained
ranges, projections with std 1/sqrt(fan_in), so activations stay in a sane range at any width.
The modules are built under the current ParallelState, so a rank gets its own shard's shapes;
the vocabulary's padding rows (serving/distributed.padded_vocab) are zero, as the loader leaves
them. Deterministic for a given seed, device and ParallelState.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from serving.config import ModelConfig
from serving.models.glm5_next import Glm5NextForCausalLM
from serving.models.nextn import NextNDraft


def init_parameter(name: str, p: torch.Tensor, gen: torch.Generator) -> None:
    """Fill parameter `name` in place from `gen`."""

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
    p.copy_(value.to(p.dtype))


def init_module(module: nn.Module, config: ModelConfig, gen: torch.Generator) -> None:
    """Every parameter of `module` from `gen`, in named_parameters order; padding rows zero."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            init_parameter(name, p, gen)
            shard = getattr(p, "shard", None)
            if getattr(p, "padded", False) and shard is not None:
                dim, _, rank = shard
                share = p.shape[dim]
                real = min(max(config.vocab_size - rank * share, 0), share)
                p.narrow(dim, real, share - real).zero_()


def random_weights(
    config: ModelConfig, dtype: torch.dtype, device: str, seed: int = 0, draft: bool = True
) -> tuple[Glm5NextForCausalLM, NextNDraft | None]:
    """This rank's target (and NextN draft) with random weights, allocated on `device` only."""
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        modules = [Glm5NextForCausalLM(config, dtype)]
        if draft:
            modules.append(NextNDraft(config, dtype))
    for module in modules:
        init_module(module, config, gen)
        module.eval()
    return modules[0], (modules[1] if draft else None)

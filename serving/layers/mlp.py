"""Dense SwiGLU MLP and the MoE block (router, routed experts, shared experts)."""

from __future__ import annotations

import torch
from torch import nn

from kernels import fast_path
from kernels import moe as moe_kernels
from serving.config import ModelConfig
from serving.layers.linear import Linear, param


class DenseMLP(nn.Module):
    """SwiGLU with the GLM clamp; gate/up column-parallel, down row-parallel (all-reduce after)."""

    def __init__(self, hidden: int, inter: int, limit: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, inter, dtype)
        self.up_proj = Linear(hidden, inter, dtype)
        self.down_proj = Linear(inter, hidden, dtype)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = moe_kernels.swiglu(self.gate_proj(x), self.up_proj(x), self.limit)
        return self.down_proj(h)


class Router(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = param(config.n_routed_experts, config.hidden_size, dtype=dtype)
        self.e_score_correction_bias = param(config.n_routed_experts, dtype=torch.float32)


class MoE(nn.Module):
    """Routed experts (stacked [E, ...], shardable by expert id) plus shared experts."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        e, h, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.gate = Router(config, dtype)
        self.w13 = param(e, 2 * i, h, dtype=dtype)  # per expert: gate_proj rows, then up_proj rows
        self.w2 = param(e, h, i, dtype=dtype)
        self.shared_experts = DenseMLP(h, i * config.n_shared_experts, config.swiglu_limit, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        weights, ids = moe_kernels.route(
            x,
            self.gate.weight,
            self.gate.e_score_correction_bias,
            c.num_experts_per_tok,
            c.n_group,
            c.topk_group,
            c.norm_topk_prob,
            c.routed_scaling_factor,
        )
        routed = _experts(x)(x, self.w13, self.w2, weights, ids, c.swiglu_limit)
        return routed + self.shared_experts(x)  # all-reduce point under TP/EP


# With the torch kernels on CUDA (PDSERVE_TORCH_KERNELS=1), batches this small use the sync-free
# dense expert path, eager or captured alike, so CUDA graphs on and off compute the same thing;
# it is then also the most tokens a captured forward may hold (the sorted path syncs with the
# host). The fused Triton MoE has neither limit: one capturable path for every batch size.
DENSE_EXPERTS_MAX_TOKENS = 128


def _experts(x: torch.Tensor):
    if fast_path(x):
        from kernels.triton.moe import experts

        return experts
    if x.is_cuda and x.shape[0] <= DENSE_EXPERTS_MAX_TOKENS:
        return moe_kernels.experts_dense
    return moe_kernels.experts


def max_captured_tokens(device: torch.device) -> int | None:
    """The most tokens one captured forward may hold on `device` (None: no limit)."""
    probe = torch.empty(0, device=device)
    return None if fast_path(probe) else DENSE_EXPERTS_MAX_TOKENS


def make_mlp(config: ModelConfig, layer: int, dtype: torch.dtype) -> nn.Module:
    if layer < config.num_hidden_layers and config.mlp_layer_types[layer] == "dense":
        return DenseMLP(config.hidden_size, config.intermediate_size, config.swiglu_limit, dtype)
    return MoE(config, dtype)

"""Small building blocks: norms, linear layers, mHC hyper-connections, dense MLP and MoE.

Parameters are created empty; the checkpoint loader fills every one of them (a parameter it
cannot fill is an error). Names follow the checkpoint so loading is a lookup, not a rename.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import mhc as mhc_kernels
from kernels import moe as moe_kernels
from serving.config import ModelConfig


def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T. Under TP: column-parallel (split rows of W) or row-parallel (split columns)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = param(out_features, in_features, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = param(dim, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class HyperConnection(nn.Module):
    """mHC: collapse `hc` residual streams into the sublayer input, then mix them back.

    `pre` collapses the streams, `post` places the sublayer output on each stream, `comb` (a
    Sinkhorn-normalised, doubly stochastic hc x hc matrix) mixes the residual streams.
    Parameters stay float32 (the mixing is computed in float32).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hc = config.hc_mult
        self.hc, self.eps = hc, config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.iters = config.hc_sinkhorn_iters
        mix = (2 + hc) * hc
        self.fn = param(mix, hc * config.hidden_size, dtype=torch.float32)
        self.base = param(mix, dtype=torch.float32)
        self.scale = param(3, dtype=torch.float32)

    def collapse(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams: [T, hc, Hd] -> (post [T, hc], comb [T, hc, hc], collapsed [T, Hd])."""
        hc = self.hc
        flat = streams.flatten(1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        mix = F.linear(flat, self.fn)
        pre, post, comb = mhc_kernels.mhc_mix(mix, self.base, self.scale, hc, self.iters, self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def expand(
        out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """out: [T, Hd] sublayer output; residual: [T, hc, Hd] -> new streams [T, hc, Hd]."""
        dtype = residual.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), residual
        )


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
        experts = moe_kernels.experts_dense if _dense_experts(x) else moe_kernels.experts
        routed = experts(x, self.w13, self.w2, weights, ids, c.swiglu_limit)
        return routed + self.shared_experts(x)  # all-reduce point under TP/EP


# On CUDA, batches this small (decode, speculative verify) use the sync-free dense expert path,
# eager or captured alike, so CUDA graphs on and off compute the same thing. It is also the
# most tokens a captured forward may hold (the sorted path syncs with the host).
DENSE_EXPERTS_MAX_TOKENS = 128


def _dense_experts(x: torch.Tensor) -> bool:
    return x.is_cuda and x.shape[0] <= DENSE_EXPERTS_MAX_TOKENS


def make_mlp(config: ModelConfig, layer: int, dtype: torch.dtype) -> nn.Module:
    if layer < config.num_hidden_layers and config.mlp_layer_types[layer] == "dense":
        return DenseMLP(config.hidden_size, config.intermediate_size, config.swiglu_limit, dtype)
    return MoE(config, dtype)

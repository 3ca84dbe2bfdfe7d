"""KDA (Kimi Delta Attention) layer: the linear-attention layers of GLM-5.3-Flash.

Projections, gates and the gated output norm; the stateful core (conv + delta rule over the
request rows' states, the gates, the gated norm) is serving/layers/attention/kda.py. A decode or
verify step is the input GEMM (in_proj), the core in one call (decode_core: on the fast path one
kernel, which applies f_b_proj and g_b_proj too), and o_proj.
Heads shard under TP: q/k/v/g_b/f_b column-parallel, o_proj row-parallel (all-reduce after).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.kda import KDAWeights
from serving.config import ModelConfig
from serving.distributed import state
from serving.forward_batch import ForwardBatch
from serving.layers.attention.kda import decode_core, extend_core
from serving.layers.linear import Linear, param, shard, tp_param
from serving.layers.stacked_projections import StackedProjections
from serving.memory.cache import KDALayerCache


class KDAttention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, heads, dim = config.hidden_size, config.linear_num_heads, config.linear_head_dim
        qkv = heads * dim
        tp = state()
        self.heads, self.dim = heads // tp.tp_size, dim  # this rank's heads
        self.lower_bound = config.linear_lower_bound
        self.q_proj = Linear(hidden, qkv, dtype, split="column", kind="kda")
        self.k_proj = Linear(hidden, qkv, dtype, split="column", kind="kda")
        self.v_proj = Linear(hidden, qkv, dtype, split="column", kind="kda")
        # q, k, v depthwise conv kernels concatenated in that order (each this rank's channels);
        # kept in float32. The loader fills each third from its own checkpoint tensor.
        local_qkv = qkv // tp.tp_size
        self.conv_weight = shard(
            param(3 * local_qkv, config.linear_conv_kernel_dim, dtype=torch.float32),
            0,
            tp.tp_size,
            tp.tp_rank,
        )
        self.f_a_proj = Linear(hidden, dim, dtype, kind="kda")
        self.f_b_proj = Linear(dim, qkv, dtype, split="column", kind="kda")
        self.dt_bias = tp_param(qkv, dtype=torch.float32)
        self.A_log = tp_param(heads, dtype=torch.float32)
        self.b_proj = Linear(hidden, heads, dtype, split="column", kind="kda")
        self.g_a_proj = Linear(hidden, dim, dtype, kind="kda")
        self.g_b_proj = Linear(dim, qkv, dtype, split="column", kind="kda")
        self.o_norm = param(dim, dtype=torch.float32)
        self.norm_eps = config.rms_norm_eps
        self.o_proj = Linear(qkv, hidden, dtype, split="row", kind="kda")
        self.in_proj = StackedProjections(
            self, ("q_proj", "k_proj", "v_proj", "f_a_proj", "g_a_proj", "b_proj")
        )

    def core_weights(self) -> KDAWeights:
        """The parameters the core reads (f_b and g_b as held: the dtype, or block FP8)."""
        return KDAWeights(
            self.conv_weight, self.dt_bias, self.A_log, self.o_norm, self.lower_bound,
            self.norm_eps, self.f_b_proj.weight, self.f_b_proj.weight_scale_inv,
            self.g_b_proj.weight, self.g_b_proj.weight_scale_inv,
        )  # fmt: skip

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cache: KDALayerCache,
        history: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """history (multi-token batches): receives [conv inputs, per-position states]."""
        q, k, v, f_a, g_a, b = self.in_proj(x)
        weights = self.core_weights()
        if batch.is_decode or batch.step_len is not None:
            core = decode_core(q, k, v, f_a, g_a, b, weights, batch, cache, history)
        else:
            f, gate = self.f_b_proj(f_a), self.g_b_proj(g_a)
            core = extend_core(q, k, v, f, gate, b, weights, batch, cache, history)
        return self.o_proj(core)

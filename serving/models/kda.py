"""KDA (Kimi Delta Attention) layer: the linear-attention layers of GLM-5.3-Flash.

Projections, gates and the gated output norm; the stateful core (conv + delta rule over the
request rows' states) is serving/layers/attention/kda.py.
Heads shard under TP: q/k/v/g_b/f_b column-parallel, o_proj row-parallel (all-reduce after).
"""

from __future__ import annotations

import torch
from torch import nn

from serving.config import ModelConfig
from serving.distributed import state
from serving.forward_batch import ForwardBatch
from serving.layers.attention.kda import delta_rule, short_conv
from serving.layers.linear import Linear, StackedProjections, param, shard, tp_param
from serving.memory.cache import KDALayerCache

# On CUDA a decode batch runs the layer's core in one kernel (KDAttention._decode_fused); False
# runs it unfused, as on the CPU (an A/B in benchmarks). FUSED_VERIFY does the same for a
# speculative verify (step_len tokens per request, recording the roll-back's history); it applies
# only while FUSED_DECODE is on. tests/test_gpu.py::test_fused_kda_verify_equals_plain_decode
# holds its greedy tokens to plain decoding's (EAGLE 1 and 3 steps, graphs, overlap).
FUSED_DECODE = True
FUSED_VERIFY = True


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

    def _forget_gate(self, f_a: torch.Tensor) -> torch.Tensor:
        """Per-channel log decay g [T, H, Dk] (float32) from f_a_proj's output."""
        g = self.f_b_proj(f_a).float() + self.dt_bias
        g = g.view(-1, self.heads, self.dim)
        rate = self.A_log.exp().view(1, self.heads, 1)
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(rate * g)
        return -rate * torch.nn.functional.softplus(g, threshold=20.0)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cache: KDALayerCache,
        history: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """history (multi-token batches): receives [conv inputs, per-position states]."""
        q, k, v, f_a, g_a, b = self.in_proj(x)
        step_len = 1 if batch.is_decode else (batch.step_len if FUSED_VERIFY else None)
        if step_len is not None and x.is_cuda and FUSED_DECODE:
            core = self._decode_fused(q, k, v, f_a, g_a, b, batch, cache, step_len, history)
            return self.o_proj(core)
        mixed = torch.cat([q, k, v], dim=-1)
        mixed = short_conv(mixed, self.conv_weight, batch, cache, history)
        q, k, v = (t.view(-1, self.heads, self.dim) for t in mixed.chunk(3, dim=-1))
        g = self._forget_gate(f_a)
        beta = torch.sigmoid(b).float()
        o = delta_rule(q, k, v, g, beta, batch, cache, history)
        # gated RMSNorm per head, in float32
        of = o.float()
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.norm_eps) * self.o_norm
        gate = self.g_b_proj(g_a).view(-1, self.heads, self.dim).float()
        o = (of * torch.sigmoid(gate)).to(x.dtype).flatten(1)
        return self.o_proj(o)

    def _decode_fused(
        self, q, k, v, f_a, g_a, b, batch: ForwardBatch, cache: KDALayerCache, step_len, history
    ):
        """forward's core for step_len tokens per request (a decode step, or a speculative
        verify's, which records the history its roll-back reads) in one CUDA kernel: a decode
        step at TP8 runs 34 KDA layers, about 15 small launches each unfused. Same math,
        rounded where forward rounds (kernels/triton/kda.py kda_decode_layer)."""
        from kernels.triton.kda import KDADecodeWeights, kda_decode_layer

        weights = KDADecodeWeights(
            self.conv_weight, self.dt_bias, self.A_log, self.o_norm, self.lower_bound,
            self.norm_eps,
        )  # fmt: skip
        return kda_decode_layer(
            q, k, v, self.f_b_proj(f_a), b, self.g_b_proj(g_a), weights, cache.conv,
            cache.state, batch.req_rows, step_len, history,
        )  # fmt: skip

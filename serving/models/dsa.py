"""DSA layer: MLA with NoPE over a paged latent cache, selected by a kpool-compressed indexer.

Projections and the absorbed-form math; what touches the caches (latent and pooled-key writes,
the tail ring, selection, sparse attention) is serving/layers/attention/dsa.py.
Heads shard under TP: q_b/kv_b column-parallel, o_proj row-parallel (all-reduce after). The
indexer is replicated (all its heads on every rank), so every rank selects the same tokens with
no collective; the latent cache and pooled keys are per token, replicated.
Two projections of q_lora, MLA's q_b and the indexer's wq_b, run as one GEMM (q_proj).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.dsa_decode import IndexQuery, IndexWrite
from serving.config import ModelConfig
from serving.distributed import state
from serving.forward_batch import ForwardBatch
from serving.layers.attention.dsa import (
    IndexerShape,
    StepCounters,
    attend_step,
    is_step,
    query_step,
    select_positions,
    sparse_mla,
    write_latent,
    write_step,
)
from serving.layers.linear import Linear, param
from serving.layers.norm import RMSNorm
from serving.layers.stacked_projections import StackedProjections
from serving.memory.cache import DSALayerCache

K_NORM_EPS = 1e-6  # the index key's LayerNorm


class Indexer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        d, heads = config.index_head_dim, config.index_n_heads
        self.d, self.heads, self.scale = d, heads, heads**-0.5
        self.shape = IndexerShape(
            config.index_kpool,
            config.index_select_pools,
            config.index_kpool_always_select_tail,
            d,
        )
        self.wq_b = Linear(config.q_lora_rank, heads * d, dtype, kind="indexer")
        self.wk = Linear(config.hidden_size, d, dtype, kind="indexer")
        self.k_norm_weight = param(d, dtype=dtype)
        self.k_norm_bias = param(d, dtype=dtype)
        self.weights_proj = Linear(config.hidden_size, heads, dtype)
        self.index_kpool_compress_gate = param(d, config.hidden_size, dtype=dtype)
        self.index_kpool_compress_ape = param(config.index_kpool, d, dtype=torch.float32)
        self.counters = StepCounters()

    # what the indexer projects from the layer's input x, in its owner's StackedProjections
    X_PROJECTIONS = ("wk", "index_kpool_compress_gate", "weights_proj")

    def forward(
        self,
        x_proj: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        qi: torch.Tensor,
        batch: ForwardBatch,
        cache: DSALayerCache,
    ) -> torch.Tensor:
        """A ragged batch: writes its index keys, returns the selection [T, index_width]
        (positions in each token's request, -1 = empty). x_proj: X_PROJECTIONS applied to the
        layer's input; qi: wq_b's."""
        wk, gates, head_w = x_proj
        q = qi.view(-1, self.heads, self.d)
        k = F.layer_norm(wk, (self.d,), self.k_norm_weight, self.k_norm_bias, eps=K_NORM_EPS)
        head_w = head_w.float() * self.scale
        return select_positions(
            self.shape, q, k, gates, head_w, self.index_kpool_compress_ape, batch, cache
        )

    def step_write(self, x_proj: tuple[torch.Tensor, ...], cache: DSALayerCache) -> IndexWrite:
        wk, gates, _ = x_proj
        assert cache.index_keys is not None and cache.tail_keys is not None
        assert cache.tail_gates is not None
        return IndexWrite(
            wk, gates, self.k_norm_weight, self.k_norm_bias, K_NORM_EPS,
            self.index_kpool_compress_ape, cache.index_keys, cache.tail_keys, cache.tail_gates,
        )  # fmt: skip

    def step_query(
        self, qi: torch.Tensor, x_proj: tuple[torch.Tensor, ...], cache: DSALayerCache
    ) -> IndexQuery:
        assert cache.index_keys is not None
        s = self.shape
        return IndexQuery(
            qi.view(-1, self.heads, self.d), x_proj[2], self.scale, cache.index_keys,
            s.kpool, s.select_pools, s.select_tail,
        )  # fmt: skip


class DSAttention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, has_indexer: bool) -> None:
        super().__init__()
        h, r = config.num_attention_heads, config.kv_lora_rank
        self.heads, self.rank = h // state().tp_size, r  # this rank's heads
        self.nope, self.v_dim = config.qk_nope_head_dim, config.v_head_dim
        self.scale = self.nope**-0.5
        self.q_a_proj = Linear(config.hidden_size, config.q_lora_rank, dtype, kind="mla")
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps, dtype)
        self.q_b_proj = Linear(config.q_lora_rank, h * self.nope, dtype, split="column", kind="mla")
        self.kv_a_proj_with_mqa = Linear(config.hidden_size, r, dtype, kind="mla")
        self.kv_a_layernorm = RMSNorm(r, config.rms_norm_eps, dtype)
        # read as a matrix by the absorbed form (no kind): an FP8 kv_b is dequantized at load
        self.kv_b_proj = Linear(r, h * (self.nope + self.v_dim), dtype, split="column")
        self.o_proj = Linear(h * self.v_dim, config.hidden_size, dtype, split="row", kind="mla")
        self.indexer = Indexer(config, dtype) if has_indexer else None
        from_x = ("q_a_proj", "kv_a_proj_with_mqa")
        from_q_lora = ("q_b_proj",)
        if has_indexer:
            from_x += tuple(f"indexer.{name}" for name in Indexer.X_PROJECTIONS)
            from_q_lora += ("indexer.wq_b",)
        self.in_proj = StackedProjections(self, from_x)
        self.q_proj = StackedProjections(self, from_q_lora)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cache: DSALayerCache,
        shared_selection: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (output [T, Hd], the selection [T, W] for a later shared layer: cache slots on
        the step path, positions on the extend path)."""
        q_a, kv_a, *indexer_in = self.in_proj(x)
        kv_b = self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.rank)
        kv_b_nope, kv_b_v = kv_b[:, : self.nope], kv_b[:, self.nope :]
        idx = self.indexer
        if is_step(batch):  # graph-safe; four launches between the projections on CUDA
            index = None if idx is None else idx.step_write(indexer_in, cache)
            norms = (self.q_a_layernorm, self.kv_a_layernorm)
            q_lora = write_step(q_a, kv_a, *norms, index, batch, cache)
            q, *qi = self.q_proj(q_lora)
            query = None if idx is None else idx.step_query(qi[0], indexer_in, cache)
            counters = None if idx is None else idx.counters
            q = q.view(-1, self.heads, self.nope)
            q_abs, selection = query_step(q, kv_b_nope, query, counters, batch)
            selection = _shared(selection, shared_selection)
            o = attend_step(q_abs, selection, kv_b_v, cache, self.scale)
            return self.o_proj(o), selection
        q_lora = self.q_a_layernorm(q_a)
        write_latent(self.kv_a_layernorm(kv_a), batch, cache)
        q, *qi = self.q_proj(q_lora)
        selection = None if idx is None else idx(tuple(indexer_in), qi[0], batch, cache)
        selection = _shared(selection, shared_selection)
        q_abs = torch.einsum("thd,hdr->thr", q.view(-1, self.heads, self.nope), kv_b_nope)
        o_lat = sparse_mla(q_abs, selection, batch, cache, self.scale)
        o = torch.einsum("thr,hvr->thv", o_lat, kv_b_v)
        return self.o_proj(o.flatten(1)), selection


def _shared(own: torch.Tensor | None, shared: torch.Tensor | None) -> torch.Tensor:
    if own is not None:
        return own
    assert shared is not None, "shared DSA layer without a full layer before it"
    return shared

"""DSA layer: MLA with NoPE over a paged latent cache, selected by a kpool-compressed indexer.

Projections and the absorbed-form math; what touches the caches (latent and pooled-key writes,
the tail ring, selection, sparse attention) is serving/layers/attention/dsa.py.
Heads shard under TP: q_b/kv_b column-parallel, o_proj row-parallel (all-reduce after); the
indexer's heads shard like q_b and its pool scores are summed across ranks before top-k, so
every rank selects the same tokens; the latent cache and pooled keys are per token, replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from serving.config import ModelConfig
from serving.distributed import state
from serving.forward_batch import ForwardBatch
from serving.layers.attention.dsa import (
    IndexerShape,
    select_positions,
    sparse_mla,
    write_latent,
)
from serving.layers.linear import Linear, StackedProjections, param
from serving.layers.norm import RMSNorm
from serving.memory.cache import DSALayerCache


class Indexer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        d, heads = config.index_head_dim, config.index_n_heads
        # this rank's heads; the head weights keep the full count's scale, so the partial pool
        # scores of the ranks sum (select_positions all-reduces them) to the unsplit score
        self.d, self.heads, self.scale = d, heads // state().tp_size, heads**-0.5
        self.shape = IndexerShape(
            config.index_kpool,
            config.index_select_pools,
            config.index_kpool_always_select_tail,
            d,
        )
        self.wq_b = Linear(config.q_lora_rank, heads * d, dtype, split="column", kind="indexer")
        self.wk = Linear(config.hidden_size, d, dtype, kind="indexer")
        self.k_norm_weight = param(d, dtype=dtype)
        self.k_norm_bias = param(d, dtype=dtype)
        self.weights_proj = Linear(config.hidden_size, heads, dtype, split="column")
        self.index_kpool_compress_gate = param(d, config.hidden_size, dtype=dtype)
        self.index_kpool_compress_ape = param(config.index_kpool, d, dtype=torch.float32)

    # what the indexer projects from the layer's input x, in its owner's StackedProjections
    X_PROJECTIONS = ("wk", "index_kpool_compress_gate", "weights_proj")

    def forward(
        self,
        x_proj: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        q_lora: torch.Tensor,
        batch: ForwardBatch,
        cache: DSALayerCache,
    ) -> torch.Tensor:
        """Returns selected token positions [T, index_width] (-1 = empty) per new token.
        x_proj: X_PROJECTIONS applied to the layer's input."""
        wk, gates, head_w = x_proj
        q = self.wq_b(q_lora).view(-1, self.heads, self.d)
        k = F.layer_norm(wk, (self.d,), self.k_norm_weight, self.k_norm_bias, eps=1e-6)
        head_w = head_w.float() * self.scale
        return select_positions(
            self.shape, q, k, gates, head_w, self.index_kpool_compress_ape, batch, cache
        )


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
        if has_indexer:
            from_x += tuple(f"indexer.{name}" for name in Indexer.X_PROJECTIONS)
        self.in_proj = StackedProjections(self, from_x)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cache: DSALayerCache,
        shared_positions: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (output [T, Hd], selected positions [T, W]) for a later shared layer."""
        q_a, kv_a, *indexer_in = self.in_proj(x)
        q_lora = self.q_a_layernorm(q_a)
        q = self.q_b_proj(q_lora).view(-1, self.heads, self.nope)
        write_latent(self.kv_a_layernorm(kv_a), batch, cache)
        if self.indexer is not None:
            positions = self.indexer(tuple(indexer_in), q_lora, batch, cache)
        else:
            assert shared_positions is not None, "shared DSA layer without a full layer before it"
            positions = shared_positions
        kv_b = self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.rank)
        q_abs = torch.einsum("thd,hdr->thr", q, kv_b[:, : self.nope])
        o_lat = sparse_mla(q_abs, positions, batch, cache, self.scale)
        o = torch.einsum("thr,hvr->thv", o_lat, kv_b[:, self.nope :])
        return self.o_proj(o.flatten(1)), positions

"""DSA layer: MLA with NoPE over a paged latent cache, selected by a kpool-compressed indexer.

Order inside a step (it matters): write this step's latents, pooled keys and tails first; then
score and select; then attend. A query may therefore select its own pool or tail.
Heads shard under TP: q_b/kv_b column-parallel, o_proj row-parallel (all-reduce after); the
indexer's heads shard like q_b and its scores would need one sum across ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import indexer as idx_kernels
from kernels.sparse_mla import sparse_mla_attention
from serving.config import ModelConfig
from serving.forward_batch import ForwardBatch
from serving.memory.cache import DSALayerCache
from serving.models.layers import Linear, RMSNorm, param


class Indexer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        d, heads = config.index_head_dim, config.index_n_heads
        self.d, self.heads = d, heads
        self.kpool = config.index_kpool
        self.select_pools = config.index_select_pools
        self.select_tail = config.index_kpool_always_select_tail
        self.wq_b = Linear(config.q_lora_rank, heads * d, dtype)
        self.wk = Linear(config.hidden_size, d, dtype)
        self.k_norm_weight = param(d, dtype=dtype)
        self.k_norm_bias = param(d, dtype=dtype)
        self.weights_proj = Linear(config.hidden_size, heads, dtype)
        self.index_kpool_compress_gate = param(d, config.hidden_size, dtype=dtype)
        self.index_kpool_compress_ape = param(self.kpool, d, dtype=torch.float32)

    def forward(
        self, x: torch.Tensor, q_lora: torch.Tensor, batch: ForwardBatch, cache: DSALayerCache
    ) -> torch.Tensor:
        """Returns selected token positions [T, index_width] (-1 = empty) per new token."""
        q = self.wq_b(q_lora).view(-1, self.heads, self.d)
        k = F.layer_norm(self.wk(x), (self.d,), self.k_norm_weight, self.k_norm_bias, eps=1e-6)
        gates = F.linear(x, self.index_kpool_compress_gate)
        head_w = self.weights_proj(x).float() * self.heads**-0.5
        if batch.is_decode or batch.step_len is not None:
            self._write_tokens(k, gates, batch, cache)
            return self._select_tokens(q, head_w, batch, cache)
        return self._extend(q, k, gates, head_w, batch, cache)

    def _pool_slots(self, req_to_token: torch.Tensor, row: torch.Tensor, pools: torch.Tensor):
        """Index-key rows of pools `pools` of request `row` (see memory/cache.py)."""
        return req_to_token[row, pools * self.kpool] // self.kpool

    def _extend(self, q, k, gates, head_w, batch: ForwardBatch, cache: DSALayerCache):
        kp, ring = self.kpool, cache.tail_slots
        r2t = batch.req_to_token
        out = []
        offset = 0
        for b, (start, n) in enumerate(zip(batch.starts_cpu, batch.lens_cpu)):
            row = batch.req_rows[b]
            end = start + n
            chunk = slice(offset, offset + n)
            # 1. pools that close in this chunk; early members come from the ring
            base = (start // kp) * kp
            ring_pos = torch.arange(base, start, device=k.device) % ring
            all_k = torch.cat([cache.tail_keys[row, ring_pos], k[chunk]])
            all_g = torch.cat([cache.tail_gates[row, ring_pos], gates[chunk]])
            first, last = start // kp, end // kp
            if last > first:
                count = last - first
                pooled = idx_kernels.kpool_compress(
                    all_k[: count * kp].view(count, kp, -1),
                    all_g[: count * kp].view(count, kp, -1),
                    self.index_kpool_compress_ape,
                )
                dst = self._pool_slots(r2t, row, torch.arange(first, last, device=k.device))
                cache.index_keys[dst] = pooled.to(cache.index_keys.dtype)
            # 2. the ring keeps the last `ring` positions (the open pool among them)
            keep = torch.arange(max(start, end - ring), end, device=k.device)
            cache.tail_keys[row, keep % ring] = k[offset + keep - start].to(cache.tail_keys.dtype)
            cache.tail_gates[row, keep % ring] = gates[offset + keep - start].to(
                cache.tail_gates.dtype
            )
            # 3. score every complete pool of the request, select per query
            pool_keys = cache.index_keys[
                self._pool_slots(r2t, row, torch.arange(last, device=k.device))
            ]
            scores = idx_kernels.score_pools(
                q[chunk], head_w[chunk], pool_keys.unsqueeze(0), self.d**-0.5
            )
            out.append(
                idx_kernels.select_tokens(
                    scores, batch.positions[chunk], kp, self.select_pools, self.select_tail
                )
            )
            offset += n
        return torch.cat(out)

    def _write_tokens(self, k, gates, batch: ForwardBatch, cache: DSALayerCache) -> None:
        """Graph-safe write for batches of step_len tokens per request (decode, verify).

        All of the step's keys enter the ring before any pool is compressed, so a pool that
        closes mid-step finds its members. The ring holds kpool-1 + step_len slots, so this
        step's writes never evict a member of a pool it still closes."""
        kp, ring = self.kpool, cache.tail_slots
        assert batch.step_len is None or batch.step_len <= ring - kp + 1, "ring too small"
        rows, pos = batch.req_rows[batch.token_req], batch.positions
        cache.tail_keys[rows, pos % ring] = k.to(cache.tail_keys.dtype)
        cache.tail_gates[rows, pos % ring] = gates.to(cache.tail_gates.dtype)
        members = (pos[:, None] - kp + 1 + torch.arange(kp, device=pos.device)) % ring
        pooled = idx_kernels.kpool_compress(
            cache.tail_keys[rows[:, None], members],
            cache.tail_gates[rows[:, None], members],
            self.index_kpool_compress_ape,
        )
        # Tokens that close no pool write to pooled-key row 0 (the padding page's), so two
        # tokens of one request that share a pool never race on its row.
        closes = pos % kp == kp - 1
        dst = torch.where(closes, self._pool_slots(batch.req_to_token, rows, pos // kp), 0)
        cache.index_keys[dst] = pooled.to(cache.index_keys.dtype)

    def _select_tokens(self, q, head_w, batch: ForwardBatch, cache: DSALayerCache):
        kp = self.kpool
        max_pools = max(1, batch.max_seq_len // kp)
        pools = torch.arange(max_pools, device=q.device)
        # one gather of pooled keys per request, shared by its step_len queries
        dst = self._pool_slots(batch.req_to_token, batch.req_rows[:, None], pools[None, :])
        scores = idx_kernels.score_pools(q, head_w, cache.index_keys[dst], self.d**-0.5)
        return idx_kernels.select_tokens(
            scores, batch.positions, kp, self.select_pools, self.select_tail
        )


class DSAttention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, has_indexer: bool) -> None:
        super().__init__()
        h, r = config.num_attention_heads, config.kv_lora_rank
        self.heads, self.rank = h, r
        self.nope, self.v_dim = config.qk_nope_head_dim, config.v_head_dim
        self.scale = self.nope**-0.5
        self.q_a_proj = Linear(config.hidden_size, config.q_lora_rank, dtype)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps, dtype)
        self.q_b_proj = Linear(config.q_lora_rank, h * self.nope, dtype)
        self.kv_a_proj_with_mqa = Linear(config.hidden_size, r, dtype)
        self.kv_a_layernorm = RMSNorm(r, config.rms_norm_eps, dtype)
        self.kv_b_proj = Linear(r, h * (self.nope + self.v_dim), dtype)
        self.o_proj = Linear(h * self.v_dim, config.hidden_size, dtype)
        self.indexer = Indexer(config, dtype) if has_indexer else None

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cache: DSALayerCache,
        shared_positions: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (output [T, Hd], selected positions [T, W]) for a later shared layer."""
        q_lora = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_lora).view(-1, self.heads, self.nope)
        cache.latent[batch.token_slots] = self.kv_a_layernorm(self.kv_a_proj_with_mqa(x)).to(
            cache.latent.dtype
        )
        if self.indexer is not None:
            positions = self.indexer(x, q_lora, batch, cache)
        else:
            assert shared_positions is not None, "shared DSA layer without a full layer before it"
            positions = shared_positions
        rows = batch.req_rows[batch.token_req].unsqueeze(-1)
        slots = torch.where(positions >= 0, batch.req_to_token[rows, positions.clamp(min=0)], -1)
        kv_b = self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.rank)
        q_abs = torch.einsum("thd,hdr->thr", q, kv_b[:, : self.nope])
        o_lat = sparse_mla_attention(q_abs, cache.latent, slots, self.scale)
        o = torch.einsum("thr,hvr->thv", o_lat, kv_b[:, self.nope :])
        return self.o_proj(o.flatten(1)), positions

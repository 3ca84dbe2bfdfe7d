"""DSA's cache-aware core: the kpool indexer over the paged pooled-key cache and the tail ring,
and sparse MLA over the paged latent cache.

Order inside a step (it matters): write this step's latents, pooled keys and tails first; then
score and select; then attend. A query may therefore select its own pool or tail.
Layout (serving/memory/cache.py): pool P of a request lives at pooled-key row
req_to_token[row, P*kpool] // kpool; the ring keeps the last tail_slots positions of a request
(position p at p % tail_slots), so the open pool's members survive any one step's writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import fast_path
from kernels import indexer as idx_kernels
from kernels import sparse_mla as mla_kernels
from serving.distributed import tp_all_reduce
from serving.forward_batch import ForwardBatch
from serving.memory.cache import DSALayerCache


@dataclass(frozen=True)
class IndexerShape:
    kpool: int
    select_pools: int
    select_tail: bool
    head_dim: int


def write_latent(latent: torch.Tensor, batch: ForwardBatch, cache: DSALayerCache) -> None:
    cache.latent[batch.token_slots] = latent.to(cache.latent.dtype)


def select_positions(
    shape: IndexerShape,
    q: torch.Tensor,
    k: torch.Tensor,
    gates: torch.Tensor,
    head_w: torch.Tensor,
    ape: torch.Tensor,
    batch: ForwardBatch,
    cache: DSALayerCache,
) -> torch.Tensor:
    """Writes the step's index keys (ring, closed pools), then returns the selected token
    positions [T, index_width] (-1 = empty) of every new token.

    q [T, Hi, D]; k, gates [T, D]; head_w [T, Hi] (times Hi^-0.5); ape [kpool, D]."""
    if batch.is_decode or batch.step_len is not None:
        _write_tokens(shape, k, gates, ape, batch, cache)
        return _select_uniform(shape, q, head_w, batch, cache)
    return _extend(shape, q, k, gates, head_w, ape, batch, cache)


def sparse_mla(
    q_abs: torch.Tensor,
    positions: torch.Tensor,
    batch: ForwardBatch,
    cache: DSALayerCache,
    scale: float,
) -> torch.Tensor:
    """Absorbed MLA [T, H, R] over the latents at the selected positions of each token's row."""
    rows = batch.req_rows[batch.token_req].unsqueeze(-1)
    slots = torch.where(positions >= 0, batch.req_to_token[rows, positions.clamp(min=0)], -1)
    if fast_path(q_abs):
        from kernels.triton import sparse_mla as mla_kernels_fast

        return mla_kernels_fast.sparse_mla_attention(q_abs, cache.latent, slots, scale)
    return mla_kernels.sparse_mla_attention(q_abs, cache.latent, slots, scale)


def _indexer_ops(t: torch.Tensor):
    """kernels.indexer, or on CUDA kernels.triton.indexer (kpool_compress, select_tokens with the
    same signatures, plus scoring straight from the paged pooled-key cache)."""
    if fast_path(t):
        from kernels.triton import indexer

        return indexer
    return idx_kernels


def _score(shape, q, head_w, r2t, rows, positions, max_pools: int, cache: DSALayerCache):
    """Pool scores [N, max_pools] of queries q [N, Hi, D] that come in len(rows) equal groups,
    one per request row (extend: one request; decode and verify: step_len queries each).

    Under TP each rank holds Hi/tp of the heads: the scores are summed over the ranks here, so
    every rank selects the same tokens."""
    return tp_all_reduce(_score_heads(shape, q, head_w, r2t, rows, positions, max_pools, cache))


def _score_heads(shape, q, head_w, r2t, rows, positions, max_pools: int, cache: DSALayerCache):
    if fast_path(q):
        from kernels.triton.indexer import score_pools_paged

        per_query = rows.repeat_interleave(q.shape[0] // rows.shape[0])
        return score_pools_paged(
            q, head_w, cache.index_keys, r2t, per_query, positions, shape.kpool, max_pools,
            shape.head_dim**-0.5,
        )  # fmt: skip
    # one gather of pooled keys per request, shared by its queries
    pools = torch.arange(max_pools, device=q.device)
    keys = cache.index_keys[_pool_slots(shape.kpool, r2t, rows[:, None], pools[None, :])]
    return idx_kernels.score_pools(q, head_w, keys, shape.head_dim**-0.5)


def _pool_slots(kpool: int, req_to_token: torch.Tensor, row, pools: torch.Tensor):
    """Pooled-key rows of pools `pools` of request `row`."""
    return req_to_token[row, pools * kpool] // kpool


def _extend(shape, q, k, gates, head_w, ape, batch: ForwardBatch, cache: DSALayerCache):
    kp, ring = shape.kpool, cache.tail_slots
    r2t = batch.req_to_token
    ops = _indexer_ops(k)
    out = []
    offset = 0
    # `row` is the host's int: a 0-dim device tensor as an index would be read back (a sync)
    for b, (start, n, row) in enumerate(zip(batch.starts_cpu, batch.lens_cpu, batch.rows_cpu)):
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
            pooled = ops.kpool_compress(
                all_k[: count * kp].view(count, kp, -1),
                all_g[: count * kp].view(count, kp, -1),
                ape,
            )
            dst = _pool_slots(kp, r2t, row, torch.arange(first, last, device=k.device))
            cache.index_keys[dst] = pooled.to(cache.index_keys.dtype)
        # 2. the ring keeps the last `ring` positions (the open pool among them)
        keep = torch.arange(max(start, end - ring), end, device=k.device)
        cache.tail_keys[row, keep % ring] = k[offset + keep - start].to(cache.tail_keys.dtype)
        cache.tail_gates[row, keep % ring] = gates[offset + keep - start].to(cache.tail_gates.dtype)
        # 3. score every complete pool of the request, select per query
        positions = batch.positions[chunk]
        scores = _score(
            shape, q[chunk], head_w[chunk], r2t, batch.req_rows[b : b + 1], positions,
            max(last, 1), cache,
        )  # fmt: skip
        out.append(ops.select_tokens(scores, positions, kp, shape.select_pools, shape.select_tail))
        offset += n
    return torch.cat(out)


def _write_tokens(shape, k, gates, ape, batch: ForwardBatch, cache: DSALayerCache) -> None:
    """Graph-safe write for batches of step_len tokens per request (decode, verify).

    All of the step's keys enter the ring before any pool is compressed, so a pool that closes
    mid-step finds its members. The ring holds kpool-1 + step_len slots, so this step's writes
    never evict a member of a pool it still closes."""
    kp, ring = shape.kpool, cache.tail_slots
    assert batch.step_len is None or batch.step_len <= ring - kp + 1, "ring too small"
    rows, pos = batch.req_rows[batch.token_req], batch.positions
    cache.tail_keys[rows, pos % ring] = k.to(cache.tail_keys.dtype)
    cache.tail_gates[rows, pos % ring] = gates.to(cache.tail_gates.dtype)
    members = (pos[:, None] - kp + 1 + torch.arange(kp, device=pos.device)) % ring
    pooled = _indexer_ops(k).kpool_compress(
        cache.tail_keys[rows[:, None], members], cache.tail_gates[rows[:, None], members], ape
    )
    # Tokens that close no pool write to pooled-key row 0 (the padding page's), so two tokens of
    # one request that share a pool never race on its row.
    closes = pos % kp == kp - 1
    dst = torch.where(closes, _pool_slots(kp, batch.req_to_token, rows, pos // kp), 0)
    cache.index_keys[dst] = pooled.to(cache.index_keys.dtype)


def _select_uniform(shape, q, head_w, batch: ForwardBatch, cache: DSALayerCache):
    kp = shape.kpool
    max_pools = max(1, batch.max_seq_len // kp)
    r2t = batch.req_to_token
    scores = _score(shape, q, head_w, r2t, batch.req_rows, batch.positions, max_pools, cache)
    return _indexer_ops(q).select_tokens(
        scores, batch.positions, kp, shape.select_pools, shape.select_tail
    )

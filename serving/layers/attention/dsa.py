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
from serving.forward_batch import ForwardBatch, to_device
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


@dataclass
class ExtendIndex:
    """A ragged extend's index tensors for the indexer, derived once per forward from the batch
    (host lists, one upload) and shared by every DSA layer of it.

    Closing pools (pools whose last member is among the batch's new tokens), NP of them:
      pool_rows [NP]            request row
      pool_slots [NP]           pooled-key row each is written to
      members_new [NP, kpool]   whether a member is a new token (else it is in the ring)
      members_token [NP, kpool] the new token's index in the batch (clamped to 0 where not)
      members_ring [NP, kpool]  the member's ring slot
    Ring writes (each request's last `ring` new positions: the open pool among them), NW:
      ring_rows, ring_slots, ring_tokens [NW]
    query_rows [T]: each token's request row; max_pools: pools of the longest request."""

    pool_rows: torch.Tensor
    pool_slots: torch.Tensor
    members_new: torch.Tensor
    members_token: torch.Tensor
    members_ring: torch.Tensor
    ring_rows: torch.Tensor
    ring_slots: torch.Tensor
    ring_tokens: torch.Tensor
    query_rows: torch.Tensor
    num_pools: int
    max_pools: int

    @classmethod
    def of(cls, batch: ForwardBatch, kpool: int, ring: int) -> ExtendIndex:
        key = ("dsa_extend", kpool, ring)
        index = batch.derived.get(key)
        if index is None:
            index = batch.derived[key] = cls.build(batch, kpool, ring)
        return index

    @classmethod
    def build(cls, batch: ForwardBatch, kp: int, ring: int) -> ExtendIndex:
        # per closing pool: its first position, its request's row, first new position and that
        # token's index in the batch; per ring write: row, slot, token index
        pool_starts, pool_rows, pool_first, pool_token0 = [], [], [], []
        ring_rows, ring_slots, ring_tokens = [], [], []
        offset = 0
        for start, n, row in zip(batch.starts_cpu, batch.lens_cpu, batch.rows_cpu):
            end = start + n
            first, last = start // kp, end // kp
            pool_starts += range(first * kp, last * kp, kp)
            pool_rows += [row] * (last - first)
            pool_first += [start] * (last - first)
            pool_token0 += [offset] * (last - first)
            keep = range(max(start, end - ring), end)
            ring_rows += [row] * len(keep)
            ring_slots += [p % ring for p in keep]
            ring_tokens += range(offset + keep.start - start, offset + keep.stop - start)
            offset += n
        parts = [pool_starts, pool_rows, pool_first, pool_token0, ring_rows, ring_slots]
        parts.append(ring_tokens)
        device = batch.positions.device
        ids = to_device([v for part in parts for v in part], torch.int64, device)
        starts, rows, first_pos, token0, w_rows, w_slots, w_tokens = ids.split(
            [len(p) for p in parts]
        )
        members = starts[:, None] + torch.arange(kp, device=device)  # [NP, kp] positions
        return cls(
            pool_rows=rows,
            pool_slots=batch.req_to_token[rows, starts] // kp,
            members_new=members >= first_pos[:, None],
            members_token=(members - first_pos[:, None] + token0[:, None]).clamp_(min=0),
            members_ring=members % ring,
            ring_rows=w_rows,
            ring_slots=w_slots,
            ring_tokens=w_tokens,
            query_rows=batch.req_rows[batch.token_req],
            num_pools=len(pool_starts),
            max_pools=max(1, max(s + n for s, n in zip(batch.starts_cpu, batch.lens_cpu)) // kp),
        )


def _extend(shape, q, k, gates, head_w, ape, batch: ForwardBatch, cache: DSALayerCache):
    """A ragged extend, every request at once (a fixed number of launches per layer, whatever
    the batch's requests). Order (hazard): the ring is read for the closing pools' early members
    before this step's keys overwrite it."""
    kp = shape.kpool
    index = ExtendIndex.of(batch, kp, cache.tail_slots)
    ops = _indexer_ops(k)
    # 1. pools that close in this batch; members before a request's start come from its ring
    if index.num_pools:
        ring_at = (index.pool_rows[:, None], index.members_ring)
        new = index.members_new[..., None]
        member_k = torch.where(new, k[index.members_token], cache.tail_keys[ring_at].to(k.dtype))
        member_g = torch.where(
            new, gates[index.members_token], cache.tail_gates[ring_at].to(gates.dtype)
        )
        pooled = ops.kpool_compress(member_k, member_g, ape)
        cache.index_keys[index.pool_slots] = pooled.to(cache.index_keys.dtype)
    # 2. the ring keeps each request's last `ring` positions (the open pool among them)
    ring_at = (index.ring_rows, index.ring_slots)
    cache.tail_keys[ring_at] = k[index.ring_tokens].to(cache.tail_keys.dtype)
    cache.tail_gates[ring_at] = gates[index.ring_tokens].to(cache.tail_gates.dtype)
    # 3. score every complete pool of each query's request, select per query
    scores = tp_all_reduce(_score_ragged(shape, q, head_w, batch, index, cache))
    return ops.select_tokens(scores, batch.positions, kp, shape.select_pools, shape.select_tail)


def _score_ragged(shape, q, head_w, batch: ForwardBatch, index: ExtendIndex, cache: DSALayerCache):
    """Pool scores [T, max_pools] of a ragged batch's queries (this rank's heads). Columns past a
    request's own pools are never visible to its queries (select_tokens masks them)."""
    r2t, max_pools = batch.req_to_token, index.max_pools
    if fast_path(q):
        from kernels.triton.indexer import score_pools_paged

        return score_pools_paged(
            q, head_w, cache.index_keys, r2t, index.query_rows, batch.positions, shape.kpool,
            max_pools, shape.head_dim**-0.5,
        )  # fmt: skip
    # the reference: per request, one gather of pooled keys shared by its queries
    pieces, offset = [], 0
    for b, n in enumerate(batch.lens_cpu):
        chunk = slice(offset, offset + n)
        rows, positions = batch.req_rows[b : b + 1], batch.positions[chunk]
        pieces.append(
            _score_heads(shape, q[chunk], head_w[chunk], r2t, rows, positions, max_pools, cache)
        )
        offset += n
    return torch.cat(pieces)


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

"""DSA's cache-aware core: the kpool indexer over the paged pooled-key cache and the tail ring,
and sparse MLA over the paged latent cache.

Order inside a step (it matters): write this step's latents, pooled keys and tails first; then
score and select; then attend. A query may therefore select its own pool or tail.
Layout (serving/memory/cache.py): pool P of a request lives at pooled-key row
req_to_token[row, P*kpool] // kpool; the ring keeps the last tail_slots positions of a request
(position p at p % tail_slots), so the open pool's members survive any one step's writes.

Two paths. A step (decode, or a uniform batch of step_len tokens per request: EAGLE's verify and
catch-up, the draft) runs write_step, query_step and attend_step (kernels/dsa_decode.py; on
CUDA kernels/triton/dsa_decode.py, four launches); anything else (prefill chunks, ragged
batches) runs write_latent, select_slots and sparse_mla.
The selection a layer hands a later shared layer is the cache slots [T, W] (-1 = empty) its
tokens attend, as a set: the step path lists them in another order than the extend path, and
on CUDA in another order than on the CPU.
Under TP the indexer is replicated (all its heads on every rank, as SGLang runs DeepSeek-V3.2's):
every rank computes the same scores and selects the same tokens with no collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import dsa_decode as step_kernels
from kernels import fast_path
from kernels import indexer as idx_kernels
from kernels import sparse_mla as mla_kernels
from kernels.dsa_decode import IndexQuery, IndexWrite, StepLayout
from serving.forward_batch import ForwardBatch
from serving.layers.norm import RMSNorm
from serving.memory.cache import DSALayerCache


@dataclass(frozen=True)
class IndexerShape:
    kpool: int
    select_pools: int
    select_tail: bool
    head_dim: int


def is_step(batch: ForwardBatch) -> bool:
    """Decode or a uniform batch: the graph-safe step path."""
    return batch.is_decode or batch.step_len is not None


# ------------------------------------------------------------------------------ step path


class StepCounters:
    """One indexer layer's per-token counters for the fused selection on CUDA (the last program
    of a token selects): its own, so no two kernels that could overlap share them. int32 zeros,
    left at zero by every launch; allocated at the layer's first step on a device (an eager
    run: graph capture warms up eagerly first), never reallocated, since captured graphs keep
    its address."""

    CAPACITY = 1 << 14  # tokens per step

    def __init__(self) -> None:
        self.counters: torch.Tensor | None = None

    def get(self, tokens: int, device: torch.device) -> torch.Tensor:
        assert tokens <= self.CAPACITY, f"a step of {tokens} tokens: raise StepCounters.CAPACITY"
        if self.counters is None or self.counters.device != device:
            self.counters = torch.zeros(self.CAPACITY, dtype=torch.int32, device=device)
        return self.counters


def _step_ops(t: torch.Tensor):
    if fast_path(t):
        from kernels.triton import dsa_decode

        return dsa_decode
    return step_kernels


def step_layout(batch: ForwardBatch, kpool: int) -> StepLayout:
    return StepLayout(
        batch.req_to_token,
        batch.req_rows,
        batch.positions,
        batch.token_slots,
        batch.step_len or 1,
        max(1, batch.max_seq_len // kpool),
    )


def write_step(
    q_a: torch.Tensor,
    kv_a: torch.Tensor,
    q_norm: RMSNorm,
    kv_norm: RMSNorm,
    index: IndexWrite | None,
    batch: ForwardBatch,
    cache: DSALayerCache,
) -> torch.Tensor:
    """The step's writes (latents; with an indexer its keys and gates into the ring and the
    pools that close); returns q_a's RMSNorm (q_lora)."""
    assert q_norm.eps == kv_norm.eps
    kpool = 1 if index is None else index.ape.shape[0]
    return _step_ops(q_a).write_step(
        q_a, kv_a, q_norm.weight, kv_norm.weight, q_norm.eps, cache.latent,
        step_layout(batch, kpool), index,
    )  # fmt: skip


def query_step(
    q: torch.Tensor,
    kv_b_nope: torch.Tensor,
    index: IndexQuery | None,
    counters: StepCounters | None,
    batch: ForwardBatch,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(absorbed queries [T, H, R], the selection [T, W] or None without an indexer)."""
    kpool = 1 if index is None else index.kpool
    ops = _step_ops(q)
    own = None
    if counters is not None and ops is not step_kernels:
        own = counters.get(q.shape[0], q.device)
    return ops.step_queries(q, kv_b_nope, index, step_layout(batch, kpool), own)


def attend_step(
    q_abs: torch.Tensor,
    slots: torch.Tensor,
    kv_b_v: torch.Tensor,
    cache: DSALayerCache,
    scale: float,
) -> torch.Tensor:
    """Sparse MLA over the selection, taken up by kv_b_v: [T, H * V]."""
    return _step_ops(q_abs).step_attention(q_abs, cache.latent, slots, scale, kv_b_v)


# ---------------------------------------------------------------------------- extend path


def write_latent(latent: torch.Tensor, batch: ForwardBatch, cache: DSALayerCache) -> None:
    cache.latent[batch.token_slots] = latent.to(cache.latent.dtype)


def select_slots(
    shape: IndexerShape,
    q: torch.Tensor,
    k: torch.Tensor,
    gates: torch.Tensor,
    head_w: torch.Tensor,
    ape: torch.Tensor,
    batch: ForwardBatch,
    cache: DSALayerCache,
) -> torch.Tensor:
    """Writes the batch's index keys (ring, closed pools), then returns the selection: the cache
    slots [T, index_width] (-1 = empty) each new token attends.

    q [T, Hi, D]; k, gates [T, D]; head_w [T, Hi] (times Hi^-0.5); ape [kpool, D]."""
    positions = _extend(shape, q, k, gates, head_w, ape, batch, cache)
    rows = batch.req_rows[batch.token_req].unsqueeze(-1)
    return torch.where(positions >= 0, batch.req_to_token[rows, positions.clamp(min=0)], -1)


def sparse_mla(
    q_abs: torch.Tensor, slots: torch.Tensor, cache: DSALayerCache, scale: float
) -> torch.Tensor:
    """Absorbed MLA [T, H, R] over the latents at the selected slots."""
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


def _score_heads(shape, q, head_w, r2t, rows, positions, max_pools: int, cache: DSALayerCache):
    """Pool scores [N, max_pools] of queries q [N, Hi, D] that come in len(rows) equal groups,
    one per request row (an extend chunk: one request)."""
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
        scores = _score_heads(
            shape, q[chunk], head_w[chunk], r2t, batch.req_rows[b : b + 1], positions,
            max(last, 1), cache,
        )  # fmt: skip
        out.append(ops.select_tokens(scores, positions, kp, shape.select_pools, shape.select_tail))
        offset += n
    return torch.cat(out)

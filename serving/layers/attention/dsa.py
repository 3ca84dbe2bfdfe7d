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
batches) runs write_latent, select_positions and sparse_mla (on CUDA, a chunk with little
cached prefix at few heads per rank takes the union kernel: kernels/triton/sparse_mla_union.py).
The selection a layer hands a later shared layer (a forward runs one path in every layer) is
what its tokens attend, as a set: on the step path the cache slots [T, W], on the extend path
the positions [T, W] in each token's request (-1 = empty; the union kernel marks positions,
the gather kernel reads slots). The step path lists them in another order than the extend path,
and on CUDA in another order than on the CPU.
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
from kernels import sparse_mla_union as union_kernels
from kernels.dsa_decode import IndexQuery, IndexWrite, StepLayout
from serving.forward_batch import ForwardBatch, upload
from serving.layers.attention.dsa_extend_index import ExtendIndex
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


def selected_slots(positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """The cache slots [T, W] (-1 = empty) at a selection's positions in each token's request."""
    rows = batch.req_rows[batch.token_req].unsqueeze(-1)
    return torch.where(positions >= 0, batch.req_to_token[rows, positions.clamp(min=0)], -1)


def sparse_mla(
    q_abs: torch.Tensor,
    positions: torch.Tensor,
    batch: ForwardBatch,
    cache: DSALayerCache,
    scale: float,
) -> torch.Tensor:
    """Absorbed MLA [T, H, R] over the latents at the selected positions. On CUDA, when
    union_pays (few heads per rank, the keys up to each query a small multiple of its selection:
    a chunk with little cached prefix; host ints only) the union kernel walks tiles of queries
    over their request's positions, marked by a mask made from the positions; otherwise the
    gather kernel runs one query per program over the positions' cache slots. A shared layer
    attends its full layer's selection (the same tensor): the mask or the slots are made once."""
    made = batch.derived.get("sparse_mla_selection")
    if made is None or made[0] is not positions:
        made = batch.derived["sparse_mla_selection"] = (positions, {})
    held = made[1]
    fast = fast_path(q_abs)
    heads, width = q_abs.shape[1], positions.shape[1]
    if fast and union_kernels.union_pays(heads, width, batch.starts_cpu, batch.lens_cpu):
        from kernels.triton import sparse_mla_union as union_fast

        tiles, query_rows, ctx_len = _union_layout(q_abs, batch)
        if "mask" not in held:
            held["mask"] = union_fast.selection_mask(positions, ctx_len)
        return union_fast.sparse_mla_union(
            q_abs, cache.latent, held["mask"], scale, batch.req_to_token, query_rows, tiles,
            page_size=cache.page_size,
        )  # fmt: skip
    if "slots" not in held:
        held["slots"] = selected_slots(positions, batch)
    if fast:
        from kernels.triton import sparse_mla as mla_kernels_fast

        return mla_kernels_fast.sparse_mla_attention(q_abs, cache.latent, held["slots"], scale)
    return mla_kernels.sparse_mla_attention(q_abs, cache.latent, held["slots"], scale)


def _union_layout(q_abs: torch.Tensor, batch: ForwardBatch):
    """(tiles, each query's request row, context bound) of the union kernel: once per forward
    (every DSA layer shares the batch's layout)."""
    heads = q_abs.shape[1]
    key = ("sparse_mla_union", heads, q_abs.dtype)
    layout = batch.derived.get(key)
    if layout is None:
        ends = [s + n for s, n in zip(batch.starts_cpu, batch.lens_cpu)]
        block_q = union_kernels.block_queries(heads, q_abs.dtype)
        tiles = union_kernels.union_tiles(batch.starts_cpu, batch.lens_cpu, block_q)
        tiles = upload(tiles, q_abs.device)  # pinned: a pageable copy waits for the device
        query_rows = batch.req_rows[batch.token_req]
        layout = batch.derived[key] = (tiles, query_rows, max(ends))
    return layout


def _indexer_ops(t: torch.Tensor):
    """kernels.indexer, or on CUDA kernels.triton.indexer (kpool_compress, select_tokens with the
    same signatures, plus scoring straight from the paged pooled-key cache)."""
    if fast_path(t):
        from kernels.triton import indexer

        return indexer
    return idx_kernels


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
    """A ragged extend, every request at once (a fixed number of launches per layer, whatever
    the batch's requests): writes the batch's index keys (ring, closed pools), then returns the
    selection: the positions [T, index_width] in its request (-1 = empty) each new token
    attends. Order (hazard): the ring is read for the closing pools' early members before this
    step's keys overwrite it.

    q [T, Hi, D]; k, gates [T, D]; head_w [T, Hi] (times Hi^-0.5); ape [kpool, D]."""
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
    scores = _score_ragged(shape, q, head_w, batch, index, cache)
    return ops.select_tokens(scores, batch.positions, kp, shape.select_pools, shape.select_tail)


def _score_ragged(shape, q, head_w, batch: ForwardBatch, index: ExtendIndex, cache: DSALayerCache):
    """Pool scores [T, max_pools] of a ragged batch's queries (every indexer head: replicated
    under TP). Columns past a request's own pools are never visible to its queries (select_tokens
    masks them)."""
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


def _score_heads(shape, q, head_w, r2t, rows, positions, max_pools: int, cache: DSALayerCache):
    """The reference's pool scores [N, max_pools] of one request's queries q [N, Hi, D]: one
    gather of its pooled keys shared by its queries."""
    pools = torch.arange(max_pools, device=q.device)
    slots = r2t[rows[:, None], pools[None, :] * shape.kpool] // shape.kpool
    return idx_kernels.score_pools(q, head_w, cache.index_keys[slots], shape.head_dim**-0.5)

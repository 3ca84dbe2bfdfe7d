"""Sparse MLA over a tile's union of selections (kernels/sparse_mla_union.py and its Triton
kernel) against the gather path (kernels.sparse_mla / kernels.triton.sparse_mla) on the same
selections given as slots; the selection mask (made from positions) against its torch twin.

CPU cases run under TRITON_INTERPRET=1 at tiny shapes; GPU cases (`gpu`) run the rank's real
shape (8 heads, R 512, W 2063, an 8,192-token chunk with no prefix and after 8k cached).
Tolerances: fp32 (IEEE dots) 1e-5 relative norm-wise against the fp32 reference; bf16 1e-2
relative norm-wise against the fp32 gather result on the same bf16 values upcast (bf16 rounding
of P and of the output, as the gather kernel's own tests allow).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from kernels import indexer as ref_idx  # noqa: E402
from kernels import sparse_mla_union as union  # noqa: E402
from kernels.sparse_mla import sparse_mla_attention as ref_gather  # noqa: E402
from kernels.triton.sparse_mla import sparse_mla_attention as tri_gather  # noqa: E402
from kernels.triton.sparse_mla_union import selection_mask as tri_mask  # noqa: E402
from kernels.triton.sparse_mla_union import sparse_mla_union as tri_union  # noqa: E402
from tests.triton_interp import patch_triton_interpreter  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interp_only = pytest.mark.skipif(not INTERPRET, reason="CPU case: set TRITON_INTERPRET=1")
gpu = pytest.mark.gpu
if INTERPRET:
    patch_triton_interpreter()  # runtime loop bounds (the tile's key end), bf16 dots
PAGE = 4


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


class Case:
    """A ragged extend: requests (start, n) in rows 3, 5, ... of a paged table (shuffled pages,
    row 0 padding), queries in batch order, and a selection per query as positions [N, W]."""

    def __init__(self, requests, heads, rank, dtype, device, seed=0, page=PAGE):
        gen = torch.Generator().manual_seed(seed)
        self.starts = [s for s, _ in requests]
        self.lens = [n for _, n in requests]
        self.ends = [s + n for s, n in requests]
        self.rows = [3 + 2 * b for b in range(len(requests))]
        max_ctx = -(-max(self.ends) // page) * page
        per_row = max_ctx // page
        num_pages = 1 + self.rows[-1] * per_row + 7
        ids = torch.randperm(num_pages - 1, generator=gen) + 1
        table = torch.zeros(self.rows[-1] + 2, max_ctx, dtype=torch.int64)
        for i, r in enumerate(self.rows):
            pages = ids[i * per_row : (i + 1) * per_row]
            table[r] = (pages[:, None] * page + torch.arange(page)).flatten()
        self.table = table.to(device)
        self.num_slots = num_pages * page
        n = sum(self.lens)
        self.positions = torch.cat([torch.arange(s, s + m) for s, m in requests]).to(device)
        self.query_rows = torch.tensor(
            [r for r, m in zip(self.rows, self.lens) for _ in range(m)], device=device
        )
        self.q = torch.randn(n, heads, rank, generator=gen).to(device, dtype)
        self.latent = torch.randn(self.num_slots, rank, generator=gen).to(device, dtype)
        self.gen = gen

    def indexer_selection(self, kpool: int, select_pools: int) -> torch.Tensor:
        """Positions [N, W] as the model's indexer picks them, on random pool scores."""
        pools = max(1, max(self.ends) // kpool)
        scores = torch.randn(self.positions.numel(), pools, generator=self.gen)
        return ref_idx.select_tokens(
            scores.to(self.positions.device), self.positions, kpool, select_pools, True
        )

    def slots(self, pos: torch.Tensor) -> torch.Tensor:
        rows = self.query_rows[:, None]
        return torch.where(pos >= 0, self.table[rows, pos.clamp(min=0)], -1)

    def union_inputs(self, pos: torch.Tensor, dtype: torch.dtype):
        mask = union.selection_mask(pos, max(self.ends))
        block_q = union.block_queries(self.q.shape[1], dtype)
        tiles = union.union_tiles(self.starts, self.lens, block_q).to(pos.device)
        return mask, self.table, self.query_rows, tiles


def _scatter_empties(pos: torch.Tensor, gen) -> torch.Tensor:
    """The same sets with their entries (empty ones included) shuffled along each row."""
    order = torch.argsort(torch.rand(pos.shape, generator=gen), dim=1).to(pos.device)
    return pos.gather(1, order)


def _disjoint_selection(case: Case, block_q: int) -> torch.Tensor:
    """Query i of a tile picks the positions = i (mod block_q) up to its own (and its own
    position): the tile's queries share no key."""
    pos = case.positions
    width = int(pos.max()) // block_q + 2
    lane = torch.arange(pos.numel(), device=pos.device) % block_q
    cand = lane[:, None] + block_q * torch.arange(width, device=pos.device)
    cand = torch.where(cand <= pos[:, None], cand, -1)
    own = torch.where((cand == pos[:, None]).any(1, keepdim=True), -1, pos[:, None])
    return torch.cat([cand, own], dim=1)


def _check(case: Case, pos: torch.Tensor, scale: float = 0.3, **launch) -> None:
    slots = case.slots(pos)
    args = case.union_inputs(pos, case.q.dtype)
    ref = ref_gather(case.q, case.latent, slots, scale)
    twin = union.sparse_mla_union(case.q, case.latent, args[0], scale, *args[1:])
    assert _rel(twin, ref) < 1e-5
    out = torch.full_like(case.q, float("nan"))
    tri_union(case.q, case.latent, args[0], scale, *args[1:], out=out, **launch)
    assert not out.isnan().any()
    assert _rel(out, ref) < 1e-5
    assert (out - twin).abs().max().item() < 1e-4
    gathered = tri_gather(case.q, case.latent, slots, scale)
    assert _rel(out, gathered) < 1e-5


# (start, n) per request: one from position 0, one after a cached prefix, one short (a tile
# shorter than block_queries)
REQUESTS = [(0, 21), (13, 11), (40, 3)]


@interp_only
@pytest.mark.parametrize("skip_empty", [False, True])
def test_union_interp_indexer_selection(skip_empty):
    case = Case(REQUESTS, heads=4, rank=32, dtype=torch.float32, device="cpu")
    pos = _scatter_empties(case.indexer_selection(kpool=4, select_pools=3), case.gen)
    assert (pos < 0).any() and (pos >= 0).all(1).logical_not().any()
    _check(case, pos, skip_empty=skip_empty)


@interp_only
def test_union_interp_disjoint_selections():
    case = Case(REQUESTS, heads=4, rank=32, dtype=torch.float32, device="cpu", seed=1)
    pos = _disjoint_selection(case, union.block_queries(4, torch.float32))
    _check(case, pos, skip_empty=True)


@interp_only
def test_union_interp_sparse_far_blocks():
    """A long cached prefix of which each query picks a few far positions: most key blocks no
    query marks (the skip path), and a query's only keys may sit in one block."""
    case = Case([(90, 6), (0, 5)], heads=2, rank=16, dtype=torch.float32, device="cpu", seed=2)
    gen = case.gen
    far = torch.randint(0, 40, (case.positions.numel(), 3), generator=gen)
    pos = torch.cat([far, case.positions[:, None]], dim=1)  # blocks 48..79 unmarked
    pos[6:, :3] = -1  # the second request's queries attend only themselves
    pos = torch.where(pos <= case.positions[:, None], pos, -1)
    # a row must not hold a position twice
    rows = [torch.unique(r) for r in pos]
    pos = torch.stack([torch.cat([u.new_full((4 - len(u),), -1), u]) for u in rows])
    mask = case.union_inputs(pos, torch.float32)[0]
    assert not mask[:6, 48:80].any()
    for skip in (False, True):
        _check(case, pos, skip_empty=skip)


@interp_only
@pytest.mark.parametrize("block_n, stages", [(16, 1), (8, 3)])
def test_union_interp_contiguous_blocks(block_n, stages):
    """Key blocks addressed from their first slot (pages of 16 positions hold whole blocks),
    the last block short of its tile's key end."""
    case = Case(REQUESTS, heads=4, rank=32, dtype=torch.float32, device="cpu", seed=8, page=16)
    pos = _scatter_empties(case.indexer_selection(kpool=4, select_pools=3), case.gen)
    _check(case, pos, block_n=block_n, num_stages=stages, page_size=16)
    _check(case, pos, block_n=32, page_size=16)  # a block over two pages: gathered per slot


@interp_only
def test_union_interp_bf16():
    case = Case(REQUESTS, heads=4, rank=32, dtype=torch.bfloat16, device="cpu", seed=3)
    pos = case.indexer_selection(kpool=4, select_pools=3)
    slots = case.slots(pos)
    args = case.union_inputs(pos, torch.bfloat16)
    exact = ref_gather(case.q.float(), case.latent.float(), slots, 0.3)
    out = tri_union(case.q, case.latent, args[0], 0.3, *args[1:])
    twin = union.sparse_mla_union(case.q, case.latent, args[0], 0.3, *args[1:])
    assert _rel(out, exact) < 1e-2 and _rel(twin, exact) < 1e-2


def test_union_tiles_and_rule():
    tiles = union.union_tiles([0, 13], [5, 3], 2).tolist()
    assert sorted(tiles) == [[0, 2, 2], [2, 4, 4], [4, 5, 5], [5, 7, 15], [7, 8, 16]]
    assert [t[2] for t in tiles] == sorted((t[2] for t in tiles), reverse=True)
    assert union.block_queries(8, torch.bfloat16) == 8
    assert union.block_queries(6, torch.bfloat16) == 8
    assert union.block_queries(8, torch.float32) == 4
    w = 2063
    assert union.union_pays(8, w, [0], [8192])
    assert not union.union_pays(8, w, [8192], [8192])
    assert not union.union_pays(8, w, [24576], [8192])
    assert not union.union_pays(64, w, [0], [8192])
    assert union.union_pays(8, w, [0, 0], [100, 300])  # all dense: ratio 1


def test_selection_mask_round_trip():
    case = Case(REQUESTS, heads=2, rank=16, dtype=torch.float32, device="cpu", seed=4)
    pos = _scatter_empties(case.indexer_selection(kpool=4, select_pools=3), case.gen)
    mask, *_ = case.union_inputs(pos, torch.float32)
    want = torch.zeros_like(mask, dtype=torch.bool)
    for n, row in enumerate(pos.tolist()):
        want[n, [p for p in row if p >= 0]] = True
    assert torch.equal(mask.bool(), want)


@interp_only
def test_triton_selection_mask_equals_the_twin():
    """The Triton mask (a zero fill, one scatter launch) equals the torch twin's, with empty
    entries and a position listed twice in a row; rows wider than one program's block."""
    case = Case([(0, 40), (30, 9)], heads=2, rank=16, dtype=torch.float32, device="cpu", seed=7)
    pos = _scatter_empties(case.indexer_selection(kpool=4, select_pools=3), case.gen)
    pos[0, 0] = pos[0, 1] = 0  # a duplicate
    ctx = max(case.ends)
    assert torch.equal(tri_mask(pos, ctx), union.selection_mask(pos, ctx))
    wide = torch.cat([pos, torch.full((pos.shape[0], 1030), -1), pos], dim=1)  # 2 blocks a row
    assert torch.equal(tri_mask(wide, ctx), union.selection_mask(pos, ctx))
    assert tri_mask(pos[:0], ctx).shape == (0, ctx)


@interp_only
@pytest.mark.parametrize(
    "requests, page", [(REQUESTS, PAGE), (REQUESTS, 16), ([(200, 4), (0, 7)], PAGE)]
)
def test_dsa_sparse_mla_picks_and_agrees(monkeypatch, requests, page):
    """serving/layers/attention/dsa.py's extend wiring on the fast path (the Triton kernels under
    the interpreter): REQUESTS take the union kernel (pages of 16 hold its whole key blocks, of
    4 not), a short chunk after 200 cached tokens the gather kernel (union_pays); each equals
    the reference on the batch's own selection."""
    from serving.forward_batch import ForwardBatch
    from serving.layers.attention import dsa
    from serving.memory.cache import DSALayerCache

    case = Case(requests, heads=4, rank=32, dtype=torch.float32, device="cpu", seed=6, page=page)
    pos = case.indexer_selection(kpool=4, select_pools=3)
    slots = case.slots(pos)
    ids = [1] * case.positions.numel()
    batch = ForwardBatch.build(ids, case.rows, case.starts, case.lens, case.table)
    cache = DSALayerCache(case.latent, None, None, None, page_size=page)
    monkeypatch.setattr(dsa, "fast_path", lambda t: True)
    out = dsa.sparse_mla(case.q, pos, batch, cache, 0.3)
    ref = ref_gather(case.q, case.latent, slots, 0.3)
    assert _rel(out, ref) < 1e-5
    took_union = union.union_pays(4, slots.shape[1], case.starts, case.lens)
    assert took_union == (requests is REQUESTS)
    assert any(k[0] == "sparse_mla_union" for k in batch.derived) == took_union
    held = batch.derived["sparse_mla_selection"][1]
    assert set(held) == ({"mask"} if took_union else {"slots"})
    made = dict(held)  # a shared layer's call on the same selection reuses the mask or slots
    assert torch.equal(dsa.sparse_mla(case.q, pos, batch, cache, 0.3), out)
    assert all(held[name] is made[name] for name in made)


# --------------------------------------------------------------------------- GPU, real shape


def _gpu_case(start: int, dtype: torch.dtype):
    """Rank 0 of TP8: 8 heads, R 512, W = 2048 + 15 (kpool 16, 128 pools, tail), one request
    with an 8,192-token chunk at `start`, pages of 64 shuffled over the cache."""
    case = Case([(start, 8192)], heads=8, rank=512, dtype=dtype, device="cuda", seed=5, page=64)
    pos = case.indexer_selection(kpool=16, select_pools=128)
    return case, pos, case.slots(pos)


@gpu
@pytest.mark.parametrize("start, skip_empty", [(0, False), (0, True), (8192, False)])
def test_union_gpu_bf16_real_shape(start, skip_empty):
    case, pos, slots = _gpu_case(start, torch.bfloat16)
    args = case.union_inputs(pos, torch.bfloat16)
    exact = tri_gather(case.q.float(), case.latent.float(), slots, 576**-0.5)
    out = torch.full_like(case.q, float("nan"))
    tri_union(case.q, case.latent, args[0], 576**-0.5, *args[1:], out=out, skip_empty=skip_empty)
    gathered = tri_gather(case.q, case.latent, slots, 576**-0.5)
    assert not out.isnan().any()
    assert _rel(out, exact) < 1e-2
    assert _rel(out, gathered) < 1e-2


@gpu
@pytest.mark.parametrize("block_n, stages", [(64, 2), (32, 3), (32, 4)])
def test_union_gpu_contiguous_blocks(block_n, stages):
    """Key blocks addressed from their first slot: pages of 64 hold whole blocks."""
    case, pos, slots = _gpu_case(0, torch.bfloat16)
    args = case.union_inputs(pos, torch.bfloat16)
    gathered = tri_union(case.q, case.latent, args[0], 576**-0.5, *args[1:])
    out = tri_union(case.q, case.latent, args[0], 576**-0.5, *args[1:], block_n=block_n,
                    num_stages=stages, page_size=64)  # fmt: skip
    exact = tri_gather(case.q.float(), case.latent.float(), slots, 576**-0.5)
    assert _rel(out, exact) < 1e-2 and _rel(out, gathered) < 1e-2


@gpu
def test_union_gpu_fp32_real_shape():
    case, pos, slots = _gpu_case(0, torch.float32)
    args = case.union_inputs(pos, torch.float32)
    exact = tri_gather(case.q, case.latent, slots, 576**-0.5)
    out = torch.full_like(case.q, float("nan"))
    tri_union(case.q, case.latent, args[0], 576**-0.5, *args[1:], out=out)
    assert not out.isnan().any()
    assert _rel(out, exact) < 1e-5


@gpu
def test_dsa_sparse_mla_gpu_takes_the_union():
    """dsa.sparse_mla on an 8k chunk with no prefix at 8 heads: union_pays, and the result
    equals the gather kernel's; a second call on the same selection (a shared layer) reuses
    the mask."""
    from serving.forward_batch import ForwardBatch
    from serving.layers.attention import dsa
    from serving.memory.cache import DSALayerCache

    case, pos, slots = _gpu_case(0, torch.bfloat16)
    batch = ForwardBatch.build([1] * 8192, case.rows, case.starts, case.lens, case.table)
    cache = DSALayerCache(case.latent, None, None, None, page_size=64)
    out = dsa.sparse_mla(case.q, pos, batch, cache, 576**-0.5)
    again = dsa.sparse_mla(case.q, pos, batch, cache, 576**-0.5)
    assert torch.equal(
        batch.derived["sparse_mla_selection"][1]["mask"], case.union_inputs(pos, torch.bfloat16)[0]
    )
    exact = tri_gather(case.q.float(), case.latent.float(), slots, 576**-0.5)
    assert any(k[0] == "sparse_mla_union" for k in batch.derived)
    assert _rel(out, exact) < 1e-2 and torch.equal(out, again)

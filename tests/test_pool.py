"""Memory pool: every request-row buffer is sized from the request table, target and draft."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from serving.config import ModelConfig
from serving.memory.cache import DSALayerCache, KDALayerCache, request_rows
from serving.memory.pool import AuxRows, MemoryPool, PoolPlan

ROW_BUFFERS = ("conv", "state", "tail_keys", "tail_gates")


@pytest.fixture(scope="module")
def pool(tiny_ckpt):
    config = ModelConfig.from_pretrained(tiny_ckpt)
    # PD decode shape from the seed: 32 running + 64 extra slots, EAGLE with 2 draft tokens
    plan = PoolPlan(
        rows=32 + 64, pages=64, page_size=16, max_context=1024, with_draft=True, num_draft_tokens=2
    )
    return MemoryPool(config, plan, torch.float32, "cpu")


def row_buffers(pool):
    """Every buffer indexed by request row: model state of target and draft, and the aux rows
    (first token, logprobs, EAGLE's draft hidden stash)."""
    for which, cache in (("target", pool.target), ("draft", pool.draft)):
        for name, t in cache.tensors():
            if name.split(".")[-1] in ROW_BUFFERS:
                yield f"{which}.{name}", t
    yield from pool.aux.tensors()


def test_every_row_buffer_has_request_table_rows(pool):
    names = [n for n, _ in row_buffers(pool)]
    assert any(n.startswith("draft.") and "tail_keys" in n for n in names), names
    assert any(n.startswith("target.") and ".state" in n for n in names), names
    assert "aux.draft_hidden" in names, names
    for name, t in row_buffers(pool):
        assert t.shape[0] == request_rows(pool.req_to_token) == 97, name


def test_rows_1_to_96_write_and_read_back(pool):
    """Rows up to max_running + extra are valid (the seed's crash was row 96 of 33)."""
    for name, t in row_buffers(pool):
        for row in range(1, 97):
            t[row] = row
        for row in range(1, 97):
            assert torch.all(t[row] == row), (name, row)
        t.zero_()


def test_tail_ring_holds_open_pool_plus_draft_tokens(pool):
    kpool = pool.config.index_kpool
    for cache in pool.caches():
        for layer in cache.layers.values():
            if isinstance(layer, DSALayerCache) and layer.tail_keys is not None:
                assert layer.tail_slots == kpool - 1 + 2


def test_rows_are_reset_when_handed_out(pool):
    rows = [pool.alloc_row() for _ in range(96)]
    assert sorted(rows) == list(range(1, 97)) and pool.alloc_row() is None
    for cache in pool.caches():
        for layer in cache.layers.values():
            if isinstance(layer, KDALayerCache):
                layer.state[96] = 1.0
    pool.free_row(96)
    assert pool.alloc_row() == 96
    for cache in pool.caches():
        for layer in cache.layers.values():
            if isinstance(layer, KDALayerCache):
                assert not layer.state[96].any()
    for r in rows:
        pool.free_row(r)


def test_invariant_check_catches_leaks_and_aliases(pool):
    row = pool.alloc_row()
    pages: list[int] = []
    assert pool.grow(row, pages, 40) and len(pages) == 3
    pool.check({"a": (row, pages)})
    with pytest.raises(AssertionError, match="leak"):
        pool.check({"a": (row, pages[:1])})
    with pytest.raises(AssertionError, match="owned by"):
        pool.check({"a": (row, pages), "b": (None, pages[:1])})
    pool.free_pages(pages)
    pool.free_row(row)
    pool.check({})
    with pytest.raises(RuntimeError, match="freed but not in use"):
        pool.free_row(row)


def _aux_fields_read(path: str, cls: str, method: str) -> set[str]:
    """Names X of every `aux.X` in one method's source."""
    tree = ast.parse(Path(path).read_text())
    node = next(
        f
        for c in tree.body
        if isinstance(c, ast.ClassDef) and c.name == cls
        for f in c.body
        if isinstance(f, ast.FunctionDef) and f.name == method
    )
    return {
        n.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "aux"
    }


def test_aux_host_part_is_host_memory_and_all_the_handoff_host_code_touches():
    """The aux columns the host reads and writes live in host memory whatever the pool's
    device (on CUDA pinned), so decode's read of an arrived request (Transfer.first_token) and
    prefill's aux write (Shipping._write_aux) never wait for the device. With the device
    part on 'meta', any of their aux fields that is not host memory shows up here."""
    aux = AuxRows.allocate(5, 8, torch.bfloat16, "meta")
    host = {name for name, t in vars(aux).items() if t.device.type == "cpu"}
    assert host == {"ints", "floats", "top_ids"}, host
    assert {name for name, t in vars(aux).items() if t.is_meta} == {"draft_token", "draft_hidden"}
    assert all(t.shape[0] == 5 for _, t in aux.tensors())
    root = Path(__file__).resolve().parent.parent
    for path, cls, method in (
        (root / "workers/decode_transfer.py", "Transfer", "first_token"),
        (root / "workers/shipping.py", "Shipping", "_write_aux"),
    ):
        used = _aux_fields_read(str(path), cls, method)
        assert used and used <= host, (method, used - host)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_aux_host_part_is_pinned_on_cuda():
    aux = AuxRows.allocate(3, 8, torch.bfloat16, "cuda")
    assert all(t.is_pinned() for t in (aux.ints, aux.floats, aux.top_ids))
    assert aux.draft_token.is_cuda and aux.draft_hidden.is_cuda


def test_free_list_hands_out_the_lowest_free_ids_and_refuses_bad_frees():
    from serving.memory.allocator import FreeList

    ids = FreeList(10, "page")
    assert ids.alloc(4) == [1, 2, 3, 4]
    ids.free([3, 1])
    assert ids.alloc(3) == [1, 3, 5]  # freed ids come back lowest first, before fresh ones
    assert ids.alloc(6) is None and ids.num_free == 5  # nothing taken when short
    with pytest.raises(RuntimeError, match="page 7 freed but not in use"):
        ids.free([7])
    with pytest.raises(RuntimeError, match="page 0 freed"):
        ids.free([0])  # the padding id is never handed out
    assert sorted(ids.used) == [1, 2, 3, 4, 5] and ids.num_used == 5


def _snapshot_pool(config, journal: bool = False) -> MemoryPool:
    """A pool with prefix-cache snapshot slots and a table that does not end on a page (1000
    positions, pages of 16): the last page overhangs."""
    plan = PoolPlan(
        rows=6, pages=80, page_size=16, max_context=1000, with_draft=True, state_slots=5
    )
    pool = MemoryPool(config, plan, torch.float32, "cpu")
    g = torch.Generator().manual_seed(3)
    for _, t in [*pool.target.tensors(), *pool.draft.tensors()]:
        t.copy_(torch.randn(t.shape, generator=g))  # stale state everywhere, snapshots too
    pool.req_to_token.copy_(torch.randint(0, 999, pool.req_to_token.shape, generator=g))
    if journal:
        pool.journal = []
    return pool


def _admit_three(pool: MemoryPool) -> list[int]:
    """What one prefill step's admissions ask of the pool: rows (a hit started from a snapshot
    among them), a cached prefix mapped, pages for the chunks, one of them overhanging."""
    rows = [pool.alloc_row() for _ in range(3)]
    pool.map_pages(rows[0], 0, [7, 3])  # a cached prefix
    pool.load_states([4], [rows[0]])
    pages: list[int] = [7, 3]
    assert pool.grow(rows[0], pages, 70)
    pool.load_states([2], [rows[1]])
    pool.map_pages(rows[2], 60, [11, 12, 13])  # positions 960..1007: the last page overhangs
    return rows


def _buffers(pool: MemoryPool) -> dict[str, torch.Tensor]:
    return {
        "req_to_token": pool.req_to_token,
        **{f"target.{n}": t for n, t in pool.target.tensors()},
        **{f"draft.{n}": t for n, t in pool.draft.tensors()},
    }


def test_batched_admission_equals_the_one_by_one_order(tiny_ckpt):
    """Row resets, page maps and snapshot loads queued in batched() and applied at its end give
    the same request table and states as the same calls applied one by one; a TP follower that
    replays the journal gets them too; and nothing reaches the device before the block ends."""
    config = ModelConfig.from_pretrained(tiny_ckpt)
    one_by_one, batched, follower = (_snapshot_pool(config, journal=True) for _ in range(3))
    rows = _admit_three(one_by_one)
    before = {n: t.clone() for n, t in _buffers(batched).items()}
    with batched.batched():
        assert _admit_three(batched) == rows
        for name, t in _buffers(batched).items():
            assert torch.equal(t, before[name]), f"{name} written before the block ended"
    journal = batched.take_journal()
    assert [kind for kind, *_ in journal] == ["apply"]  # the whole block, one entry
    follower.replay(journal)
    want = _buffers(one_by_one)
    for pool in (batched, follower):
        for name, t in _buffers(pool).items():
            assert torch.equal(t, want[name]), name
    # the expected values themselves, on the one-by-one pool
    r2t = one_by_one.req_to_token
    assert r2t[rows[0], :32].tolist() == [*range(7 * 16, 8 * 16), *range(3 * 16, 4 * 16)]
    assert r2t[rows[2], 960:].tolist() == list(range(11 * 16, 11 * 16 + 40))
    kda = one_by_one.target.kda(0)
    assert torch.equal(kda.state[rows[0]], kda.saved_state[4])
    assert torch.equal(kda.conv[rows[1]], kda.saved_conv[2])
    assert not kda.state[rows[2]].any()
    tails = one_by_one.target.dsa(1).tail_keys
    assert not tails[rows].any()


def test_batched_admission_costs_the_same_ops_for_one_row_or_many(tiny_ckpt):
    """The device work of a block is a fixed number of torch ops, whatever the rows admitted."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    config = ModelConfig.from_pretrained(tiny_ckpt)
    counts = []
    for hits in (1, 5):
        pool = _snapshot_pool(config)
        Count.ops = 0
        with Count(), pool.batched():
            for i in range(hits):
                row = pool.alloc_row()
                pool.map_pages(row, 0, [2 * i + 1, 2 * i + 2])
                pool.load_states([i + 1], [row])
        counts.append(Count.ops)
    assert counts[0] == counts[1], counts

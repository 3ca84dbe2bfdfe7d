"""The prefix cache's tree on its own (serving/memory/radix_cache.py), over a real tiny pool:
matches end at the deepest node with both KV and a state, splits keep states and locks where
they belong, the two locks and the two LRUs, and every page and slot goes back exactly once."""

from __future__ import annotations

import pytest
import torch

from serving.config import ModelConfig
from serving.memory.pool import MemoryPool, PoolPlan
from serving.memory.radix_cache import RadixCache

P = 16  # page size
G = 64  # snapshot grid


@pytest.fixture
def pool(tiny_ckpt):
    config = ModelConfig.from_pretrained(tiny_ckpt)
    plan = PoolPlan(rows=4, pages=64, page_size=P, max_context=1024, state_slots=6)
    return MemoryPool(config, plan, torch.float32, "cpu")


def path(cache: RadixCache, keys: list[int]):
    """Insert `keys` with fresh pages and a fresh state at the end; returns the node."""
    pages = cache.pool.pages.alloc(len(keys) // P)
    node, adopted = cache.insert(keys, pages)
    dup = [p for p in pages if p not in adopted]
    if dup:
        cache.pool.free_pages(dup)
    slot = cache.pool.state_slots.alloc(1)[0]
    if not cache.set_state(node, slot):
        cache.pool.state_slots.free([slot])
    return node


def all_back(pool: MemoryPool) -> bool:
    return not pool.pages.used and not pool.state_slots.used


def test_a_match_ends_at_the_deepest_state_within_the_limit(pool):
    cache = RadixCache(pool, G)
    a = list(range(200))
    n64 = path(cache, a[:64])
    n128 = path(cache, a[:128])
    assert cache.match(a, 199).length == 128 and cache.match(a, 199).node is n128
    assert cache.match(a, 127).length == 64 and cache.match(a, 127).node is n64
    assert cache.match(a, 63).node is None
    b = a[:100] + [999] * 100  # diverges inside the node [64, 128): only the state at 64 holds
    assert cache.match(b, 199).length == 64
    c = [7] + a[1:]  # diverges at the first token
    assert cache.match(c, 199).node is None
    cache.flush()
    assert all_back(pool)


def test_a_split_keeps_the_state_at_its_end_and_the_locks_on_both_halves(pool):
    cache = RadixCache(pool, G)
    a = list(range(128))
    na = path(cache, a)
    cache.lock(na)
    assert cache.evictable_pages == 0
    b = a[:64] + [500 + i for i in range(64)]
    nb = path(cache, b)  # splits a's node at 64
    upper = na.parent
    assert upper is nb.parent and upper.depth == 64 and upper.slot is None
    assert upper.kv_locks == 1 and na.kv_locks == 1 and na.slot is not None
    assert cache.pages_held == 12 and cache.evictable_pages == 4  # b's own 4 pages
    assert cache.match(a, 128).node is na and cache.match(b, 128).node is nb
    assert cache.evict_pages(100) == 4  # only b's leaf: a's path is locked
    assert cache.match(b, 128).node is None and cache.match(a, 128).node is na
    cache.unlock(na)
    assert cache.evictable_pages == 8
    assert cache.evict_pages(100) == 8
    assert all_back(pool) and cache.pages_held == 0 and cache.states_held == 0


def test_inserting_a_cached_run_again_adopts_nothing(pool):
    cache = RadixCache(pool, G)
    a = list(range(64))
    path(cache, a)
    held = pool.pages.num_free
    pages = pool.pages.alloc(4)
    node, adopted = cache.insert(a, pages)
    assert adopted == [] and node.depth == 64
    pool.free_pages(pages)
    assert pool.pages.num_free == held
    cache.flush()
    assert all_back(pool)


def test_page_eviction_goes_by_lru_and_takes_tombstones_first(pool):
    cache = RadixCache(pool, G)
    old, new = [1] * 64, [2] * 64
    path(cache, old)
    path(cache, new)
    cache.match(old, 64)  # old is now the most recently used
    assert cache.evict_pages(1) == 4
    assert cache.match(new, 64).node is None and cache.match(old, 64).node is not None
    # a stateless leaf (kept by a lock while its state went) goes before any other
    third = path(cache, [3] * 64)
    cache.lock(third)
    cache.evict_states(2)  # old's and third's states (third's is newer but unlocked too)
    assert third.slot is None and cache.match(old, 64).node is None
    cache.unlock(third)  # an unlocked stateless leaf is pruned at once
    assert cache.pages_held == 0 and all_back(pool)


def test_state_eviction_leaves_interior_kv_for_longer_matches(pool):
    cache = RadixCache(pool, G)
    a = list(range(128))
    n64 = path(cache, a[:64])
    path(cache, a)
    cache.match(a, 128)  # the deeper state is the more recently used
    assert cache.evict_states(1) == 1
    assert n64.slot is None and cache.pages_held == 8  # an interior tombstone keeps its KV
    assert cache.match(a, 128).length == 128
    assert cache.match(a, 100).node is None  # no state at or below 100 any more
    cache.lock_state(cache.match(a, 128).node)
    assert cache.evict_states(1) == 0  # a locked state stays
    cache.unlock_state(cache.match(a, 128).node)
    assert cache.evict_states(1) == 1 and cache.pages_held == 0  # the leaf went with it
    assert all_back(pool)


def test_a_state_off_the_grid_is_refused(pool):
    cache = RadixCache(pool, G)
    node, _ = cache.insert(list(range(32)), pool.pages.alloc(2))
    with pytest.raises(AssertionError, match="grid"):
        cache.set_state(node, 1)
    cache.flush()
    assert all_back(pool)


@pytest.mark.parametrize("count", [1, 4, 5, 9])
def test_state_snapshots_copy_every_kda_layer_both_ways(count):
    """save/load_kda_states move each KDA layer's conv and recurrent state between request rows
    and snapshot slots, by row copies (up to FEW_ROWS) or index tensors (more): both ways equal
    the plain indexed copy, and nothing else moves."""
    from serving.memory.cache import (
        FEW_ROWS,
        KDALayerCache,
        ModelCache,
        load_kda_states,
        save_kda_states,
    )

    gen = torch.Generator().manual_seed(0)

    def layer():
        r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
        return KDALayerCache(r(12, 6, 3), r(12, 2, 4, 4), r(10, 6, 3), r(10, 2, 4, 4))

    cache = ModelCache(torch.zeros(12, 8, dtype=torch.int64), {0: layer(), 2: layer()})
    rows, slots = list(range(1, 1 + count)), list(range(9, 9 - count, -1))
    assert (count <= FEW_ROWS) == (count in (1, 4))
    before = {i: [t.clone() for t in vars(c).values()] for i, c in cache.layers.items()}
    save_kda_states(cache, rows, slots)
    for i, c in cache.layers.items():
        conv, state, saved_conv, saved_state = before[i]
        saved_conv[slots], saved_state[slots] = conv[rows], state[rows]
        assert torch.equal(c.saved_conv, saved_conv) and torch.equal(c.saved_state, saved_state)
        assert torch.equal(c.conv, conv) and torch.equal(c.state, state)
        c.conv.zero_()
        c.state.zero_()
    load_kda_states(cache, slots, rows)
    for i, c in cache.layers.items():
        conv, state = before[i][:2]
        assert torch.equal(c.conv[rows], conv[rows]) and torch.equal(c.state[rows], state[rows])
        others = [r for r in range(12) if r not in rows]
        assert not c.conv[others].any() and not c.state[others].any()


def test_pair_keys_are_kept_per_request_and_equal_the_plain_ones():
    """With a draft, admission.keys extends the keys a request kept as tokens join it, and
    rebuilds them from where its tokens differ from what was kept, wherever that is."""
    from types import SimpleNamespace

    from serving.engine.admission import Admission
    from serving.engine.request import Req

    vocab = 1000
    admission = Admission(SimpleNamespace(draft=object()), stats=None, vocab=vocab)
    plain = lambda t: [a * vocab + b for a, b in zip(t, t[1:])]  # noqa: E731
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, vocab, (300,), generator=g).tolist()
    req = Req("r", tokens[:200], sampling=None)
    for n in (200, 201, 200, 260, 261, 300, 120, 1, 0, 2):  # grows, a token less, shrinks, ...
        assert admission.keys(tokens[:n], req) == plain(tokens[:n]), n
    assert admission.keys(tokens, req) == plain(tokens)
    other = tokens[:150] + [(t + 1) % vocab for t in tokens[150:]]  # differs from 150 on
    assert admission.keys(other, req) == plain(other)
    middle = list(other)
    middle[100] = (middle[100] + 1) % vocab  # one token inside; the last keys stay equal
    assert admission.keys(middle + [7], req) == plain(middle + [7])
    assert req.pair_keys == plain(middle + [7]) and req.pair_tokens == middle + [7]
    first = [(middle[0] + 1) % vocab] + middle[1:]  # the very first token
    assert admission.keys(first, req) == plain(first)

"""PD decode's prefix cache (--disaggregation-decode-enable-radix-cache): decode matches a
prompt in its own tree of KV pages, tells prefill decode_prefix_len, and prefill ships only the
pages past it (plus the state rows and aux row, always)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import httpx
import pytest
import torch

from serving.config import ModelConfig
from serving.engine.admission import Admission
from serving.engine.request import Req
from serving.memory.pool import MemoryPool, PoolPlan
from serving.memory.radix_cache import RadixCache
from serving.protocol import SchedulerStats
from tests.pd_pair import PDPair
from workers.decode_transfer import Quarantine
from workers.messages import Destination, decode, encode
from workers.rank_transfer import Ship
from workers.shipping import Room, Shipping

PAGE = 16


def shipping() -> Shipping:
    s = Shipping.__new__(Shipping)
    s.pool = SimpleNamespace(plan=SimpleNamespace(page_size=PAGE))
    s.peers = {"decode:1": None}
    s.to_ship, s.orders, s.jobs, s.job_ids, s.world = [], [], {}, itertools.count(1), 1
    s._write_aux = lambda req, room: None
    return s


def room(n: int, held: int, max_new_tokens: int = 4) -> Room:
    request = SimpleNamespace(
        input_ids=list(range(n)),
        sampling=SimpleNamespace(max_new_tokens=max_new_tokens),
        bootstrap_room=7,
    )
    pages = -(-n // PAGE)
    r = Room(request, deadline=0.0)
    r.dest = Destination(7, "s", "decode:1", list(range(100, 100 + pages)), 3, n, held)
    r.req = SimpleNamespace(pages=list(range(pages)), row=5)
    return r


def test_destination_carries_decode_prefix_len_and_defaults_to_none_held():
    msg = Destination(1, "s", "d:1", [4, 5, 6], 2, 40, 32)
    assert decode(encode(msg)) == msg
    old = b'{"kind":"dest","room":1,"session":"s","decode_addr":"d:1","pages":[4],"row":2,'
    assert decode(old + b'"prompt_len":3}').decode_prefix_len == 0


def test_prefill_ships_only_the_pages_past_decodes_prefix():
    s, r = shipping(), room(70, 32)  # 5 pages, decode holds 2
    assert s.destination_problem(r, r.dest) is None
    r.computed = 48  # a chunk ended at 3 whole pages: only page 2 is new
    s.record(7, final=False)
    s.record(7, final=True)
    s.order({7: r})
    first, last = s.orders
    assert isinstance(first, Ship) and (first.src_pages, first.dst_pages) == ([2], [102])
    assert first.rows is None
    assert (last.src_pages, last.dst_pages, last.rows) == ([3, 4], [103, 104], (5, 3))


def test_a_prompt_held_whole_by_decode_ships_only_its_rows():
    s, r = shipping(), room(64, 64)
    assert s.destination_problem(r, r.dest) is None
    r.computed = 48
    s.record(7, final=False)  # nothing new: no order
    s.record(7, final=True)
    s.order({7: r})
    (last,) = s.orders
    assert (last.src_pages, last.dst_pages, last.rows) == ([], [], (5, 3))


def test_decode_prefix_len_off_the_pages_is_refused():
    s = shipping()
    for held in (-16, 20, 80):
        r = room(70, held)
        assert "decode_prefix_len" in s.destination_problem(r, r.dest)
    r = room(70, 16, max_new_tokens=0)  # scoring-only: no memory at decode, nothing held
    r.dest = Destination(7, "s", "decode:1", [], -1, 70, 16)
    assert s.destination_problem(r, r.dest) is not None


# ---- decode's tree: KV pages, no snapshots ----


@pytest.fixture
def pool(tiny_ckpt):
    config = ModelConfig.from_pretrained(tiny_ckpt)
    plan = PoolPlan(rows=4, pages=32, page_size=PAGE, max_context=512, state_slots=0)
    return MemoryPool(config, plan, torch.float32, "cpu")


def all_back(pool: MemoryPool) -> bool:
    return not pool.pages.used and not pool.rows.used


def test_a_pages_only_match_splits_at_the_last_shared_page_and_keeps_unlocked_leaves(pool):
    cache = RadixCache(pool, PAGE, snapshots=False)
    a = list(range(100))
    node, adopted = cache.insert(a[:96], pool.pages.alloc(6))
    assert len(adopted) == 6
    cache.lock(node)
    cache.unlock(node)  # no state: still the cache's content, not a tombstone
    assert cache.pages_held == 6 and cache.match_pages(a).length == 96
    b = a[:40] + [999] * 60  # parts inside page 2: pages 0-1 match, the node splits after them
    m = cache.match_pages(b)
    assert m.length == 32 and m.node.pages == node.parent.pages and len(m.node.pages) == 2
    cache.lock(m.node)
    assert cache.evict_pages(6) == 4  # the locked upper half stays
    assert cache.pages_held == 2 and cache.match_pages(a).length == 32
    cache.unlock(m.node)
    assert cache.match_pages([5] * 40).node is None
    cache.flush()
    assert all_back(pool)


def request(ids: list[int], out: list[int] | None = None) -> Req:
    sampling = SimpleNamespace(output_ids=list(out or []), params=SimpleNamespace())
    return Req("r", list(ids), sampling)


def test_decode_admission_maps_the_held_prefix_and_caches_an_adopted_requests_pages(pool):
    cache = RadixCache(pool, PAGE, snapshots=False)
    stats = SchedulerStats()
    admission = Admission(pool, stats, cache)
    turn1 = list(range(40))
    first = request(turn1)
    assert admission.admit(first, 40, 0, prefilled_elsewhere=True) == 40
    assert first.decode_cached_tokens == 0 and first.cached_tokens is None  # adopt sets it
    first.adopted = True
    first.sampling.output_ids += [500 + i for i in range(30)]  # 70 tokens, 69 fed
    assert admission.grow(first, 70)
    first.cached = 69
    admission.release(first)  # 69 computed: 4 whole pages join the tree, the rest is freed
    assert cache.pages_held == 4 and pool.pages.num_used == 4
    turn2 = turn1 + [500 + i for i in range(30)] + [7] * 20
    second = request(turn2)
    assert admission.admit(second, len(turn2), 0, prefilled_elsewhere=True) == 90 - 64
    assert second.decode_cached_tokens == 64 and second.prefix is not None
    assert second.pages[:4] == cache.match_pages(turn2).node.path_pages()
    assert (stats.cache_lookup_tokens_total, stats.cache_hit_tokens_total) == (130, 64)
    local = request(turn2)  # a local prefill (no state in this tree) takes no hit
    assert admission.admit(local, len(turn2), 1) == 90 and local.decode_cached_tokens is None
    admission.release(local)  # not adopted: its pages are not the tree's
    assert cache.pages_held == 4
    admission.release(second)  # adopted never: a failed preallocation inserts nothing
    cache.flush()
    assert all_back(pool)


def test_a_quarantined_request_keeps_its_prefix_locked_and_frees_only_its_own_pages(pool):
    cache = RadixCache(pool, PAGE, snapshots=False)
    admission = Admission(pool, SchedulerStats(), cache)
    held = list(range(64))
    cache.insert(held, pool.pages.alloc(4))
    req = request(held + [1] * 30)
    admission.admit(req, 94, 0, prefilled_elsewhere=True)
    assert req.decode_cached_tokens == 64
    transfer = SimpleNamespace(req=req, room=3, rank="p:1")
    quarantine = Quarantine(admission.release, timeout=30)
    quarantine.hold(transfer)
    assert req.prefix is None and not req.shared_pages
    assert cache.evict_pages(4) == 0  # still locked by the holder
    quarantine.acked(3)
    assert cache.pages_held == 4 and pool.pages.num_used == 4 and not pool.rows.used
    cache.flush()
    assert all_back(pool)


# ---- through a real PD pair (Mooncake over loopback), decode's cache on ----


@pytest.fixture(scope="module")
def cached_pair(tiny_ckpt, tmp_path_factory):
    pytest.importorskip("mooncake.engine")
    p = PDPair(
        tiny_ckpt,
        tmp_path_factory.mktemp("pd-decode-cache"),
        decode_flags=("--disaggregation-decode-enable-radix-cache",),
    )
    yield p
    p.stop()


def greedy_body(ids: list[int], n: int) -> dict:
    return {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
    }


def shipped_bytes(pair: PDPair) -> float:
    """Bytes prefill wrote for its last room (every job of it, all ranks)."""
    return pair.prefill.stats()["kv_transfer_total_mb"] * 1e6


def flushed(pair: PDPair) -> dict:
    """Decode's stats after its cache was emptied: every page and row must be free."""
    r = httpx.post(pair.decode.url + "/flush_cache", timeout=30)
    assert r.status_code == 200, r.text
    return pair.decode.idle_pool()


def test_multi_turn_ships_only_the_pages_decode_lacks_and_equals_greedy(cached_pair, tiny_ckpt):
    """Each turn's prompt is the last one, its answer and new text. Decode holds the last
    turn's KV through its last whole computed page (prompt + answer - 1 tokens), tells prefill,
    and prefill ships only the pages past it plus the rows: the bytes fit pages * a + b with one
    a and b over turns of 3, 1 and 2 shipped pages. Greedy tokens equal a float32 oracle."""
    from serving.config import ModelConfig
    from serving.models.loader import load_weights
    from serving.tools.generate import StepRunner

    model, _ = load_weights(tiny_ckpt, ModelConfig.from_pretrained(tiny_ckpt), torch.float32)
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 1000, (37,), generator=g).tolist()
    n, held, shipped, hits = 12, 0, [], 0
    for new in (9, 25, None):
        decode, prefill = cached_pair.dispatch("/generate", greedy_body(ids, n))
        assert decode.status_code == 200, decode.text
        out, meta = decode.json()["output_ids"], decode.json()["meta_info"]
        assert out == StepRunner(model, 1, 512).greedy([ids], n)[0]
        assert meta["decode_cached_tokens"] == held
        # no double count: cached_tokens is prefill's hit alone (SGLang #25972)
        assert meta["cached_tokens"] == prefill.json()["meta_info"]["cached_tokens"]
        pages = -(-len(ids) // PAGE) - held // PAGE
        shipped.append((pages, shipped_bytes(cached_pair)))
        hits += held
        if new is None:
            break
        held = (len(ids) + n - 1) // PAGE * PAGE
        ids = ids + out + torch.randint(0, 1000, (new,), generator=g).tolist()
    assert [p for p, _ in shipped] == [3, 1, 2]
    (_, b3), (_, b1), (_, b2) = shipped
    page_bytes, row_bytes = (b3 - b1) / 2, b1 - (b3 - b1) / 2
    assert page_bytes > 0 and row_bytes > 0
    assert b2 == pytest.approx(2 * page_bytes + row_bytes, rel=1e-6)
    stats = cached_pair.decode.idle_pool()
    assert stats["cached_pages"] > 0 and stats["used_pages"] == 0  # cached pages are not used
    assert stats["cache_hit_tokens_total"] == hits > 0  # decode's /metrics cache_hit_rate
    after = flushed(cached_pair)
    assert after["cached_pages"] == 0 and after["used_pages"] == 0 and after["used_rows"] == 0


def test_abort_mid_transfer_with_a_locked_prefix_frees_after_the_ack(cached_pair):
    """Decode matched a cached prefix and sent its destinations; prefill never got the request
    and the client leaves. The quarantine keeps the prefix locked until prefill's ack; then the
    row and the request's own pages are free and the tree still holds the prefix."""
    ids = list(range(100, 150))
    decode, _ = cached_pair.dispatch("/generate", greedy_body(ids, 8))
    assert decode.status_code == 200, decode.text
    cached = cached_pair.decode.idle_pool()["cached_pages"]
    assert cached >= 3
    body = {**greedy_body(ids + [7] * 30, 50), "stream": True, **cached_pair.bootstrap()}
    with pytest.raises(httpx.ReadTimeout):
        with httpx.stream(
            "POST", cached_pair.decode.url + "/generate", json=body, timeout=1.5
        ) as r:
            for _ in r.iter_lines():
                pass
    stats = cached_pair.decode.idle_pool(timeout=25)  # the ack timeout is 30 s
    assert stats["cached_pages"] == cached
    cached_pair.prefill.idle_pool()
    after = flushed(cached_pair)
    assert after["cached_pages"] == 0 and after["used_pages"] == 0 and after["used_rows"] == 0


def test_preallocation_under_memory_pressure_evicts_unlocked_cached_pages_lru(pool):
    cache = RadixCache(pool, PAGE, snapshots=False)
    admission = Admission(pool, SchedulerStats(), cache)
    old, recent = [1] * 8 * PAGE, [2] * 8 * PAGE
    cache.insert(old, pool.pages.alloc(8))
    cache.insert(recent, pool.pages.alloc(8))
    cache.match_pages(recent)  # used last: evicted last
    hit = request(recent + [3] * 40)
    assert admission.admit(hit, len(hit.input_ids), 0, prefilled_elsewhere=True) == 40
    big = request([4] * 14 * PAGE)  # 14 + 1 reserve pages; 32 - 8 - 8 - 3 = 13 free
    assert admission.admit(big, 14 * PAGE, 0, prefilled_elsewhere=True) == 14 * PAGE
    assert cache.match_pages(old).node is None and cache.match_pages(recent).length == 8 * PAGE
    assert admission.admit(request([5] * 20 * PAGE), 20 * PAGE, 0, True) is None  # locked
    assert cache.match_pages(recent).length == 8 * PAGE
    for r in (hit, big):
        admission.release(r)
    cache.flush()
    assert all_back(pool)


def test_multi_turn_with_eagle_keys_pages_by_pairs_and_equals_greedy(distilled_ckpt, tmp_path):
    """EAGLE on both sides: decode's tree is keyed by (token, next token) pairs, its pages hold
    the draft's KV too, and the draft's rows still come from prefill. Greedy tokens equal the
    target's (float32 oracle), decode's hit is the last turn's whole pages, drafts are accepted."""
    pytest.importorskip("mooncake.engine")
    from serving.config import ModelConfig
    from serving.models.loader import load_weights
    from serving.tools.generate import StepRunner

    spec = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "1")
    spec += ("--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "2")
    config = ModelConfig.from_pretrained(distilled_ckpt)
    model, _ = load_weights(distilled_ckpt, config, torch.float32)
    pd = PDPair(
        distilled_ckpt,
        tmp_path,
        prefill_flags=spec,
        decode_flags=(*spec, "--disaggregation-decode-enable-radix-cache"),
    )
    try:
        g = torch.Generator().manual_seed(12)
        ids = torch.randint(0, 1000, (37,), generator=g).tolist()
        n, held = 16, 0
        for new in (9, 25, None):
            decode, _ = pd.dispatch("/generate", greedy_body(ids, n))
            assert decode.status_code == 200, decode.text
            out = decode.json()["output_ids"]
            assert out == StepRunner(model, 1, 512).greedy([ids], n)[0]
            assert decode.json()["meta_info"]["decode_cached_tokens"] == held
            if new is None:
                break
            held = (len(ids) + n - 1) // PAGE * PAGE
            ids = ids + out + torch.randint(0, 1000, (new,), generator=g).tolist()
        stats = pd.decode.idle_pool()
        assert stats["spec_committed_tokens"] > stats["spec_verify_steps"]  # drafts accepted
        after = flushed(pd)
        assert after["cached_pages"] == 0 and after["used_pages"] == 0 and after["used_rows"] == 0
    finally:
        pd.stop()

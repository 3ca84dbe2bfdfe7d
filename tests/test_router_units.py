"""Router pieces on their own: the bootstrap triple, the policies, admission, health states."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from router.admission import Admission
from router.bootstrap import batch_size, inject_bootstrap
from router.errors import ClientError
from router.policies import CacheAware, PowerOfTwo, Random, RoundRobin, prompt_text
from router.workers import Worker, WorkerRegistry

PREFILL = Worker("http://prefill-host:32171", "prefill", 28998)
CHAT = "/v1/chat/completions"


def workers(n: int, role: str = "decode") -> list[Worker]:
    return [Worker(f"http://w{i}:{8000 + i}", role) for i in range(n)]


# ---- bootstrap ----
def test_single_request_gets_scalar_triple_overwriting_the_clients_room():
    body = {"messages": [{"role": "user", "content": "hi"}], "bootstrap_room": 42, "n": 2}
    inject_bootstrap(CHAT, body, PREFILL)
    assert body["bootstrap_host"] == "prefill-host"
    assert body["bootstrap_port"] == 28998
    assert isinstance(body["bootstrap_room"], int) and body["bootstrap_room"] != 42
    assert 0 <= body["bootstrap_room"] < 2**63


def test_prefill_without_bootstrap_port_sends_null():
    body = {"text": "hi"}
    inject_bootstrap("/generate", body, Worker("http://localhost:9", "prefill", None))
    assert body["bootstrap_host"] == "localhost" and body["bootstrap_port"] is None


@pytest.mark.parametrize(
    "route, body, n",
    [
        ("/generate", {"text": ["a", "b", "c"]}, 3),
        ("/generate", {"input_ids": [[1, 2], [3], [4, 5]]}, 3),
        ("/generate", {"input_ids": [1, 2, 3]}, None),
        ("/generate", {"text": "one"}, None),
        ("/v1/completions", {"prompt": ["a", "b"]}, 2),
        ("/v1/completions", {"prompt": [[1, 2], [3, 4]]}, 2),
        ("/v1/completions", {"prompt": [1, 2, 3]}, None),
        ("/v1/completions", {"prompt": "one"}, None),
        (CHAT, {"messages": [], "n": 4}, None),
    ],
)
def test_batches_get_one_entry_per_prompt(route, body, n):
    assert batch_size(route, body) == n
    inject_bootstrap(route, body, PREFILL)
    if n is None:
        assert isinstance(body["bootstrap_room"], int)
        return
    assert body["bootstrap_host"] == ["prefill-host"] * n
    assert body["bootstrap_port"] == [28998] * n
    rooms = body["bootstrap_room"]
    assert len(rooms) == n == len(set(rooms))
    assert all(0 <= r < 2**63 for r in rooms)


def test_rooms_are_fresh_per_request_even_with_the_global_rng_seeded():
    seen = set()
    for _ in range(2):
        random.seed(0)
        for _ in range(50_000):
            body: dict = {}
            inject_bootstrap(CHAT, body, PREFILL)
            seen.add(body["bootstrap_room"])
    assert len(seen) == 100_000
    assert max(seen) >= 2**62  # all 63 bits are used


# ---- policies ----
def test_round_robin_cycles_in_order():
    ws = workers(3)
    rr = RoundRobin()
    assert [rr.select(ws, None) for _ in range(7)] == [*ws, *ws, ws[0]]


def test_random_covers_every_worker_evenly():
    ws = workers(4)
    policy = Random(random.Random(1))
    counts = Counter(policy.select(ws, None) for _ in range(4000))
    assert set(counts) == set(ws)
    assert min(counts.values()) > 800


def test_power_of_two_picks_the_less_loaded_of_two():
    ws = workers(3)
    ws[0].in_flight, ws[1].in_flight, ws[2].in_flight = 5, 0, 9
    p2 = PowerOfTwo(random.Random(0))
    picks = Counter(p2.select(ws, None) for _ in range(300))
    assert ws[2] not in picks  # never the most loaded, it always loses its pair
    assert picks[ws[1]] > picks[ws[0]]  # the idle one wins every pair it is in
    assert p2.select(ws[:1], None) is ws[0]


def test_cache_aware_sends_a_shared_prefix_to_the_same_worker():
    ws = workers(3)
    ca = CacheAware(cache_threshold=0.5)
    system = "You are a careful assistant. " * 20  # 580 characters shared
    first = ca.select(ws, system + "question one")
    first.in_flight += 1  # it is busy now: without affinity the next would go elsewhere
    assert ca.select(ws, system + "question two, a different one") is first
    other = ca.select(ws, "an unrelated prompt " * 30)
    assert other is not first  # no match: the least loaded


def test_cache_aware_threshold_and_unhealthy_owner():
    ws = workers(2)
    ca = CacheAware(cache_threshold=0.9)
    owner = ca.select(ws, "a" * 640)
    owner.in_flight += 1
    # 640 of 1280 characters match: below 0.9, so the least loaded worker takes it
    assert ca.select(ws, "a" * 640 + "b" * 640) is not owner
    ca2 = CacheAware(cache_threshold=0.1)
    owner2 = ca2.select(ws, "x" * 640)
    others = [w for w in ws if w is not owner2]
    assert ca2.select(others, "x" * 640) is others[0]  # the owner is not offered


def test_cache_aware_gives_way_to_load_imbalance():
    ws = workers(2)
    ca = CacheAware(cache_threshold=0.1, balance_abs=4, balance_rel=1.5)
    owner = ca.select(ws, "p" * 1000)
    owner.in_flight = 10
    assert ca.select(ws, "p" * 1000) is not owner  # 10 vs 0: imbalanced, load wins
    owner.in_flight = 3
    other = next(w for w in ws if w is not owner)
    assert ca.select(ws, "p" * 1000) is other  # the prefix moved with the last request


def test_cache_aware_table_is_bounded():
    ca = CacheAware(max_chars=64 * 10)
    ws = workers(2)
    for i in range(100):
        ca.select(ws, f"{i:04d}" * 100)
    assert len(ca.table) == 10


def test_prompt_text():
    chat = {"messages": [{"role": "system", "content": "S"},
                         {"role": "user", "content": [{"type": "text", "text": "U"}]}]}  # fmt: skip
    assert prompt_text(CHAT, chat) == "system\x00S\x00user\x00U\x00"
    assert prompt_text("/v1/completions", {"prompt": ["first", "second"]}) == "first"
    assert prompt_text("/generate", {"input_ids": [1, 2, 3]}) == "1,2,3"
    assert prompt_text("/generate", {"input_ids": [[7, 8], [9]]}) == "7,8"
    assert prompt_text("/generate", "not a dict") == ""
    assert prompt_text("/v1/responses", {"input": "hi", "text": {"format": {}}}) == "hi"
    items = [{"role": "user", "content": "hi"}]
    assert prompt_text("/v1/responses", {"input": items}) == '[{"role": "user", "content": "hi"}]'


# ---- health state machine ----
def test_health_states():
    w = Worker("http://w:1", "decode")
    reg = WorkerRegistry([w])
    changes = []
    reg.listeners.append(lambda x: changes.append(x.healthy))
    w.probe_result(False, "refused", 3, 2)
    assert not w.healthy and reg.healthy["decode"] == []
    w.probe_result(True, "", 3, 2)  # first success: admitted at once
    assert w.healthy and reg.healthy["decode"] == [w]
    w.probe_result(False, "503", 3, 2)
    w.probe_result(False, "503", 3, 2)
    assert w.healthy  # 2 of 3
    w.probe_result(False, "503", 3, 2)
    assert not w.healthy and reg.healthy["decode"] == []
    w.probe_result(True, "", 3, 2)
    assert not w.healthy  # 1 of 2 after having been taken out
    w.probe_result(True, "", 3, 2)
    assert w.healthy
    w.mark_down("cannot connect")
    assert not w.healthy and w.last_error == "cannot connect"
    assert changes == [True, False, True, False]
    assert "0 healthy" in reg.unavailable("decode") and "cannot connect" in reg.unavailable(
        "decode"
    )


# ---- admission ----
def test_admission_limit_queue_and_timeouts():
    async def scenario():
        adm = Admission(limit=2, queue_size=1, queue_timeout=0.2)
        await adm.acquire()
        await adm.acquire()
        queued = asyncio.ensure_future(adm.acquire())
        await asyncio.sleep(0)
        with pytest.raises(ClientError) as full:
            await adm.acquire()
        assert full.value.status == 429
        adm.release()  # hands the slot to the queued one
        await queued
        assert adm.active == 2 and not adm.waiting
        with pytest.raises(ClientError) as late:
            await adm.acquire()
        assert late.value.status == 408
        assert not adm.waiting
        # a queued request whose client leaves gives its place up
        gone = asyncio.ensure_future(adm.acquire())
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        assert not adm.waiting
        adm.release()
        adm.release()
        assert adm.active == 0

    asyncio.run(scenario())


def test_no_limit_means_no_bookkeeping():
    async def scenario():
        adm = Admission(limit=-1, queue_size=0, queue_timeout=1)
        for _ in range(1000):
            await adm.acquire()
        adm.release()
        assert adm.active == 0 and not adm.waiting

    asyncio.run(scenario())

"""PD with TP/EP on CPU: real prefill and decode workers of 2 gloo ranks each (tiny checkpoint,
float32), every rank writing its own share over the real Mooncake engine on loopback TCP.

One set of four workers serves every test: prefill TP2 and decode TP2, both with EAGLE (2 draft
steps, the NextN draft sharded like the target: its pages, state rows, draft token and draft
hidden travel with the target's; decode TP2 keeps its prefix cache of KV pages, whose page maps
its follower replays), prefill EP2, decode TP1 (both plain). The checkpoint is the
distilled one (tests/conftest.py), whose draft is accepted on new prompts, so a draft state that
arrived wrong would show as drafts no longer accepted (greedy tokens alone would not show it).
Greedy tokens of the TP2 EAGLE pair (and of our router in front of it), and of an EP2 prefill
feeding a one-rank decode, equal one rank's plain decoding; pairs of different TP sizes are
refused at the handshake with both sizes named, and every worker keeps serving; afterwards no
row or page is in use.
"""

from __future__ import annotations

import threading

import httpx
import pytest
import torch

from tests.pd_pair import FAST_TIMEOUTS, PDPair
from tests.router_proc import RouterProc
from tests.server_proc import Server, eagle_flags, free_port

pytest.importorskip("mooncake.engine")

# small pools (less memory to register), no warm-up forward: start-up is most of this file's time
COMMON = ("--context-length", "256", "--max-total-tokens", "4096", "--skip-server-warmup")
# ragged, longer than index_topk (32), unaligned to the page (16) and kpool (4); 70 and 90 take
# several prefill chunks of 16
LENGTHS = (5, 17, 38, 70, 90)
NEW_TOKENS = 8


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (n,), generator=g).tolist()


def greedy_body(ids: list[int]) -> dict:
    return {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
    }


@pytest.fixture(scope="module")
def reference(distilled_ckpt):
    """One rank's greedy tokens (the engine's own step loop, in this process)."""
    from serving.config import ModelConfig
    from serving.models.loader import load_weights
    from serving.tools.generate import StepRunner

    config = ModelConfig.from_pretrained(distilled_ckpt)
    model, _ = load_weights(distilled_ckpt, config, torch.float32)
    return lambda ids: StepRunner(model, 1, 256).greedy([ids], NEW_TOKENS)[0]


class Workers:
    """Prefill TP2, decode TP2, prefill EP2, decode TP1, started at once."""

    def __init__(self, model, logs) -> None:
        self.ports = {"p_tp2": free_port(), "p_ep2": free_port()}
        flags = {
            "p_tp2": ("--tp-size", "2", "--chunked-prefill-size", "16", *eagle_flags(2)),
            "d_tp2": (
                *("--tp-size", "2", "--max-running-requests", "3", *eagle_flags(2)),
                "--disaggregation-decode-enable-radix-cache",
            ),
            "p_ep2": ("--ep-size", "2", "--chunked-prefill-size", "16"),
            "d_tp1": ("--max-running-requests", "3"),
        }
        self.servers: dict[str, Server] = {}

        def start(name: str) -> None:
            role = "prefill" if name.startswith("p") else "decode"
            extra = ("--disaggregation-decode-extra-slots", "2") if role == "decode" else ()
            if role == "prefill":
                extra = ("--disaggregation-bootstrap-port", str(self.ports[name]))
            self.servers[name] = Server(
                model,
                "--disaggregation-mode",
                role,
                *COMMON,
                *flags[name],
                *extra,
                log_dir=logs,
                env=FAST_TIMEOUTS,
            )

        threads = [threading.Thread(target=start, args=(name,)) for name in flags]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if len(self.servers) != len(flags):
            self.stop()
            raise RuntimeError(f"a worker did not start; see the logs in {logs}")

    def pair(self, prefill: str, decode: str) -> PDPair:
        return PDPair.join(self.servers[prefill], self.ports[prefill], self.servers[decode])

    def idle(self) -> None:
        """Rank 0 holds the only free lists (followers replay its row resets and page maps):
        every row (and so every aux row) and every page is back on them."""
        for srv in self.servers.values():
            stats = srv.idle_pool(timeout=30)
            assert stats["used_rows"] == 0 and stats["used_pages"] == 0, stats

    def stop(self) -> None:
        threads = [threading.Thread(target=srv.stop) for srv in self.servers.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


@pytest.fixture(scope="module")
def workers(distilled_ckpt, tmp_path_factory):
    w = Workers(distilled_ckpt, tmp_path_factory.mktemp("pd-tp"))
    yield w
    w.stop()


def run_concurrently(pair: PDPair, prompts: list[list[int]]) -> list[list[int] | None]:
    got: dict[int, list[int]] = {}

    def one(i: int) -> None:
        decode, prefill = pair.dispatch("/generate", greedy_body(prompts[i]), timeout=120)
        assert prefill.status_code == 200, prefill.text
        assert decode.status_code == 200, decode.text
        got[i] = decode.json()["output_ids"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    return [got.get(i) for i in range(len(prompts))]


def test_tp2_eagle_pair_equals_one_rank(workers, reference):
    """Each rank's KDA heads (target and draft) go to the matching decode rank, the replicated
    pages to both; all requests at once (more than decode's 3 running slots: its extra slots
    hold the others); decode verified drafts on both ranks."""
    pair = workers.pair("p_tp2", "d_tp2")
    prompts = [prompt(i, n) for i, n in enumerate(LENGTHS)]
    assert run_concurrently(pair, prompts) == [reference(p) for p in prompts]
    stats = workers.servers["d_tp2"].stats()
    assert stats["spec_num_steps"] == 2 and stats["spec_verify_steps"] > 0, stats
    # 1 token per verify step would mean no draft accepted: decode's first draft token and
    # draft hidden state come from prefill's ranks (38 tokens in 16 verify steps, 2026-12-01)
    assert stats["spec_committed_tokens"] > 1.5 * stats["spec_verify_steps"], stats
    workers.idle()


def test_tp2_decode_cache_keeps_the_last_turn_and_equals_one_rank(workers, reference):
    """Decode TP2 with its page cache: the second turn (the first, its answer, new text) maps
    the first turn's whole computed pages on both ranks (the follower replays rank 0's page
    map) and prefill's ranks ship only the rest; tokens equal one rank's, drafts accepted."""
    pair = workers.pair("p_tp2", "d_tp2")
    ids, held = prompt(40, 38), 0
    for _ in range(2):
        decode, prefill = pair.dispatch("/generate", greedy_body(ids), timeout=120)
        assert decode.status_code == 200 and prefill.status_code == 200, decode.text
        out = decode.json()["output_ids"]
        assert out == reference(ids)
        assert decode.json()["meta_info"]["decode_cached_tokens"] == held
        held = (len(ids) + NEW_TOKENS - 1) // 16 * 16
        ids = ids + out + prompt(41, 20)
    stats = workers.servers["d_tp2"].stats()
    assert stats["cached_pages"] > 0, stats
    workers.idle()


def test_ep2_prefill_feeds_one_rank_decode(workers, reference):
    """tp 1 on both sides: every EP rank holds the whole state, prefill rank 0 feeds decode's
    only rank, and rank 1 has nothing to send."""
    pair = workers.pair("p_ep2", "d_tp1")
    prompts = [prompt(10 + i, n) for i, n in enumerate(LENGTHS[1:4])]
    assert run_concurrently(pair, prompts) == [reference(p) for p in prompts]
    workers.idle()


@pytest.mark.parametrize(
    ("prefill", "decode", "sizes"),
    [
        ("p_tp2", "d_tp1", "prefill tp 2 / decode tp 1"),
        ("p_ep2", "d_tp2", "prefill tp 1 / decode tp 2"),
    ],
)
def test_different_tp_sizes_are_refused_and_both_keep_serving(
    workers, reference, prefill, decode, sizes
):
    decode_r, prefill_r = workers.pair(prefill, decode).dispatch(
        "/generate", greedy_body(prompt(20, 12)), timeout=60
    )
    assert decode_r.status_code == 502, decode_r.text
    assert sizes in decode_r.json()["error"]["message"]
    assert prefill_r.status_code == 502, prefill_r.text  # at once, not after its 15 s timeout
    assert sizes in prefill_r.json()["error"]["message"]
    partner = {"p_tp2": "d_tp2", "d_tp1": "p_ep2", "p_ep2": "d_tp1", "d_tp2": "p_tp2"}
    p = prompt(21, 9)
    for pair in (workers.pair(prefill, partner[prefill]), workers.pair(partner[decode], decode)):
        assert run_concurrently(pair, [p]) == [reference(p)]
    workers.idle()


def test_router_in_front_of_a_tp2_pair(workers, reference, tmp_path):
    router = RouterProc(
        "--pd-disaggregation",
        "--prefill",
        workers.servers["p_tp2"].url,
        str(workers.ports["p_tp2"]),
        "--decode",
        workers.servers["d_tp2"].url,
        "--health-check-interval-secs",
        "0.3",
        "--health-success-threshold",
        "1",
        log_dir=tmp_path,
    )
    try:
        router.wait_ready()
        prompts = [prompt(30 + i, n) for i, n in enumerate(LENGTHS[:3])]
        got: dict[int, list[int]] = {}

        def one(i: int) -> None:
            r = httpx.post(router.url + "/generate", json=greedy_body(prompts[i]), timeout=120)
            assert r.status_code == 200, r.text
            got[i] = r.json()["output_ids"]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert [got.get(i) for i in range(len(prompts))] == [reference(p) for p in prompts]
    finally:
        router.stop()
    workers.idle()

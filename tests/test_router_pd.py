"""Our router in front of real PD workers: 2 prefill + 2 decode on the tiny checkpoint, KV over
Mooncake on loopback, the router as its own process (`python -m router.launch_router`).

Chat, completions and /generate, streaming and not; 32 requests at once; round-robin order as
the workers' own counters show it; a prefill worker killed in the middle of a run, then
restarted; a decode worker killed under a stream.
"""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest

from tests import server_proc
from tests.router_proc import RouterProc
from tests.server_proc import Server, free_port
from tests.waiting import wait_until


def _fast_timeouts() -> dict[str, str]:
    from tests.pd_pair import FAST_TIMEOUTS

    return FAST_TIMEOUTS


class Cluster:
    """2 prefill + 2 decode workers and our router, round robin on both sides."""

    def __init__(self, model, logs) -> None:
        self.model, self.logs = model, logs
        self.bootstrap_ports = [free_port(), free_port()]
        started: dict[str, Server] = {}

        def start(name: str, *flags: str) -> None:
            started[name] = Server(model, *flags, log_dir=logs, env=_fast_timeouts())

        jobs = [("p0", *self._prefill_flags(0)), ("p1", *self._prefill_flags(1)),
                ("d0", "--disaggregation-mode", "decode"),
                ("d1", "--disaggregation-mode", "decode")]  # fmt: skip
        threads = [threading.Thread(target=start, args=job) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.workers = started
        if len(started) != 4:
            self.stop()
            raise RuntimeError("a PD worker did not start; see the logs in " + str(logs))
        argv = ["--pd-disaggregation", "--prefill-policy", "round_robin",
                "--decode-policy", "round_robin", "--request-timeout-secs", "60",
                "--health-check-interval-secs", "0.3", "--health-success-threshold", "1",
                "--model-path", str(model)]  # fmt: skip
        for i in (0, 1):
            argv += ["--prefill", started[f"p{i}"].url, str(self.bootstrap_ports[i])]
        for i in (0, 1):
            argv += ["--decode", started[f"d{i}"].url]
        self.router = RouterProc(*argv, log_dir=logs)
        self.router.wait_ready()
        self.url = self.router.url

    def _prefill_flags(self, i: int) -> tuple[str, ...]:
        return ("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                str(self.bootstrap_ports[i]))  # fmt: skip

    def restart_prefill(self, i: int, monkeypatch) -> None:
        old = self.workers[f"p{i}"]
        old.stop()
        monkeypatch.setattr(server_proc, "free_port", lambda: old.port)  # same address
        self.workers[f"p{i}"] = Server(self.model, *self._prefill_flags(i), log_dir=self.logs,
                                       env=_fast_timeouts())  # fmt: skip

    def counters(self) -> dict[str, int]:
        """Prompt tokens each live worker has taken in, in all."""
        live = {n: w for n, w in self.workers.items() if w.proc.poll() is None}
        return {n: w.stats()["prompt_tokens_total"] for n, w in live.items()}

    def stop(self) -> None:
        if hasattr(self, "router"):
            self.router.stop()
        for w in self.workers.values():
            w.stop()


@pytest.fixture(scope="module")
def cluster(tiny_ckpt, tmp_path_factory):
    c = Cluster(tiny_ckpt, tmp_path_factory.mktemp("router-pd"))
    yield c
    c.stop()


def generate(url: str, ids: list[int], n: int = 6, **extra) -> httpx.Response:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                                   "ignore_eos": True}, **extra}  # fmt: skip
    return httpx.post(url + "/generate", json=body, timeout=60)


def test_round_robin_order_in_the_workers_counters(cluster):
    """Request i has 2**i prompt tokens, so each worker's prompt-token count names exactly the
    requests it served."""
    before = cluster.counters()
    for i in range(8):
        assert generate(cluster.url, list(range(1, 2**i + 1)), n=2).status_code == 200
    served = {n: c - before[n] for n, c in cluster.counters().items()}
    first, second = sum(2**i for i in (0, 2, 4, 6)), sum(2**i for i in (1, 3, 5, 7))
    assert served == {"p0": first, "p1": second, "d0": first, "d1": second}


def test_chat_completions_generate_streaming_and_not(cluster):
    url = cluster.url
    chat = {"messages": [{"role": "user", "content": "Three checks for a 503?"}],
            "max_tokens": 6, "temperature": 0}  # fmt: skip
    a = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60)
    b = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60)  # the other pair
    assert a.status_code == b.status_code == 200
    text = a.json()["choices"][0]["message"]["content"]
    assert b.json()["choices"][0]["message"]["content"] == text
    assert _streamed_text(url, "/v1/chat/completions", chat) == text
    comp = {"prompt": "The router", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    c = httpx.post(url + "/v1/completions", json=comp, timeout=60)
    assert c.status_code == 200 and c.json()["usage"]["completion_tokens"] == 5
    assert _streamed_text(url, "/v1/completions", comp) == c.json()["choices"][0]["text"]
    g = generate(url, [5, 6, 7, 8, 9], n=5).json()
    with httpx.stream(
        "POST",
        url + "/generate",
        timeout=60,
        json={
            "input_ids": [5, 6, 7, 8, 9],
            "stream": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
        },
    ) as r:
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]  # fmt: skip
    assert events[-1] == "[DONE]" and json.loads(events[-2])["output_ids"] == g["output_ids"]


def test_32_concurrent_requests(cluster):
    """16 prompts, each sent twice, all 32 at once: every answer is 200 and both copies of a
    prompt (served by whichever pairs) agree."""
    results: dict[int, httpx.Response] = {}

    def one(i: int) -> None:
        results[i] = generate(cluster.url, [(i % 16) * 7 + k for k in range(1, 12)], n=8)

    before = cluster.counters()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.status_code for r in results.values()) == [200] * 32
    for i in range(16):
        assert results[i].json()["output_ids"] == results[i + 16].json()["output_ids"]
    served = {n: (c - before[n]) // 11 for n, c in cluster.counters().items()}
    assert served == {"p0": 16, "p1": 16, "d0": 16, "d1": 16}


def test_prefill_killed_mid_run_then_restarted(cluster, monkeypatch):
    results: dict[int, httpx.Response | Exception] = {}

    def one(i: int) -> None:
        try:
            results[i] = generate(cluster.url, list(range(3, 40 + i)), n=16)
        except httpx.HTTPError as e:
            results[i] = e

    sent = _sent(cluster)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()

    def all_sent() -> bool:  # mid-run: each prefill worker has its 4 of the 8 (round robin)
        now = _sent(cluster)
        return all(now[p] - sent[p] >= 4 for p in ("p0", "p1"))

    wait_until(all_sent, 60, what="the 8 requests sent")
    cluster.workers["p1"].proc.send_signal(signal.SIGKILL)
    for t in threads:
        t.join()
    for r in results.values():  # completed, or failed with one clean error
        assert isinstance(r, httpx.Response), r
        assert r.status_code == 200 or r.json()["error"]["message"], r.text
    assert sum(r.status_code == 200 for r in results.values()) >= 4  # p0's share at least
    # (in practice all 8: the ones on p1 fail before decode sends a byte, and are retried)
    wait_until(lambda: not _healthy(cluster)["p1"])
    before = cluster.counters()
    for i in range(4):  # new requests avoid the dead worker
        assert generate(cluster.url, [11, 12, 13 + i]).status_code == 200
    assert cluster.counters()["p0"] - before["p0"] == 4 * 3
    for name in ("d0", "d1"):
        cluster.workers[name].idle_pool(timeout=30)  # nothing leaked on decode
    cluster.restart_prefill(1, monkeypatch)
    wait_until(lambda: _healthy(cluster)["p1"])
    before = cluster.counters()
    for i in range(4):
        assert generate(cluster.url, [21, 22, 23 + i]).status_code == 200
    assert cluster.counters()["p1"] - before["p1"] == 2 * 3  # back in rotation


def test_decode_killed_under_a_stream(cluster):
    """Runs last: it leaves d1 dead."""
    body = {"input_ids": [1, 2, 3], "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}  # fmt: skip
    for _ in range(2):  # one of the two lands on d1
        with httpx.stream("POST", cluster.url + "/generate", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(ln for ln in lines if ln.startswith("data: "))
            assert "output_ids" in first
            if cluster.workers["d1"].stats()["running"] == 0:
                continue  # this one is on d0
            cluster.workers["d1"].proc.send_signal(signal.SIGKILL)
            events = [ln[6:] for ln in lines if ln.startswith("data: ")]
            break
    else:
        pytest.fail("neither of two round-robin streams ran on d1")
    assert events[-1] == "[DONE]"
    assert "decode worker" in json.loads(events[-2])["error"]["message"]
    for i in range(3):
        assert generate(cluster.url, [31, 32, 33 + i]).status_code == 200
    assert not _healthy(cluster)["d1"]


def _streamed_text(url: str, path: str, body: dict) -> str:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    out = ""
    for e in events[:-1]:
        for choice in json.loads(e)["choices"]:
            out += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return out


def _healthy(cluster: Cluster) -> dict[str, bool]:
    by_url = {w["url"]: w["healthy"] for w in cluster.router.state()["workers"]}
    return {n: by_url[w.url] for n, w in cluster.workers.items()}


def _sent(cluster: Cluster) -> dict[str, int]:
    """Requests the router has sent each worker, in all."""
    by_url = {w["url"]: w["requests"] for w in cluster.router.state()["workers"]}
    return {n: by_url[w.url] for n, w in cluster.workers.items()}

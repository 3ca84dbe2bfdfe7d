"""Faults under load on a real PD stack: kill -9 of each role mid-stream and its restart, a
disconnect storm, a refusal before the first token retried elsewhere, and a short soak with
RSS and descriptor checks (issue 17). Bounded in time for CI on 2 cores; operators run the soak
for longer with PDSERVE_SOAK_S (docs/RELIABILITY.md).

Stack: one prefill, decode D0 (serves; 2 running requests and 6 extra rows, so requests wait
there with their KV arrived) and decode D1 (started with --max-queued-requests 0: it refuses
every request before its first token with 503 + Retry-After), our router in front.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests import server_proc
from tests.pd_pair import FAST_TIMEOUTS
from tests.router_proc import RouterProc
from tests.server_proc import Server, free_port
from tests.waiting import wait_until

PROMPT = list(range(5, 37))
MARK_DOWN_S = 2.0  # issue 17: a dead worker leaves rotation within this
CLIENT_TIMEOUT_S = 300  # a held head waits for its row: minutes on a loaded 2-core machine
# A short bootstrap timeout: test_waiting_for_a_decode_row_is_not_a_handoff_timeout shows a
# row wait far longer than it does not fail (decode's keepalive); the other timeouts as in tests.
ENV = {**FAST_TIMEOUTS, "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "4"}
D0_FLAGS = ("--disaggregation-mode", "decode", "--max-running-requests", "2",
            "--disaggregation-decode-extra-slots", "6")  # fmt: skip


class Stack:
    def __init__(self, model: Path, logs: Path) -> None:
        self.model, self.logs = model, logs
        self.bootstrap_port = free_port()
        self.prefill = self._prefill()
        self.d0 = Server(model, *D0_FLAGS, log_dir=logs, env=ENV)
        self.d1 = Server(model, "--disaggregation-mode", "decode", "--max-queued-requests", "0",
                         log_dir=logs, env=ENV)  # fmt: skip
        # a long probe interval: detection here must come from the requests themselves
        self.router = RouterProc(
            "--pd-disaggregation", "--prefill", self.prefill.url, str(self.bootstrap_port),
            "--decode", self.d0.url, "--decode", self.d1.url,
            "--health-check-interval-secs", "30", "--health-success-threshold", "1",
            log_dir=logs,
        )  # fmt: skip
        self.router.wait_ready()

    def _prefill(self) -> Server:
        return Server(self.model, "--disaggregation-mode", "prefill",
                      "--disaggregation-bootstrap-port", str(self.bootstrap_port),
                      log_dir=self.logs, env=ENV)  # fmt: skip

    def restart(self, name: str, monkeypatch) -> None:
        old: Server = getattr(self, name)
        old.stop()
        with monkeypatch.context() as m:
            m.setattr(server_proc, "free_port", lambda: old.port)  # the same address
            if name == "prefill":
                setattr(self, name, self._prefill())
            else:
                setattr(self, name, Server(self.model, *D0_FLAGS, log_dir=self.logs,
                                           env=ENV))  # fmt: skip

    def healthy(self, url: str) -> bool:
        return next(w["healthy"] for w in self.router.state()["workers"] if w["url"] == url)

    def stop(self) -> None:
        for s in (self.router, self.d0, self.d1, self.prefill):
            s.stop()


@pytest.fixture(scope="module")
def stack(tiny_ckpt, tmp_path_factory):
    s = Stack(tiny_ckpt, tmp_path_factory.mktemp("faults"))
    yield s
    s.stop()


def body(max_tokens: int, stream: bool = True) -> dict:
    return {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}  # fmt: skip


class Streams:
    """`n` streams through the router, each read to its end in a thread."""

    def __init__(self, url: str, n: int, max_tokens: int) -> None:
        self.started = threading.Semaphore(0)
        self.results: list[tuple[int, str]] = []
        self.threads = [threading.Thread(target=self._one, args=(url, max_tokens))
                        for _ in range(n)]  # fmt: skip
        for t in self.threads:
            t.start()

    def _one(self, url: str, max_tokens: int) -> None:
        text = ""
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body(max_tokens),
                              timeout=CLIENT_TIMEOUT_S) as r:  # fmt: skip
                lines = r.iter_lines()
                for line in lines:
                    text += line + "\n"
                    if line.startswith("data:"):
                        break
                self.started.release()
                for line in lines:
                    text += line + "\n"
            self.results.append((r.status_code, text))
        except httpx.HTTPError as e:
            self.started.release()
            self.results.append((0, repr(e)))

    def wait_started(self, count: int | None = None, timeout: float = CLIENT_TIMEOUT_S) -> None:
        for _ in range(len(self.threads) if count is None else count):
            assert self.started.acquire(timeout=timeout)

    def join(self, timeout: float = CLIENT_TIMEOUT_S) -> list[tuple[int, str]]:
        for t in self.threads:
            t.join(timeout)
        return self.results


def completed(text: str) -> bool:
    compact = text.replace(" ", "")
    return '"error"' not in compact and '"finish_reason":"length"' in compact


def test_a_refusal_before_the_first_token_is_retried_on_another_decode(stack):
    """D1 refuses every request before its first token; as a stream's head is held until
    then, the refusal is an HTTP 503 and the router retries the request on D0."""
    retries = _metric(stack.router.url, "smg_worker_retries_total")
    results = []
    for _ in range(8):  # one at a time: round robin then alternates D0, D1 deterministically
        results += Streams(stack.router.url, 1, 8).join()
    assert len(results) == 8 and all(s == 200 and completed(t) for s, t in results), results
    assert _metric(stack.router.url, "smg_worker_retries_total") >= retries + 3  # round robin
    refused = _metric(stack.d1.url, "sglang:num_aborted_requests_total")
    assert refused >= 3
    stack.prefill.idle_pool(30)
    stack.d0.idle_pool(30)


def test_waiting_for_a_decode_row_is_not_a_handoff_timeout(stack):
    """Two long streams hold D0's running slots; 8 more take its 6 other rows and wait, the
    last 2 for a row. The blockers are closed only after the bootstrap timeout (4 s here) has
    passed twice over, so the wait outlasts it on any machine. That wait is queueing: decode
    runs no deadline on it and keeps prefill from timing the rooms out, so every stream
    completes."""
    bootstrap_timeout = float(ENV["SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"])
    release = threading.Event()
    blocking = threading.Semaphore(0)

    def blocker() -> None:
        with httpx.stream("POST", stack.router.url + "/v1/completions", json=body(4000),
                          timeout=CLIENT_TIMEOUT_S) as r:  # fmt: skip
            for line in r.iter_lines():
                if line.startswith("data:"):
                    blocking.release()
                    release.wait(CLIENT_TIMEOUT_S)
                    return  # closing the stream aborts it and frees its row

    blockers = [threading.Thread(target=blocker) for _ in range(2)]
    for t in blockers:
        t.start()
    for _ in blockers:
        assert blocking.acquire(timeout=CLIENT_TIMEOUT_S)
    streams = Streams(stack.router.url, 8, 24)
    t0 = time.monotonic()
    time.sleep(2 * bootstrap_timeout)  # the timeout under test, outlasted twice over
    release.set()
    for t in blockers:
        t.join(CLIENT_TIMEOUT_S)
    streams.wait_started(8)
    slowest_start = time.monotonic() - t0
    results = streams.join()
    print(f"row wait: the last stream started after {slowest_start:.1f} s")
    assert slowest_start > bootstrap_timeout + 1, slowest_start
    assert len(results) == 8 and all(s == 200 and completed(t) for s, t in results), results
    stack.prefill.idle_pool(30)
    stack.d0.idle_pool(30)


def test_kill_decode_mid_stream_marks_it_down_then_it_rejoins(stack, monkeypatch):
    streams = Streams(stack.router.url, 4, 400)
    streams.wait_started(2)  # 2 run, 2 wait on D0 for a running slot
    os.kill(stack.d0.proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(lambda: not stack.healthy(stack.d0.url), 10, 0.02)
    down_after = time.monotonic() - killed_at
    results = streams.join()
    ended_after = time.monotonic() - killed_at
    # with D0 out, the only decode left refuses: a clean 503 at once
    t0 = time.monotonic()
    r = httpx.post(stack.router.url + "/v1/completions", json=body(4, False), timeout=60)
    refused_in = time.monotonic() - t0
    stack.d0.proc.wait()
    stack.restart("d0", monkeypatch)  # first, so that a failure below leaves the stack whole
    print(f"decode killed: out of rotation after {down_after:.2f} s")
    assert down_after < MARK_DOWN_S, down_after
    # ended, none hung: those that had begun with an error event, the others with a 503
    started = [t for s, t in results if s == 200 and '"error"' in t]
    assert len(started) >= 2 and all(s in (200, 503) for s, _ in results), results
    assert ended_after < 30, ended_after
    assert r.status_code == 503 and r.headers.get("retry-after"), r.text
    assert refused_in < 10, refused_in
    wait_until(lambda: stack.healthy(stack.d0.url), 30, 0.2)  # active probes bring it back
    results = Streams(stack.router.url, 4, 8).join()
    assert all(s == 200 and completed(t) for s, t in results), results
    stack.prefill.idle_pool(30)
    stack.d0.idle_pool(30)


def test_kill_prefill_spares_requests_whose_kv_arrived(stack, monkeypatch):
    """Streams past their first token have all their KV on decode: prefill's death must not
    fail them. The router sees the death at the next request and /readiness turns 503."""

    def handed_over() -> float:  # prefill's 1-token answers
        url = stack.prefill.url
        done = _metric(url, "sglang:num_requests_total")
        return done - _metric(url, "sglang:num_aborted_requests_total")

    shipped = handed_over()
    streams = Streams(stack.router.url, 6, 60)
    # every KV handed over: 2 requests run on D0, 4 wait there for a running slot
    wait_until(lambda: handed_over() >= shipped + 6, 60)
    streams.wait_started(2)
    os.kill(stack.prefill.proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    r = httpx.post(stack.router.url + "/v1/completions", json=body(4, False), timeout=60)
    assert r.status_code == 503, r.text

    def not_ready() -> bool:
        return httpx.get(stack.router.url + "/readiness", timeout=5).status_code == 503

    wait_until(not_ready, 10)
    not_ready_after = time.monotonic() - killed_at
    results = streams.join()
    stack.prefill.proc.wait()
    stack.restart("prefill", monkeypatch)  # first, so that a failure below leaves the stack whole
    print(f"prefill killed: /readiness 503 after {not_ready_after:.2f} s")
    assert not_ready_after < MARK_DOWN_S + 1, not_ready_after
    assert len(results) == 6 and all(s == 200 and completed(t) for s, t in results), results
    wait_until(lambda: not not_ready(), 30, 0.2)
    results = Streams(stack.router.url, 4, 8).join()
    assert all(s == 200 and completed(t) for s, t in results), results
    stack.prefill.idle_pool(30)
    stack.d0.idle_pool(30)


def test_disconnect_storm_leaves_the_pools_idle(stack):
    """60 clients that leave at once, some before their first token, some after."""
    import socket

    payload = (b'{"prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 300, "ignore_eos": true,'
               b' "stream": true}')  # fmt: skip
    request = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n%s" % (len(payload), payload))  # fmt: skip
    socks = []
    for i in range(60):
        s = socket.create_connection(("127.0.0.1", stack.router.port), timeout=30)
        s.sendall(request)
        socks.append(s)
        if i % 2:
            time.sleep(0.02)  # the workload: connections arrive over a moment, not at once
    time.sleep(1.0)  # the workload: by now some streams have their first token, some not
    for s in socks:
        s.close()
    stack.prefill.idle_pool(60)
    stack.d0.idle_pool(60)
    results = Streams(stack.router.url, 2, 8).join()
    assert all(s == 200 and completed(t) for s, t in results), results


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def soak(stack, seconds: float, clients: int = 6) -> dict:
    """Clients streaming through the router for `seconds`, some leaving early; returns counts
    and each process's RSS/descriptor figures before and after."""
    procs = {"router": stack.router.proc.pid, "prefill": stack.prefill.proc.pid,
             "decode": stack.d0.proc.pid}  # fmt: skip
    pids = {name: [pid, *Server.children_of(pid)] for name, pid in procs.items()}

    def snapshot() -> dict:
        return {n: (sum(_rss_mib(p) for p in ps), sum(_fds(p) for p in ps))
                for n, ps in pids.items()}  # fmt: skip

    fd_counts: list[dict] = []

    def fds_steady() -> bool:
        """The same descriptor counts over the last three looks (half a second)."""
        fd_counts.append({n: sum(_fds(p) for p in ps) for n, ps in pids.items()})
        return len(fd_counts) >= 3 and fd_counts[-1] == fd_counts[-2] == fd_counts[-3]

    before = snapshot()
    end = time.monotonic() + seconds
    counts = {"completed": 0, "left_early": 0, "failed": 0}
    lock = threading.Lock()

    def client(i: int) -> None:
        n = 0
        while time.monotonic() < end:
            n += 1
            leave = (n + i) % 5 == 0
            outcome = "failed"
            try:
                with httpx.stream("POST", stack.router.url + "/v1/completions",
                                  json=body(24), timeout=60) as r:  # fmt: skip
                    text = ""
                    for line in r.iter_lines():
                        text += line
                        if leave and line.startswith("data:"):
                            break
                    if leave:
                        outcome = "left_early"
                    elif r.status_code == 200 and completed(text):
                        outcome = "completed"
            except httpx.HTTPError:
                pass
            with lock:
                counts[outcome] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 120)
    stack.prefill.idle_pool(60)
    stack.d0.idle_pool(60)
    # the clients' closed keep-alive connections leave the descriptor tables a moment later
    wait_until(fds_steady, 30, 0.25, lambda: f"descriptor counts still moving: {fd_counts[-3:]}")
    return {"counts": counts, "before": before, "after": snapshot()}


def test_short_soak_leaks_neither_memory_nor_descriptors(stack):
    soak(stack, 15)  # warm-up: allocator arenas, connection pools, code paths
    figures = soak(stack, float(os.environ.get("PDSERVE_SOAK_S", "60")))
    print("soak:", figures)
    counts = figures["counts"]
    assert counts["failed"] == 0 and counts["completed"] > 5, counts
    for name, (rss, fds) in figures["after"].items():
        rss0, fds0 = figures["before"][name]
        assert rss - rss0 < 64, (name, rss0, rss)  # MiB
        assert fds - fds0 <= 8, (name, fds0, fds)

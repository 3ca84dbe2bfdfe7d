"""Reliability and security of a real PD stack under hostile input and overload (issue 17).

One prefill, one decode (4 running requests, 4 extra rows, at most 8 waiting) and our router,
all with an API key, on loopback; KV over Mooncake. Everything goes over real HTTP, ZMQ and
Mooncake; nothing on the request path is mocked.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.pd_pair import FAST_TIMEOUTS
from tests.router_proc import RouterProc
from tests.server_proc import Server, free_port

KEY = "test-key-i17"
AUTH = {"authorization": f"Bearer {KEY}"}
MC_PORTS = (21000, 21999)  # Mooncake's listening ports are pinned here (docs/DEPLOY.md)
ENV = {
    **FAST_TIMEOUTS,
    "SGLANG_API_KEY": KEY,
    "MC_MIN_RPC_PORT": str(MC_PORTS[0]),
    "MC_MAX_RPC_PORT": str(MC_PORTS[1]),
}
# The body read timeout every process of the stack gets. Not 1 s: the overload test's 200 client
# threads on 2 cores once sent a body more than 1 s after its headers and got the 408 it asks for.
BODY_TIMEOUT_S = 4
GUARD_FLAGS = ("--body-read-timeout-secs", str(BODY_TIMEOUT_S), "--max-payload-size", str(24 << 20))
PROMPT = list(range(5, 37))


class Stack:
    def __init__(self, model: Path, logs: Path) -> None:
        self.bootstrap_port = free_port()
        self.prefill = Server(model, "--disaggregation-mode", "prefill",
                              "--disaggregation-bootstrap-port", str(self.bootstrap_port),
                              *GUARD_FLAGS, log_dir=logs, env=ENV)  # fmt: skip
        try:
            self.decode = Server(model, "--disaggregation-mode", "decode",
                                 "--max-running-requests", "4",
                                 "--disaggregation-decode-extra-slots", "4",
                                 "--max-queued-requests", "8", *GUARD_FLAGS,
                                 log_dir=logs, env=ENV)  # fmt: skip
            self.router = RouterProc(
                "--pd-disaggregation", "--prefill", self.prefill.url, str(self.bootstrap_port),
                "--decode", self.decode.url, "--health-check-interval-secs", "0.5",
                "--health-success-threshold", "1", "--body-read-timeout-secs", str(BODY_TIMEOUT_S),
                log_dir=logs, env={"SGLANG_API_KEY": KEY},
            )  # fmt: skip
            self.router.wait_ready()
        except Exception:
            self.stop()
            raise

    def stop(self) -> None:
        for name in ("router", "decode", "prefill"):
            if hasattr(self, name):
                getattr(self, name).stop()

    def idle(self) -> None:
        self.prefill.idle_pool(30)
        self.decode.idle_pool(30)


@pytest.fixture(scope="module")
def stack(tiny_ckpt, tmp_path_factory):
    s = Stack(tiny_ckpt, tmp_path_factory.mktemp("reliability"))
    yield s
    s.stop()


def completion(url: str, max_tokens: int = 8, stream: bool = False, **extra) -> dict:
    return {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream, **extra}  # fmt: skip


# ---- what listens where ----
def _descendants(pid: int) -> list[int]:
    out = [pid]
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        out += _descendants(int(child))
    return out


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of each TCP socket `pid` listens on, as `ss -ltnp` would list them."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hex_ip, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_ip)
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # host order
            found.append((socket.inet_ntop(family, raw), int(hex_port, 16)))
    return found


def mooncake_handshake_ports(server: Server) -> list[int]:
    """The handshake RPC port of each Mooncake engine `server` started (its session's port)."""
    log = server.log_path.read_text()
    return [int(port) for port in re.findall(r"Mooncake engine up: session \S+:(\d+),", log)]


def test_only_configured_addresses_listen(stack):
    """Every socket listens on 127.0.0.1 (--host, the advertised address), except the two that
    Mooncake opens per engine and no setting binds (workers/transfer_engine.py): its handshake
    RPC on 0.0.0.0 at the session's port and its TCP data port on [::], both in the pinned MC
    port range (docs/DEPLOY.md has the firewall rule)."""
    for proc, expected, server in ((stack.prefill.proc, {stack.prefill.port, stack.bootstrap_port},
                                    stack.prefill),
                                   (stack.decode.proc, {stack.decode.port}, stack.decode),
                                   (stack.router.proc, {stack.router.port}, None)):  # fmt: skip
        sockets = [s for pid in _descendants(proc.pid) for s in listening(pid)]
        loopback = {port for ip, port in sockets if ip == "127.0.0.1"}
        elsewhere = sorted((ip, port) for ip, port in sockets if ip != "127.0.0.1")
        assert expected <= loopback, sockets
        if server is None:
            assert elsewhere == [], sockets
            continue
        handshake = mooncake_handshake_ports(server)
        data = [(ip, port) for ip, port in elsewhere if ip == "::"]
        assert len(handshake) == 1 and len(data) == 1, sockets
        assert elsewhere == sorted([("0.0.0.0", handshake[0]), *data]), sockets
        assert all(MC_PORTS[0] <= port <= MC_PORTS[1] for _, port in elsewhere), sockets


def test_mc_tcp_bind_address_binds_nothing():
    """Pins the hazard in workers/transfer_engine.py: under P2PHANDSHAKE, Mooncake listens on
    0.0.0.0 (handshake, the session's port) and [::] (data) with MC_TCP_BIND_ADDRESS set to the
    engine's host. If this fails, Mooncake binds the address now: set it from the advertised
    host there and narrow test_only_configured_addresses_listen."""
    pytest.importorskip("mooncake.engine")
    engine = ("import sys; from mooncake.engine import TransferEngine; e = TransferEngine(); "
              "rc = e.initialize('127.0.0.1', 'P2PHANDSHAKE', 'tcp', ''); "
              "print(rc, e.get_rpc_port(), flush=True); sys.stdin.read()")  # fmt: skip
    env = {**os.environ, **ENV, "MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LOG_LEVEL": "ERROR"}
    proc = subprocess.Popen([sys.executable, "-c", engine], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env, text=True)  # fmt: skip
    try:
        rc, port = map(int, proc.stdout.readline().split())
        sockets = sorted(listening(proc.pid))
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    assert rc == 0
    assert len(sockets) == 2 and ("0.0.0.0", port) in sockets, sockets
    assert [ip for ip, _ in sockets] == ["0.0.0.0", "::"], sockets


# ---- API key ----
def test_every_route_but_health_and_metrics_needs_the_key(stack):
    bad = {"authorization": "Bearer wrong"}
    for url in (stack.prefill.url, stack.decode.url, stack.router.url):
        for headers in ({}, bad):
            for method, path, body in (("POST", "/v1/completions", completion(url)),
                                       ("POST", "/generate", {"input_ids": PROMPT}),
                                       ("GET", "/v1/models", None),
                                       ("GET", "/server_info", None)):  # fmt: skip
                r = httpx.request(method, url + path, json=body, headers=headers, timeout=10)
                assert r.status_code == 401, (url, path, r.text)
                assert r.json()["error"]["type"] == "AuthenticationError"
        for path in ("/health", "/metrics"):
            assert httpx.get(url + path, timeout=10).status_code == 200
    for worker in (stack.prefill, stack.decode):  # the admin route
        r = httpx.post(worker.url + "/abort_request", json={"abort_all": True}, timeout=10)
        assert r.status_code == 401
    info = httpx.get(stack.prefill.url + "/server_info", headers=AUTH, timeout=10).json()
    assert KEY not in json.dumps(info)
    r = httpx.post(stack.router.url + "/v1/completions", json=completion(""), headers=AUTH,
                   timeout=60)  # fmt: skip
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


def test_bootstrap_server_needs_the_key_and_validates_registrations(stack):
    base = f"http://127.0.0.1:{stack.bootstrap_port}"
    query = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
    assert httpx.get(base + "/health", timeout=5).status_code == 200
    assert httpx.get(base + query, timeout=5).status_code == 401
    good = {"rank_ip": "10.9.9.9", "rank_port": 9, "page_size": 16}
    assert httpx.put(base + "/route", json=good, timeout=5).status_code == 401
    for bad in ({"rank_ip": "x y;z", "rank_port": 1}, {"rank_ip": "10.0.0.1", "rank_port": 0},
                {"rank_ip": "10.0.0.1", "rank_port": 5, "tp_rank": -3}, [1, 2],
                {"rank_ip": "10.0.0.1", "rank_port": 5, "layout": "x"}):  # fmt: skip
        r = httpx.put(base + "/route", json=bad, headers=AUTH, timeout=5)
        assert r.status_code == 400, (bad, r.text)
    cluster = httpx.get(base + query, headers=AUTH, timeout=5)
    assert cluster.status_code == 200 and cluster.json()["page_size"] == 16  # unchanged


# ---- hostile input ----
def test_input_bounds(stack):
    targets = (stack.router.url, stack.decode.url)
    for url in targets:
        for body, field in ((completion(url, n=129), "n"), (completion(url, max_tokens=0),
                            "max_tokens")):  # fmt: skip
            r = httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=30)
            assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
        deep = b'{"prompt": "x", "extra": ' + b"[" * 5000 + b"]" * 5000 + b"}"
        json_type = {**AUTH, "content-type": "application/json"}
        r = httpx.post(url + "/v1/completions", content=deep, headers=json_type, timeout=30)
        assert r.status_code == 400 and "nested" in r.json()["error"]["message"], r.text
        plain = json.dumps(completion(url)).encode()
        r = httpx.post(url + "/v1/completions", content=plain,
                       headers={**AUTH, "content-type": "text/plain"}, timeout=30)  # fmt: skip
        assert r.status_code == 415, r.text
    # the content types the workers take, the router takes too
    for ctype in ("application/json; charset=utf-8", "application/vnd.x+json"):
        r = httpx.post(stack.router.url + "/v1/completions", json=None,
                       content=json.dumps(completion("")).encode(),
                       headers={**AUTH, "content-type": ctype}, timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
    stack.idle()


@pytest.mark.parametrize("target", ["router", "decode"])
def test_a_stalled_body_gets_408_within_the_read_timeout(stack, target):
    port = getattr(stack, target).port
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        t0 = time.monotonic()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"authorization: Bearer " + KEY.encode() + b"\r\ncontent-length: 1000\r\n\r\n"
                  b'{"prompt":')  # fmt: skip
        reply = s.recv(65536)
        waited = time.monotonic() - t0
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert BODY_TIMEOUT_S - 0.1 < waited < BODY_TIMEOUT_S + 9, waited  # before: held for minutes


def test_a_reused_rid_is_409_and_not_retried(stack):
    first = {**completion("", max_tokens=400, stream=True), "rid": "same-rid"}
    retries_before = _metric(stack.router.url, "smg_worker_retries_total")
    with httpx.stream("POST", stack.router.url + "/v1/completions", json=first, headers=AUTH,
                      timeout=60) as r1:  # fmt: skip
        assert r1.status_code == 200
        # keep the line iterator: a dropped one closes the stream, which aborts the request
        lines = r1.iter_lines()
        next(lines)  # the first token is out: the rid is live on decode
        stack.prefill.idle_pool(timeout=30)  # ...and no longer on prefill (its part is done)
        second = {**completion(""), "rid": "same-rid"}
        r2 = httpx.post(stack.router.url + "/v1/completions", json=second, headers=AUTH,
                        timeout=60)  # fmt: skip
        del lines
    assert r2.status_code == 409 and "rid" in r2.json()["error"]["message"], r2.text
    assert _metric(stack.router.url, "smg_worker_retries_total") == retries_before
    stack.idle()


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name)]
    return sum(values)


# ---- one request must not stall a worker ----
def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_20mb_request_does_not_stall_the_worker(stack):
    """Sent to prefill directly while a normal stream runs through the router: /health and the
    bootstrap server keep answering, the big one is refused fast, the normal one finishes, and
    the front's memory stays where it was."""
    worker = stack.prefill
    rss_before = _rss_kib(worker.proc.pid)
    gaps: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                c.get(worker.url + "/health").raise_for_status()
                c.get(f"http://127.0.0.1:{stack.bootstrap_port}/health").raise_for_status()
                gaps.append(time.monotonic() - t0)
                time.sleep(0.05)

    normal: dict = {}

    def run_normal() -> None:
        body = completion("", max_tokens=64, stream=True)
        with httpx.stream("POST", stack.router.url + "/v1/completions", json=body,
                          headers=AUTH, timeout=120) as r:  # fmt: skip
            normal["status"] = r.status_code
            normal["text"] = r.read().decode()

    threads = [threading.Thread(target=probe), threading.Thread(target=run_normal)]
    for t in threads:
        t.start()
    big = {"messages": [{"role": "user", "content": "word " * (4 << 20)}], "max_tokens": 4}
    under_bound = {"prompt": "word " * 80_000, "max_tokens": 4}  # tokenised, then too long
    refused = []
    for body in (big, under_bound, big):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        t0 = time.monotonic()
        r = httpx.post(worker.url + path, json=body, headers=AUTH, timeout=120)
        refused.append((r.status_code, time.monotonic() - t0, r.json()["error"]["message"]))
    threads[1].join(timeout=120)
    stop.set()
    threads[0].join(timeout=30)
    assert all(status == 400 for status, _, _ in refused), refused
    # the chat is refused on its content's length before the template renders it; the prompt
    # under that bound is tokenised, then refused on its token count
    assert "the messages' content: " in refused[0][2] and "characters" in refused[0][2], refused
    assert "characters" not in refused[1][2], refused
    assert max(t for _, t, _ in refused) < 20, refused  # before: 30-50 s of tokenising
    assert normal["status"] == 200, normal
    assert '"finish_reason":"length"' in normal["text"].replace(" ", ""), normal
    # the health probes never went silent (before: 30-50 s); the bound leaves room for a loaded
    # 2-core machine, where one probe was seen to take 3.5 s
    assert gaps and max(gaps) < 10.0, max(gaps)
    rss_after = _rss_kib(worker.proc.pid)
    print(f"big requests: refused in {[round(t, 2) for _, t, _ in refused]} s; /health + "
          f"bootstrap probes: {len(gaps)}, slowest {max(gaps):.2f} s; front RSS "
          f"{rss_before / 1024:.0f} -> {rss_after / 1024:.0f} MiB")  # fmt: skip
    assert rss_after - rss_before < 300 * 1024, (rss_before, rss_after)  # before: +2.6 GB
    for port in (worker.port, stack.router.port):  # over --max-payload-size: 413 unread
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer "
                      + KEY.encode() + b"\r\ncontent-length: %d\r\n\r\n" % (40 << 20))  # fmt: skip
            assert s.recv(65536).startswith(b"HTTP/1.1 413")
    stack.idle()


# ---- back-pressure ----
def test_overload_is_served_or_refused_fast_never_failed_late(stack):
    """200 concurrent streams against 4 running rows + 4 extra + 8 waiting: each one completes,
    or is refused (503 + Retry-After) within seconds; none fails after it started; the
    decode queue is visible in /metrics; the pools are idle after."""
    n = 200
    results: list[tuple[int, float, str, str | None]] = []
    lock = threading.Lock()
    queued_seen: list[float] = []
    done = threading.Event()

    def client(i: int) -> None:
        body = completion("", max_tokens=16, stream=True)
        t0 = time.monotonic()
        try:
            with httpx.stream("POST", stack.router.url + "/v1/completions", json=body,
                              headers=AUTH, timeout=180) as r:  # fmt: skip
                text = r.read().decode()
                result = (r.status_code, time.monotonic() - t0, text, r.headers.get("retry-after"))
        except httpx.HTTPError as e:
            result = (0, time.monotonic() - t0, repr(e), None)
        with lock:
            results.append(result)

    def watch_queue() -> None:
        while not done.is_set():
            queued_seen.append(_metric(stack.decode.url, "sglang:num_queue_reqs"))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch_queue)
    watcher.start()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    done.set()
    watcher.join(timeout=30)
    assert len(results) == n
    served = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] in (429, 503)]
    assert len(served) + len(refused) == n, [r[:3] for r in results if r not in served + refused]
    for _, _, text, _ in served:
        compact = text.replace(" ", "")
        assert '"error"' not in compact and compact.count('"finish_reason":"length"') == 1, text
    for status, elapsed, text, retry_after in refused:
        assert retry_after is not None and elapsed < 10, (status, elapsed, text)
        assert "(after 1 attempt)" in text  # the only decode refused: no retry storm
    assert served and refused
    print(f"overload: {len(served)} served (slowest {max(r[1] for r in served):.1f} s), "
          f"{len(refused)} refused (slowest {max(r[1] for r in refused):.1f} s), "
          f"decode queue up to {max(queued_seen):.0f}")  # fmt: skip
    assert max(queued_seen) > 0 and max(queued_seen) <= 8 + 8, max(queued_seen)
    stack.idle()

"""The router's own cost: ours beside sglang-router, both in PD mode over the same stub workers.

    python -m bench.router_overhead [--rounds 3] [--duration 4] [--concurrency 32] [--json out.json]

Stub workers (tests/stub_worker.py, one subprocess: a prefill and a decode) answer at once, so
what is measured is the router. Each round starts each router in turn (the order alternates
between rounds), with the same flags (`--pd-disaggregation --prefill URL 8998 --decode URL
--policy round_robin`; sglang-router also gets --disable-circuit-breaker, which ours does not
have; both keep retries on), and measures against it:
  - time to first byte (TTFB), one request at a time, non-streaming and streaming chat requests;
    the same against the decode stub directly gives the router's added latency (p50, p99);
  - throughput: `--concurrency` keep-alive connections sending back to back for `--duration` s.
Medians over the rounds are reported. Once per run it also measures the CPU one upstream request
costs a process with router/upstream.py and with httpx (the reason for the former). The load
generator is a raw protocol on httptools in this process; every process shares the machine's
cores, as they would on one host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httptools

BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


def _request(port: int, stream: bool) -> bytes:
    body = json.dumps({**BODY, "stream": stream}).encode()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n" % port
    return head + b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )


class _Client(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[int] | None = None
        self.first = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if not self.first:
            self.first = time.perf_counter()
        self.parser.feed_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("connection lost"))

    def on_message_complete(self) -> None:
        self.done.set_result(self.parser.get_status_code())  # type: ignore[union-attr]

    async def send(self, request: bytes) -> tuple[int, float]:
        """(status, seconds to the first response byte)."""
        self.done = asyncio.get_running_loop().create_future()
        self.first = 0.0
        t0 = time.perf_counter()
        self.transport.write(request)  # type: ignore[union-attr]
        status = await self.done
        return status, self.first - t0


async def _connect(port: int) -> _Client:
    _, client = await asyncio.get_running_loop().create_connection(_Client, "127.0.0.1", port)
    return client


async def latency(port: int, stream: bool, n: int) -> list[float]:
    client = await _connect(port)
    request = _request(port, stream)
    out = []
    for _ in range(n):
        status, ttfb = await client.send(request)
        assert status == 200, f"status {status}"
        out.append(ttfb)
    client.transport.close()  # type: ignore[union-attr]
    return out


async def throughput(port: int, stream: bool, concurrency: int, duration: float) -> float:
    request = _request(port, stream)
    clients = [await _connect(port) for _ in range(concurrency)]
    done = 0
    stop = time.perf_counter() + duration

    async def loop(client: _Client) -> None:
        nonlocal done
        while time.perf_counter() < stop:
            status, _ = await client.send(request)
            assert status == 200, f"status {status}"
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(loop(c) for c in clients))
    elapsed = time.perf_counter() - t0
    for c in clients:
        c.transport.close()  # type: ignore[union-attr]
    return done / elapsed


async def upstream_cpu_us(port: int, n: int) -> dict[str, float]:
    """CPU time of this process per sequential POST to the stub: our Pool vs httpx."""
    import httpx

    from router.upstream import Pool

    body = json.dumps(BODY).encode()
    pool = Pool("127.0.0.1", port)
    client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None))
    url = f"http://127.0.0.1:{port}/v1/chat/completions"

    async def ours() -> None:
        resp = pool.request(b"POST", b"/v1/chat/completions", body, _JSON_HEADER, 30.0)
        await resp.read()

    async def theirs() -> None:
        (await client.post(url, content=body, headers={"content-type": "application/json"})).read()

    out = {}
    for name, call in (("router/upstream.py", ours), ("httpx", theirs)):
        for _ in range(200):
            await call()
        t0 = time.process_time()
        for _ in range(n):
            await call()
        out[name] = (time.process_time() - t0) / n * 1e6
    pool.close()
    await client.aclose()
    return out


_JSON_HEADER = b"content-type: application/json\r\n"


@dataclass
class Run:
    name: str
    command: list[str]
    port: int
    results: list[dict[str, float]] = field(default_factory=list)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _routers(prefill: str, decode: str) -> list[Run]:
    common = ["--pd-disaggregation", "--prefill", prefill, "8998", "--decode", decode,
              "--policy", "round_robin", "--host", "127.0.0.1", "--log-level", "warn"]  # fmt: skip
    ours_port, theirs_port = _free_port(), _free_port()
    runs = [Run("ours", [sys.executable, "-m", "router.launch_router", *common,
                         "--port", str(ours_port)], ours_port)]  # fmt: skip
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        print("sglang-router is not installed: measuring ours only", file=sys.stderr)
        return runs
    runs.append(
        Run("sglang-router", [sys.executable, "-m", "sglang_router.launch_router", *common,
                              "--port", str(theirs_port), "--disable-circuit-breaker",
                              "--prometheus-host", "127.0.0.1",
                              "--prometheus-port", str(_free_port())], theirs_port)
    )  # fmt: skip
    return runs


async def _wait_serving(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    request = _request(port, False)
    while True:
        try:
            client = await _connect(port)
            status, _ = await client.send(request)
            client.transport.close()  # type: ignore[union-attr]
            if status == 200:
                return
        except (OSError, ConnectionError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"router on :{port} did not serve within {timeout:g} s")
        await asyncio.sleep(0.1)


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def measure(port: int, args: argparse.Namespace) -> dict[str, float]:
    out = {}
    await throughput(port, False, args.concurrency, 0.5)  # warm-up: connections, caches
    for stream in (False, True):
        kind = "stream" if stream else "json"
        ttfb = await latency(port, stream, args.latency_requests)
        out[f"{kind}_p50_ms"] = _percentile(ttfb, 0.5) * 1e3
        out[f"{kind}_p99_ms"] = _percentile(ttfb, 0.99) * 1e3
        out[f"{kind}_rps"] = await throughput(port, stream, args.concurrency, args.duration)
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    prefill_port, decode_port = _free_port(), _free_port()
    stubs = subprocess.Popen(
        [sys.executable, "-m", "tests.stub_worker", "--port", str(prefill_port),
         "--port", str(decode_port)], stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    stubs.stdout.readline()  # type: ignore[union-attr]  # "stub workers ready: ..."
    runs = _routers(f"http://127.0.0.1:{prefill_port}", f"http://127.0.0.1:{decode_port}")
    direct = Run("direct to the decode stub", [], decode_port)
    try:
        cpu = await upstream_cpu_us(decode_port, args.latency_requests)
        for r in range(args.rounds):
            direct.results.append(await measure(decode_port, args))
            for run in runs if r % 2 == 0 else runs[::-1]:
                proc = subprocess.Popen(run.command, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)  # fmt: skip
                try:
                    await _wait_serving(run.port)
                    run.results.append(await measure(run.port, args))
                finally:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(30)
                print(f"round {r + 1}/{args.rounds} {run.name}: {run.results[-1]}", flush=True)
    finally:
        stubs.terminate()
        stubs.wait()
    print("\nCPU per upstream request (us, one at a time): "
          + ", ".join(f"{k} {v:.0f}" for k, v in cpu.items()))  # fmt: skip
    return {**report([direct, *runs], args), "upstream_cpu_us": cpu}


def report(runs: list[Run], args: argparse.Namespace) -> dict[str, Any]:
    med = {run.name: {k: statistics.median(r[k] for r in run.results) for k in run.results[0]}
           for run in runs}  # fmt: skip
    direct = med[runs[0].name]
    for run in runs[1:]:
        m = med[run.name]
        for kind in ("json", "stream"):
            for q in ("p50", "p99"):
                m[f"{kind}_added_{q}_ms"] = m[f"{kind}_{q}_ms"] - direct[f"{kind}_{q}_ms"]
    print(f"\nmedians of {args.rounds} rounds; {os.cpu_count()} CPUs; concurrency "
          f"{args.concurrency} for {args.duration:g} s; {args.latency_requests} sequential "
          "requests for latency\n")  # fmt: skip
    print("| | added TTFB p50 (ms) | added TTFB p99 (ms) | TTFB p50 (ms) | requests/s |")
    print("|---|---|---|---|---|")
    for run in runs:
        m = med[run.name]
        for kind in ("json", "stream"):
            added = (f"{m[f'{kind}_added_p50_ms']:.3f} | {m[f'{kind}_added_p99_ms']:.3f}"
                     if run is not runs[0] else "- | -")  # fmt: skip
            print(f"| {run.name}, {kind} | {added} | {m[f'{kind}_p50_ms']:.3f} | "
                  f"{m[f'{kind}_rps']:.0f} |")  # fmt: skip
    if len(runs) == 3:
        ours, theirs = med[runs[1].name], med[runs[2].name]
        for kind in ("json", "stream"):
            print(f"\n{kind}: throughput ours / sglang-router = "
                  f"{ours[f'{kind}_rps'] / theirs[f'{kind}_rps']:.2f}; added p50 ours "
                  f"{ours[f'{kind}_added_p50_ms']:.3f} ms vs {theirs[f'{kind}_added_p50_ms']:.3f}"
                  " ms", end="")  # fmt: skip
        print()
    return {"args": vars(args), "medians": med, "rounds": {r.name: r.results for r in runs}}


def _event_loop_runner():
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.router_overhead", description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=4.0, help="seconds per throughput run")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--latency-requests", type=int, default=2000)
    ap.add_argument("--json", help="write every round's numbers here")
    args = ap.parse_args(argv)
    result = _event_loop_runner()(main_async(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

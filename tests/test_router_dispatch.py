"""The router's mechanics over real HTTP: our router (in-process, on uvicorn) in front of stub
workers (tests/stub_worker.py: real local HTTP servers whose behaviour each test sets).

What the workers receive, the round-robin order, retries with fresh rooms, streams relayed
before prefill answers, failures on either side, health, queue limits, timeouts, bad input and
client disconnects.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import uvicorn

from router.app import RouterApp
from router.config import RouterConfig
from tests.server_proc import free_port
from tests.stub_worker import StubWorker
from tests.waiting import wait_until

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


class RouterThread:
    """Our router app on uvicorn, in a thread of this process (so tests can read its state)."""

    def __init__(self, *argv: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = RouterConfig.from_cli(
            ["--host", "127.0.0.1", "--port", str(self.port), "--health-check-interval-secs",
             "0.1", "--health-success-threshold", "1", "--log-level", "error", *argv]
        )  # fmt: skip
        self.app = RouterApp(config)
        uv = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, lifespan="on",
                            log_level="error", access_log=False)  # fmt: skip
        self.server = uvicorn.Server(uv)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "router did not start"
            time.sleep(0.01)

    def wait_healthy(self, n: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while sum(w.healthy for w in self.app.registry.workers) != n:
            assert time.monotonic() < deadline, self.app.state()
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def make():
    """make(stubs=n) -> list of StubWorker; make(router=argv) -> RouterThread. All stopped after."""
    made: list = []

    def factory(stubs: int = 0, router: list[str] | None = None):
        if router is not None:
            made.append(RouterThread(*router))
            return made[-1]
        out = [StubWorker(name=f"w{i}").start_in_thread() for i in range(stubs)]
        made.extend(out)
        return out

    yield factory
    for thing in reversed(made):
        thing.stop() if isinstance(thing, RouterThread) else thing.stop_thread()


def pd_router(make, prefill: list[StubWorker], decode: list[StubWorker], *extra: str):
    argv = ["--pd-disaggregation"]
    for i, p in enumerate(prefill):
        argv += ["--prefill", p.url, str(9000 + i)]
    for d in decode:
        argv += ["--decode", d.url]
    router = make(router=[*argv, *extra])
    router.wait_healthy(len(prefill) + len(decode))
    return router


def sse_events(response: httpx.Response) -> list[str]:
    return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


def test_same_body_with_bootstrap_goes_to_both_and_decode_answers(make):
    p, d = make(stubs=2)
    router = pd_router(make, [p], [d])
    r = httpx.post(router.url + "/v1/chat/completions", json=CHAT, headers={"x-request-id": "r1"})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion"
    assert r.headers["x-request-id"] == "r1"
    wait_until(lambda: len(p.generation_requests()) == 1)
    (ps,), (ds,) = p.generation_requests(), d.generation_requests()
    assert ps.body == ds.body  # byte-for-byte the same JSON
    assert ps.body["bootstrap_host"] == "127.0.0.1" and ps.body["bootstrap_port"] == 9000
    assert isinstance(ps.body["bootstrap_room"], int)
    assert {k: ps.body[k] for k in CHAT} == CHAT  # the client's fields, untouched
    assert ps.headers["x-request-id"] == ds.headers["x-request-id"] == "r1"


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/generate"])
@pytest.mark.parametrize("stream", [False, True])
def test_routes_streaming_and_not(make, route, stream):
    p, d = make(stubs=2)
    router = pd_router(make, [p], [d])
    body = {"model": "m", "prompt": "hi", "text": "hi", "messages": CHAT["messages"],
            "stream": stream}  # fmt: skip
    with httpx.stream("POST", router.url + route, json=body) as r:
        assert r.status_code == 200
        if stream:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(r)
            assert events[-1] == "[DONE]" and len(events) == d.behaviour.chunks + 2
        else:
            assert "choices" in json.loads(r.read()) or route == "/generate"
    wait_until(lambda: len(p.generation_requests()) == len(d.generation_requests()) == 1)


def test_batched_generate_gets_room_lists(make):
    p, d = make(stubs=2)
    router = pd_router(make, [p], [d])
    r = httpx.post(router.url + "/generate", json={"text": ["a", "b", "c"]})
    assert r.status_code == 200
    body = d.generation_requests()[0].body
    wait_until(lambda: p.generation_requests() and p.generation_requests()[0].body == body)
    assert body["bootstrap_host"] == ["127.0.0.1"] * 3 and body["bootstrap_port"] == [9000] * 3
    assert len(set(body["bootstrap_room"])) == 3


def test_round_robin_order_across_two_prefill_and_two_decode(make):
    p0, p1, d0, d1 = make(stubs=4)
    router = pd_router(make, [p0, p1], [d0, d1], "--policy", "round_robin")
    rooms = []
    for _ in range(8):
        assert httpx.post(router.url + "/v1/chat/completions", json=CHAT).status_code == 200
    wait_until(lambda: len(p0.generation_requests()) + len(p1.generation_requests()) == 8)
    seen = sorted((s for w in (p0, p1, d0, d1) for s in w.generation_requests()), key=_seq)
    prefill_order = [s.worker for s in seen if s.worker in ("w0", "w1")]
    decode_order = [s.worker for s in seen if s.worker in ("w2", "w3")]
    assert prefill_order == ["w0", "w1"] * 4
    assert decode_order == ["w2", "w3"] * 4
    for a, b in zip(p0.generation_requests() + p1.generation_requests(),
                    d0.generation_requests() + d1.generation_requests()):  # fmt: skip
        rooms.append(a.body["bootstrap_room"])
        assert a.body["bootstrap_room"] == b.body["bootstrap_room"]  # pairs: p0+d0, p1+d1
        assert a.body["bootstrap_port"] == (9000 if a.worker == "w0" else 9001)
    assert len(set(rooms)) == 8


def test_stream_is_relayed_before_prefill_answers(make):
    p, d = make(stubs=2)
    p.behaviour.delay_s = 6.0  # margins wide enough for a loaded 2-core machine
    d.behaviour.chunks, d.behaviour.chunk_delay_s = 4, 0.05
    router = pd_router(make, [p], [d])
    t0 = time.monotonic()
    with httpx.stream(
        "POST", router.url + "/v1/chat/completions", json={**CHAT, "stream": True}
    ) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert time.monotonic() - t0 < 4.0, "waited for prefill before relaying decode"
        rest = [line for line in lines if line.startswith("data: ")]
    assert json.loads(first[6:])["object"] == "chat.completion.chunk"
    assert rest[-1] == "data: [DONE]"
    assert time.monotonic() - t0 < 5.0  # the stream ended while prefill was still busy
    wait_until(lambda: router.app.registry.by_url[p.url].in_flight == 0)  # prefill answered...
    assert p.disconnects == 0  # ...as it was left to finish, not aborted


def test_5xx_is_retried_with_a_fresh_room(make):
    p, d = make(stubs=2)
    d.behaviour.fail_status, d.behaviour.fail_count = 500, 2
    router = pd_router(make, [p], [d])
    r = httpx.post(router.url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text
    rooms = [s.body["bootstrap_room"] for s in d.generation_requests()]
    assert len(rooms) == 3 == len(set(rooms))
    # prefill got the last attempt (earlier ones may have been aborted before they were sent)
    wait_until(lambda: rooms[-1] in [s.body["bootstrap_room"] for s in p.generation_requests()])
    assert {s.body["bootstrap_room"] for s in p.generation_requests()} <= set(rooms)
    metrics = httpx.get(router.url + "/metrics").text
    assert 'smg_worker_retries_total{endpoint="chat",worker_type="decode"} 2.0' in metrics
    assert 'smg_worker_retries_exhausted_total{endpoint="chat",worker_type="decode"} 0.0' in metrics


def test_gives_up_after_max_retries_with_one_clean_error(make):
    p, d = make(stubs=2)
    d.behaviour.fail_status = 503
    router = pd_router(make, [p], [d], "--retry-max-retries", "2")
    r = httpx.post(router.url + "/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["message"] == (
        f"decode worker {d.url}: answered 503: injected failure (after 3 attempts)"
    )
    assert len(d.generation_requests()) == 3


def test_prefill_failure_ends_decode_and_is_retried(make):
    p, d = make(stubs=2)
    p.behaviour.fail_status, p.behaviour.fail_count, p.behaviour.delay_s = 500, 1, 0.2
    d.behaviour.delay_s = 3.0  # still waiting (for the KV) when prefill fails
    router = pd_router(make, [p], [d])
    t0 = time.monotonic()
    r = httpx.post(router.url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 200
    assert len(d.generation_requests()) == 2
    # 0.2 s + 3 s when the first decode request is dropped at once, 6 s if it was waited for
    assert time.monotonic() - t0 < 5.0
    wait_until(lambda: d.disconnects == 1)


def test_worker_4xx_is_passed_through_and_the_other_side_aborted(make):
    p, d = make(stubs=2)
    p.behaviour.delay_s = 2.0
    d.behaviour.fail_status = 400
    router = pd_router(make, [p], [d])
    r = httpx.post(router.url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "injected failure", "type": "StubError", "code": 500}}
    assert len(d.generation_requests()) == 1  # not retried
    wait_until(lambda: p.disconnects == 1)  # prefill's request was cancelled


def test_no_retry_once_streaming_began(make):
    p, d = make(stubs=2)
    d.behaviour.chunks, d.behaviour.cut_after_chunks = 5, 2
    router = pd_router(make, [p], [d])
    with httpx.stream(
        "POST", router.url + "/v1/chat/completions", json={**CHAT, "stream": True}
    ) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert len(events) == 4 and events[-1] == "[DONE]"
    error = json.loads(events[2])["error"]
    assert error["message"].startswith(f"decode worker {d.url}: closed the connection")
    assert len(d.generation_requests()) == 1


def test_connect_error_retries_elsewhere_and_takes_the_worker_out(make):
    p, d0, d1 = make(stubs=3)
    router = pd_router(make, [p], [d0, d1], "--health-check-interval-secs", "30")
    d1.stop_thread()  # killed; the router has not probed since
    for _ in range(4):
        assert httpx.post(router.url + "/v1/chat/completions", json=CHAT).status_code == 200
    dead = router.app.registry.by_url[d1.url]
    assert not dead.healthy and "cannot connect" in dead.last_error
    assert len(d0.generation_requests()) == 4


def test_a_dead_prefill_is_taken_out_not_its_decode_partner(make):
    p0, p1, d = make(stubs=3)
    router = pd_router(make, [p0, p1], [d], "--health-check-interval-secs", "30")
    p1.stop_thread()
    for _ in range(4):
        assert httpx.post(router.url + "/generate", json={"text": "x"}).status_code == 200
    workers = router.app.registry.by_url
    assert not workers[p1.url].healthy and workers[p1.url].failures == 1
    assert workers[d.url].healthy and workers[d.url].failures == 0
    assert router.app.registry.by_url[d.url].in_flight == 0


def test_no_healthy_workers_is_503_at_once(make):
    router = make(router=["--pd-disaggregation", "--prefill", f"http://127.0.0.1:{free_port()}",
                          "--decode", f"http://127.0.0.1:{free_port()}"])  # fmt: skip
    t0 = time.monotonic()
    r = httpx.post(router.url + "/v1/chat/completions", json=CHAT)
    assert time.monotonic() - t0 < 2.0  # no connect retries or timeouts waited out
    assert r.status_code == 503
    assert r.json()["error"]["message"].startswith("no healthy prefill workers (1 configured, 0")
    assert httpx.get(router.url + "/readiness").status_code == 503
    assert httpx.get(router.url + "/health").status_code == 200


def test_router_started_first_admits_workers_when_they_come_up(make):
    ports = [free_port(), free_port()]
    router = make(router=["--pd-disaggregation", "--prefill", f"http://127.0.0.1:{ports[0]}",
                          "--decode", f"http://127.0.0.1:{ports[1]}"])  # fmt: skip
    assert httpx.post(router.url + "/generate", json={"text": "x"}).status_code == 503
    for port in ports:
        StubWorker(port).start_in_thread()  # stopped with the process (daemon threads)
    router.wait_healthy(2, timeout=5)
    assert httpx.post(router.url + "/generate", json={"text": "x"}).status_code == 200
    assert httpx.get(router.url + "/readiness").json()["status"] == "ready"


def test_unhealthy_worker_leaves_rotation_and_rejoins(make):
    p, d0, d1 = make(stubs=3)
    router = pd_router(make, [p], [d0, d1], "--health-failure-threshold", "2",
                       "--health-success-threshold", "2")  # fmt: skip
    d1.behaviour.health_status = 503
    worker = router.app.registry.by_url[d1.url]
    wait_until(lambda: not worker.healthy)
    before = len(d1.generation_requests())
    for _ in range(4):
        assert httpx.post(router.url + "/v1/completions", json={"prompt": "x"}).status_code == 200
    assert len(d1.generation_requests()) == before
    d1.behaviour.health_status = 200
    wait_until(lambda: worker.healthy)
    for _ in range(4):
        httpx.post(router.url + "/v1/completions", json={"prompt": "x"})
    assert len(d1.generation_requests()) == before + 2


def test_queue_bound_429_and_queue_timeout_408(make):
    p, d = make(stubs=2)
    # the queued request times out (2 s) long before the running one ends (5 s), and the third
    # arrives while the second still waits, however slowly a loaded machine runs this thread
    d.behaviour.delay_s = 5.0
    router = pd_router(make, [p], [d], "--max-concurrent-requests", "1", "--queue-size", "1",
                       "--queue-timeout-secs", "2")  # fmt: skip
    results = {}

    def call(name):
        results[name] = httpx.post(router.url + "/generate", json={"text": "x"}, timeout=30)

    running = threading.Thread(target=call, args=("running",))
    running.start()
    wait_until(lambda: router.app.admission.active == 1)
    queued = threading.Thread(target=call, args=("queued",))
    queued.start()
    wait_until(lambda: len(router.app.admission.waiting) == 1)
    call("rejected")
    queued.join()
    running.join()
    assert results["rejected"].status_code == 429
    assert results["queued"].status_code == 408
    assert results["running"].status_code == 200


def test_request_timeout_is_504(make):
    p, d = make(stubs=2)
    d.behaviour.delay_s = 3.0
    router = pd_router(make, [p], [d], "--request-timeout-secs", "0.3")
    r = httpx.post(router.url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 504
    assert "no complete answer within 0.3 s" in r.json()["error"]["message"]
    assert len(d.generation_requests()) == 1  # a timeout is not retried


def test_bad_input(make):
    p, d = make(stubs=2)
    router = pd_router(make, [p], [d], "--max-payload-size", "1000")
    post = lambda path, **kw: httpx.post(router.url + path, **kw)
    r = post("/v1/chat/completions", content=b'{"messages": [')
    assert r.status_code == 400 and "malformed JSON body" in r.json()["error"]["message"]
    assert post("/generate", content=b"[1, 2]").status_code == 400
    r = post("/generate", content=b'{"text": "\\ud800 caf\xc3\xa9"}')  # a lone surrogate
    assert r.status_code == 200
    sent = d.generation_requests()[-1].body["text"]
    assert sent == "\ud800 caf\u00e9"
    d.seen.clear()
    r = post("/v1/completions", json={"prompt": "x" * 2000})
    assert r.status_code == 413 and r.json()["error"]["type"] == "RequestTooLargeError"
    big = (b"x" * 600 for _ in range(3))  # chunked upload: no content-length to check first
    assert post("/generate", content=big).status_code == 413
    r = httpx.get(router.url + "/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"] == "no route GET /v2/nothing"
    assert httpx.get(router.url + "/generate").status_code == 405
    assert post("/health").status_code == 405
    wait_until(lambda: len(p.generation_requests()) == 1)
    assert d.generation_requests() == []


def test_client_disconnect_cancels_both_upstream_requests(make):
    p, d = make(stubs=2)
    p.behaviour.delay_s = 5.0
    d.behaviour.chunks, d.behaviour.chunk_delay_s = 50, 0.1
    router = pd_router(make, [p], [d])
    with httpx.stream(
        "POST", router.url + "/v1/chat/completions", json={**CHAT, "stream": True}
    ) as r:
        next(r.iter_lines())
    wait_until(lambda: p.disconnects == 1 and d.disconnects == 1)
    wait_until(lambda: all(w.in_flight == 0 for w in router.app.registry.workers))
    assert 'status_code="499"' in httpx.get(router.url + "/metrics").text


def test_info_routes_and_metrics(make):
    p, d = make(stubs=2)
    router = pd_router(make, [p], [d], "--model-path", "/models/x")
    httpx.post(router.url + "/v1/chat/completions", json=CHAT)
    assert httpx.get(router.url + "/v1/models").json()["data"][0]["id"] == "stub-model"
    assert httpx.get(router.url + "/model_info").json()["served_model_name"] == "stub-model"
    info = httpx.get(router.url + "/get_server_info").json()
    assert info["stub"] == "w0"  # the first prefill's, as sglang-router does
    assert [w["role"] for w in info["router"]["workers"]] == ["prefill", "decode"]
    assert httpx.get(router.url + "/health_generate").status_code == 200
    metrics = httpx.get(router.url + "/metrics").text
    assert f'router_worker_requests_total{{role="decode",worker="{d.url}"}} 1.0' in metrics
    # (labels print sorted)
    labels = 'backend_type="pd",connection_mode="http",endpoint="chat",model="default"'
    assert f'smg_router_requests_total{{{labels},router_type="http",streaming="false"}} 1.0' in (
        metrics
    )
    assert 'smg_http_requests_total{method="POST",path="/v1/chat/completions"} 1.0' in metrics
    assert 'smg_http_responses_total{error_code="",status_code="200"} 1.0' in metrics
    assert f'smg_router_request_duration_seconds_count{{{labels},router_type="http"}} 1.0' in (
        metrics
    )
    ttft = 'smg_router_ttft_seconds_count{backend_type="pd",endpoint="chat",model="default"'
    assert ttft + ',router_type="http"} 0.0' in metrics  # a JSON answer: no time to first token
    assert f'smg_worker_health{{worker="{d.url}"}} 1.0' in metrics
    assert 'smg_worker_pool_size{connection_mode="http",model="default",worker_type="decode"}' in (
        metrics
    )
    d.behaviour.health_status = p.behaviour.health_status = 503
    # Both roles must leave rotation: the two health loops run independently.
    wait_until(lambda: not any(router.app.registry.healthy.values()))
    assert httpx.get(router.url + "/v1/models").json()["data"][0]["id"] == "/models/x"
    assert httpx.get(router.url + "/model_info").status_code == 503


def test_plain_mode_passes_the_body_through(make):
    w0, w1 = make(stubs=2)
    router = make(router=["--worker-urls", w0.url, w1.url])
    router.wait_healthy(2)
    for _ in range(4):
        r = httpx.post(router.url + "/v1/completions", json={"prompt": "x", "stream": True})
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert len(w0.generation_requests()) == len(w1.generation_requests()) == 2
    assert "bootstrap_room" not in w0.generation_requests()[0].body
    r = httpx.post(router.url + "/v1/completions", content=b"{oops")
    assert r.status_code == 400 and r.json()["error"]["message"] == "malformed JSON body"


def _seq(seen) -> int:
    return seen.seq

"""Our router in plain mode (--worker-urls) in front of one real worker on the tiny checkpoint:
the official openai client through the router gets what it gets from the worker directly."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from tests import server_proc
from tests.router_proc import RouterProc
from tests.server_proc import Server, free_port
from tests.waiting import wait_until

CHAT = [{"role": "user", "content": "List three things to check when a service returns 503."}]


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("router-plain")


@pytest.fixture(scope="module")
def worker(tiny_ckpt, logs):
    srv = Server(tiny_ckpt, "--context-length", "256", log_dir=logs)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def router(worker, logs):
    proc = RouterProc("--worker-urls", worker.url, "--health-check-interval-secs", "0.2",
                      "--health-success-threshold", "1", "--prometheus-port", str(free_port()),
                      log_dir=logs)  # fmt: skip
    proc.wait_ready()
    yield proc
    assert proc.stop() == 0


def clients(worker, router) -> list[openai.OpenAI]:
    return [openai.OpenAI(base_url=u + "/v1", api_key="none") for u in (worker.url, router.url)]


def test_router_starts_in_well_under_a_second(router):
    # CPU seconds from exec to a 200 from /liveness (imports included; torch alone would take
    # more); wall-clock time would measure the machine's load instead.
    assert router.cpu_to_serve < 1.0


def test_openai_client_through_the_router_equals_direct(worker, router):
    direct, routed = clients(worker, router)
    model = direct.models.list().data[0].id
    assert routed.models.list().data[0].id == model
    kw = {"model": model, "messages": CHAT, "max_tokens": 8, "temperature": 0}
    a = direct.chat.completions.create(**kw).choices[0].message.content
    b = routed.chat.completions.create(**kw).choices[0].message.content
    assert a == b
    pieces = [
        c.choices[0].delta.content or ""
        for c in routed.chat.completions.create(**kw, stream=True)
        if c.choices
    ]
    assert "".join(pieces) == a
    kw = {"model": model, "prompt": "The router", "max_tokens": 6, "temperature": 0}
    assert (
        direct.completions.create(**kw).choices[0].text
        == routed.completions.create(**kw).choices[0].text
        == "".join(c.choices[0].text for c in routed.completions.create(**kw, stream=True))
    )


def test_generate_streaming_and_not(worker, router):
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 5, "temperature": 0,
                                                            "ignore_eos": True}}  # fmt: skip
    direct = httpx.post(worker.url + "/generate", json=body, timeout=60).json()
    routed = httpx.post(router.url + "/generate", json=body, timeout=60).json()
    assert routed["output_ids"] == direct["output_ids"]
    with httpx.stream("POST", router.url + "/generate", json={**body, "stream": True}) as r:
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["output_ids"][-5:] == direct["output_ids"]


def test_concurrent_requests(router):
    results = []

    def one(i: int) -> None:
        body = {"prompt": f"request {i}", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        results.append(httpx.post(router.url + "/v1/completions", json=body, timeout=60))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200] * 12
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in results)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", b"{not json"),
        ("/v1/chat/completions", {"messages": []}),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}),
        ("/v1/chat/completions", {"messages": CHAT, "model": "nope"}),
    ],
)
def test_worker_errors_pass_through_unchanged(worker, router, path, body):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    kw["headers"] = {"content-type": "application/json"}
    direct = httpx.post(worker.url + path, timeout=30, **kw)
    routed = httpx.post(router.url + path, timeout=30, **kw)
    assert direct.status_code >= 400
    assert (routed.status_code, routed.json()) == (direct.status_code, direct.json())


def test_router_level_errors(worker, router):
    r = httpx.get(router.url + "/v1/unknown")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    assert httpx.get(router.url + "/health_generate", timeout=60).status_code == 200
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        assert httpx.get(router.url + path).status_code == 200, path
    assert "smg_router_requests_total" in httpx.get(router.url + "/metrics").text
    port = router.proc.args[router.proc.args.index("--prometheus-port") + 1]
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    assert f'smg_worker_health{{worker="{worker.url}"}} 1.0' in metrics


def test_client_disconnect_aborts_the_workers_request(worker, router):
    body = {"input_ids": [3, 4, 5], "stream": True,
            "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}  # fmt: skip
    with httpx.stream("POST", router.url + "/generate", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break
    worker.idle_pool()  # the worker aborted it: no rows or pages held


def test_killed_worker_gives_clean_errors_then_rejoins(
    worker, router, tiny_ckpt, logs, monkeypatch
):
    """Runs last in this module: it replaces the worker process."""
    body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        worker.proc.kill()  # mid-stream
        events = [ln[6:] for ln in lines if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "closed the connection" in json.loads(events[-2])["error"]["message"]
    t0 = time.monotonic()
    r = httpx.post(router.url + "/v1/completions", json={"prompt": "x"}, timeout=30)
    assert r.status_code in (502, 503) and time.monotonic() - t0 < 5.0  # no timeout waited out
    assert r.json()["error"]["message"]
    worker.stop()
    monkeypatch.setattr(server_proc, "free_port", lambda: worker.port)  # restart on its port
    replacement = Server(tiny_ckpt, "--context-length", "256", log_dir=logs)
    try:
        wait_until(lambda: any(w["healthy"] for w in router.state()["workers"]), 30)
        r = httpx.post(router.url + "/v1/completions", json={"prompt": "x"}, timeout=30)
        assert r.status_code == 200
    finally:
        replacement.stop()

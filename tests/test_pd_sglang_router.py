"""Our prefill + decode pair driven by the real sglang-router (pip package, test-only peer)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from tests.pd_pair import PDPair
from tests.server_proc import Server, free_port

pytest.importorskip("sglang_router")
pytest.importorskip("mooncake.engine")


@pytest.fixture(scope="module")
def stack(tiny_ckpt, tmp_path_factory):
    logs = tmp_path_factory.mktemp("sglang_router")
    pd = PDPair(tiny_ckpt, logs)
    single = Server(tiny_ckpt, log_dir=logs)
    port = free_port()
    log = open(logs / "router.log", "w")
    router = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--pd-disaggregation",
            "--prefill-policy",
            "round_robin",
            "--decode-policy",
            "round_robin",
            "--prefill",
            pd.prefill.url,
            str(pd.bootstrap_port),
            "--decode",
            pd.decode.url,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--request-timeout-secs",
            "60",
            "--model-path",
            str(tiny_ckpt),
            "--prometheus-port",
            str(free_port()),
            "--prometheus-host",
            "127.0.0.1",
            "--health-check-interval-secs",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    body = {"messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    served = False
    while not served and time.monotonic() < deadline:
        try:
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=5)
            served = r.status_code == 200
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    try:
        if not served:
            pytest.fail("sglang-router never served:\n" + (logs / "router.log").read_text())
        yield url, pd, single
    finally:
        router.terminate()
        router.wait(timeout=15)
        log.close()
        single.stop()
        pd.stop()


BODY = {
    "messages": [
        {"role": "user", "content": "List three things to check when an HTTP service returns 503."}
    ],
    "max_tokens": 12,
    "temperature": 0,
    "ignore_eos": True,
}


def test_chat_through_sglang_router_matches_single_worker(stack):
    url, pd, single = stack
    want = httpx.post(single.url + "/v1/chat/completions", json=BODY, timeout=60).json()
    got = httpx.post(url + "/v1/chat/completions", json=BODY, timeout=60)
    assert got.status_code == 200, got.text
    assert (
        got.json()["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    )
    assert got.json()["usage"]["completion_tokens"] == 12
    pd.idle()


def test_streaming_chat_through_sglang_router(stack):
    url, pd, single = stack
    want = httpx.post(single.url + "/v1/chat/completions", json=BODY, timeout=60).json()
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json={**BODY, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    text = "".join(
        (json.loads(ln[6:])["choices"] or [{"delta": {}}])[0]["delta"].get("content") or ""
        for ln in lines[:-1]
    )
    assert text == want["choices"][0]["message"]["content"]
    pd.idle()

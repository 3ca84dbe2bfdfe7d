"""The real server on the tiny checkpoint, over real HTTP: equivalence, concurrency, bad input.

The server runs with PDSERVE_CHECK_INVARIANTS=1 (the scheduler checks the pool invariant after
every step and dies if it breaks) and every scenario ends with an idle, leak-free pool.
"""

from __future__ import annotations

import gzip
import json
import threading

import httpx
import pytest
import torch

from serving.config import ModelConfig
from serving.models.loader import load_weights
from serving.tools.generate import StepRunner
from serving.tools.trace_summary import summarize_file
from tests.server_proc import Server
from tests.waiting import wait_until

CONTEXT = 256


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    srv = Server(
        tiny_ckpt, "--context-length", str(CONTEXT), log_dir=tmp_path_factory.mktemp("logs")
    )
    yield srv
    assert srv.stop() == 0


@pytest.fixture(autouse=True)
def leak_free(request, server):
    yield
    server.idle_pool()


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    config = ModelConfig.from_pretrained(tiny_ckpt)
    model, _ = load_weights(tiny_ckpt, config, torch.float32)
    return lambda prompt, n: StepRunner(model, 1, 512).greedy([prompt], n)[0]


def prompt(seed: int, n: int | None = None) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    n = n or int(torch.randint(4, 100, (1,), generator=g))
    return torch.randint(0, 1000, (n,), generator=g).tolist()


def generate(url: str, ids: list[int], n: int, **extra) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
        **extra,
    }
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_equals_step_by_step_model(server, reference):
    for seed in range(3):
        ids = prompt(seed)
        out = generate(server.url, ids, 16)
        assert out["output_ids"] == reference(ids, 16)
        assert out["meta_info"]["completion_tokens"] == 16
        assert out["meta_info"]["prompt_tokens"] == len(ids)


def _stream_ids(url: str, ids: list[int], n: int, out: dict, key: int) -> None:
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
    }
    last = None
    with httpx.stream("POST", url + "/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[6:])
    out[key] = last["output_ids"]


def test_16_concurrent_streams_match_one_at_a_time(server):
    prompts = [prompt(100 + i) for i in range(16)]
    alone = [generate(server.url, p, 12)["output_ids"] for p in prompts]
    together: dict[int, list[int]] = {}
    threads = [
        threading.Thread(target=_stream_ids, args=(server.url, p, 12, together, i))
        for i, p in enumerate(prompts)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [together[i] for i in range(16)] == alone


def test_chunked_prefill_on_and_off_agree(server, tiny_ckpt, tmp_path):
    chunked = Server(
        tiny_ckpt,
        "--context-length",
        str(CONTEXT),
        "--chunked-prefill-size",
        "8",
        "--max-prefill-tokens",
        "24",
        log_dir=tmp_path,
    )
    try:
        for seed in (7, 8):
            ids = prompt(seed, 90)
            assert (
                generate(chunked.url, ids, 10)["output_ids"]
                == generate(server.url, ids, 10)["output_ids"]
            )
        chunked.idle_pool()
    finally:
        assert chunked.stop() == 0


def test_openai_chat_and_completions(server):
    chat = httpx.post(
        server.url + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 5,
            "temperature": 0,
        },
        timeout=60,
    ).json()
    assert chat["object"] == "chat.completion"
    assert chat["usage"]["completion_tokens"] <= 5
    comp = httpx.post(
        server.url + "/v1/completions",
        json={
            "prompt": "hello",
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=60,
    ).json()
    assert comp["choices"][0]["finish_reason"] == "length"
    assert comp["usage"]["completion_tokens"] == 4
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        timeout=60,
    ) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["usage"]["total_tokens"] > 0


def test_info_endpoints(server):
    models = httpx.get(server.url + "/v1/models").json()
    assert models["data"][0]["id"]
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        assert httpx.get(server.url + path).status_code == 200, path
    assert httpx.get(server.url + "/health_generate", timeout=30).status_code == 200
    metrics = httpx.get(server.url + "/metrics").text
    for name in ("time_to_first_token", "inter_token", "num_running", "prompt_tokens"):
        assert name in metrics, name


def test_prefix_cache_interface(server, reference):
    """SGLang's interface: meta_info.cached_tokens on /generate, usage.prompt_tokens_details
    .cached_tokens on the OpenAI routes, the hit rate in /metrics, /flush_cache."""
    first = prompt(50, 150)
    second = first[:140] + prompt(51, 10)
    a, b = generate(server.url, first, 8), generate(server.url, second, 8)
    assert a["meta_info"]["cached_tokens"] == 0 and b["meta_info"]["cached_tokens"] == 128
    assert b["output_ids"] == reference(second, 8)
    chat = {"messages": [{"role": "user", "content": "cache me " * 40}], "max_tokens": 3}
    usages = [
        httpx.post(server.url + path, json=body, timeout=60).json()["usage"]
        for path, body in [
            ("/v1/chat/completions", chat),
            ("/v1/chat/completions", chat),
            ("/v1/completions", {"prompt": "cache me " * 40, "max_tokens": 3}),
            ("/v1/completions", {"prompt": "cache me " * 40, "max_tokens": 3}),
        ]
    ]
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert usages[0]["prompt_tokens"] > 64 and cached[0] == 0 and cached[1] >= 64, usages
    assert cached[3] >= 64, usages
    metrics = httpx.get(server.url + "/metrics").text
    rate = [ln for ln in metrics.splitlines() if ln.startswith("sglang:cache_hit_rate{")]
    assert rate and float(rate[0].split()[1]) > 0, rate
    server.idle_pool()
    assert server.stats()["cached_pages"] > 0
    assert httpx.post(server.url + "/flush_cache", timeout=30).status_code == 200
    stats = server.stats()
    assert stats["cached_pages"] == 0 and stats["cached_states"] == 0, stats
    assert httpx.get(server.url + "/flush_cache", timeout=30).status_code == 200
    again = generate(server.url, second, 8)
    assert again["meta_info"]["cached_tokens"] == 0 and again["output_ids"] == b["output_ids"]


def test_profile_start_stop(server, tmp_path):
    """SGLang's /start_profile and /stop_profile on a real worker: a trace of the scheduler's
    CPU activity that parses; clear 400s for stop without start, start twice and a directory
    that cannot be written; num_steps stops by itself; the server keeps serving; the trace's
    summary (serving.tools.trace_summary) has the host ops and one range per scheduler step."""
    url, out = server.url, tmp_path / "traces"

    def start(**body) -> httpx.Response:
        return httpx.post(url + "/start_profile", json=body, timeout=60)

    def stop() -> httpx.Response:
        return httpx.post(url + "/stop_profile", timeout=120)

    assert (r := stop()).status_code == 400 and "not in progress" in r.json()["message"]
    assert (r := start(output_dir=str(out))).status_code == 200 and r.text == "Start profiling.\n"
    assert (r := start(output_dir=str(out))).status_code == 400
    assert "already in progress" in r.json()["message"]
    for i in range(3):
        generate(url, prompt(70 + i), 4)
    assert (r := stop()).status_code == 200, r.text
    assert r.text == "Stop profiling. This will take some time.\n"
    [trace] = out.glob("*-TP-0.trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any(n.startswith("aten::") for n in names), sorted(names)[:20]
    summary = summarize_file(trace)  # what pd_bench --profile-steps keeps of a trace
    assert summary["window_ms"] > 0 and summary["steps"]["count"] >= 3, summary["steps"]
    assert 0 < summary["steps"]["mean_ms"] <= summary["steps"]["max_ms"] < summary["window_ms"]
    assert any(o["name"].startswith("aten::") for o in summary["cpu_ops"]["top"])
    assert (r := stop()).status_code == 400  # stopped: nothing in progress

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert (r := start(output_dir=str(blocker / "sub"))).status_code == 400
    assert "output_dir" in r.json()["message"]
    assert start(activities=["MEM"]).status_code == 400
    assert start(start_step=3).status_code == 400

    # num_steps: profiling ends by itself after that many forward steps
    assert start(output_dir=str(out), num_steps=2, profile_prefix="short").status_code == 200
    generate(url, prompt(80), 4)
    wait_until(lambda: list(out.glob("short-*-TP-0.trace.json.gz")), 30, 0.2, "the short trace")
    assert stop().status_code == 400  # answered after the trace was written
    [short] = out.glob("short-*-TP-0.trace.json.gz")
    assert summarize_file(short)["steps"]["count"] == 2  # each profiled step is marked
    assert generate(url, prompt(81), 4)["meta_info"]["completion_tokens"] == 4


BAD = [
    ("/v1/chat/completions", b"{not json", 400),
    ("/v1/chat/completions", {"max_tokens": 3}, 400),
    ("/v1/chat/completions", {"messages": "hi"}, 400),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "model": "nope"},
        404,
    ),
    ("/v1/completions", {"prompt": ""}, 400),
    ("/v1/completions", {"prompt": "word " * 400}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": CONTEXT + 10}, 400),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400),
    ("/v1/completions", {"prompt": "hi", "top_p": 7}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, 400),
    ("/generate", {"input_ids": [1, 2], "require_reasoning": True}, 400),  # no parser
    ("/v1/nothing", {}, 404),
]


@pytest.mark.parametrize(("path", "body", "status"), BAD)
def test_bad_input_gets_a_clear_error(server, path, body, status):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(
        server.url + path, headers={"content-type": "application/json"}, timeout=30, **kw
    )
    assert r.status_code == status, r.text
    body = r.json()  # the flat code is the status; the OpenAI-form one may be OpenAI's code
    assert body["error"]["message"] and body["code"] == status
    assert body["error"]["code"] in (status, "context_length_exceeded")
    assert generate(server.url, [5, 6, 7], 2)["output_ids"]  # still serving


def test_client_disconnect_mid_stream_aborts(server):
    body = {
        "input_ids": prompt(3),
        "stream": True,
        "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
    }
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break  # leaving the block closes the connection
    stats = server.idle_pool()  # the abort frees the request's memory
    assert stats["generation_tokens_total"] > 0
    assert generate(server.url, [9, 9], 2)["output_ids"]


def test_seeded_sampling_is_reproducible_and_stop_strings_trim(server):
    def complete(**kw) -> dict:
        body = {"prompt": "The service returned", "max_tokens": 12, "ignore_eos": True, **kw}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    a = complete(temperature=1.0, seed=11)["choices"][0]["text"]
    b = complete(temperature=1.0, seed=11)["choices"][0]["text"]
    c = complete(
        temperature=1.0,
        seed=12,
        top_p=0.9,
        top_k=50,
        min_p=0.01,
        frequency_penalty=0.5,
        presence_penalty=0.3,
        repetition_penalty=1.2,
    )
    assert a == b
    assert c["choices"][0]["text"]
    free = complete(temperature=0)["choices"][0]["text"]
    stop = free[3:6]
    assert stop and stop in free
    cut = complete(temperature=0, stop=[stop])["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == free[: free.index(stop)]
    two = complete(temperature=1.0, seed=3, n=2)
    assert len(two["choices"]) == 2

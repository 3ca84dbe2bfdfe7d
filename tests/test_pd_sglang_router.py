"""Our prefill + decode pair driven by the real sglang-router (pip package, test-only peer)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.pd_pair import PDPair
from tests.server_proc import Server
from tests.sglang_router_proc import SglangRouter

pytest.importorskip("sglang_router")
pytest.importorskip("mooncake.engine")


@pytest.fixture(scope="module")
def stack(tiny_ckpt, tmp_path_factory):
    logs = tmp_path_factory.mktemp("sglang_router")
    pd = PDPair(tiny_ckpt, logs)
    single = Server(tiny_ckpt, log_dir=logs)
    router = SglangRouter(pd, tiny_ckpt, logs)
    try:
        router.wait_serving()
        yield router.url, pd, single
    finally:
        router.stop()
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


def _sse_events(r: httpx.Response) -> list[dict]:
    lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def test_chat_n2_through_sglang_router(stack):
    # sglang-router sends one bootstrap triple per sample here (lists of n entries).
    url, pd, single = stack
    body = {**BODY, "n": 2}
    want = httpx.post(single.url + "/v1/chat/completions", json=BODY, timeout=60).json()
    text = want["choices"][0]["message"]["content"]
    got = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert got.status_code == 200, got.text
    choices = got.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert [c["message"]["content"] for c in choices] == [text, text]
    assert got.json()["usage"]["completion_tokens"] == 24
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200
        events = _sse_events(r)
    streamed = ["", ""]
    for event in events:
        for choice in event["choices"]:
            streamed[choice["index"]] += choice["delta"].get("content") or ""
    assert streamed == [text, text]
    pd.idle()


def test_completion_batch_n2_through_sglang_router(stack, tiny_ckpt):
    # A batch of prompts with n > 1: one triple per prompt, each prompt's samples derive rooms.
    url, pd, single = stack
    prompts = ["The quick brown fox", "Disaggregated serving splits"]
    body = {"model": str(tiny_ckpt), "prompt": prompts, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    want = httpx.post(single.url + "/v1/completions", json=body, timeout=60).json()
    texts = [c["text"] for c in sorted(want["choices"], key=lambda c: c["index"])]
    assert texts[0] != texts[1]
    got = httpx.post(url + "/v1/completions", json={**body, "n": 2}, timeout=60)
    assert got.status_code == 200, got.text
    choices = sorted(got.json()["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in choices] == [texts[0], texts[0], texts[1], texts[1]]
    with httpx.stream(
        "POST", url + "/v1/completions", json={**body, "n": 2, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200
        events = _sse_events(r)
    streamed = [""] * 4
    for event in events:
        for choice in event["choices"]:
            streamed[choice["index"]] += choice["text"]
    assert streamed == [texts[0], texts[0], texts[1], texts[1]]
    pd.idle()


def test_generate_batch_through_sglang_router(stack):
    url, pd, single = stack
    sampling = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    body = {"input_ids": [[5, 6, 7, 8], [9, 10, 11]], "sampling_params": sampling}
    want = httpx.post(single.url + "/generate", json=body, timeout=60).json()
    got = httpx.post(url + "/generate", json=body, timeout=60)
    assert got.status_code == 200, got.text
    assert [r["output_ids"] for r in got.json()] == [r["output_ids"] for r in want]
    n2 = {"input_ids": [5, 6, 7, 8], "sampling_params": {**sampling, "n": 2}}
    got = httpx.post(url + "/generate", json=n2, timeout=60)
    assert got.status_code == 200, got.text
    assert [r["output_ids"] for r in got.json()] == [want[0]["output_ids"]] * 2
    pd.idle()


def test_prompt_logprobs_through_sglang_router(stack, tiny_ckpt):
    # sglang-router puts prefill's input_token_logprobs before decode's: our prefill answers
    # with none and decode with the prompt's (prefill sent them with the KV), so no doubles.
    url, pd, single = stack
    sampling = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    body = {"input_ids": [5, 6, 7, 8, 9, 10], "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": sampling}  # fmt: skip
    want = httpx.post(single.url + "/generate", json=body, timeout=60).json()["meta_info"]
    got = httpx.post(url + "/generate", json=body, timeout=60)
    assert got.status_code == 200, got.text
    entries = got.json()["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == body["input_ids"] and entries[0][0] is None
    assert all(
        abs(a[0] - b[0]) < 2e-4 for a, b in zip(entries[1:], want["input_token_logprobs"][1:])
    )
    # echo with logprobs on /v1/completions: decode's answer carries the prompt's
    echo = {"model": str(tiny_ckpt), "prompt": "The quick brown fox", "max_tokens": 3,
            "temperature": 0, "echo": True, "logprobs": 1}  # fmt: skip
    want = httpx.post(single.url + "/v1/completions", json=echo, timeout=60).json()
    got = httpx.post(url + "/v1/completions", json=echo, timeout=60)
    assert got.status_code == 200, got.text
    lp, want_lp = got.json()["choices"][0]["logprobs"], want["choices"][0]["logprobs"]
    assert lp["tokens"] == want_lp["tokens"] and lp["token_logprobs"][0] is None
    assert all(
        abs(a - b) < 2e-4 for a, b in zip(lp["token_logprobs"][1:], want_lp["token_logprobs"][1:])
    )
    pd.idle()


def test_logit_bias_and_stop_regex_through_sglang_router(stack, tiny_ckpt):
    # sglang-router forwards both on the OpenAI routes (it drops them from /generate's
    # sampling_params, so they are not tested there).
    url, pd, single = stack
    body = {"model": str(tiny_ckpt), "prompt": "The quick brown fox", "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    plain = httpx.post(single.url + "/v1/completions", json=body, timeout=60).json()
    forced = {**body, "logit_bias": {"90": 100}}  # token 90 is byte-level "{"
    want = httpx.post(single.url + "/v1/completions", json=forced, timeout=60).json()
    got = httpx.post(url + "/v1/completions", json=forced, timeout=60)
    assert got.status_code == 200, got.text
    text = got.json()["choices"][0]["text"]
    assert text == want["choices"][0]["text"] != plain["choices"][0]["text"]
    assert len(set(text)) == 1
    cut = httpx.post(
        url + "/v1/completions", json={**forced, "stop_regex": "(.)\\1\\1"}, timeout=60
    )
    choice = cut.json()["choices"][0]
    assert (choice["finish_reason"], choice["matched_stop"]) == ("stop", "(.)\\1\\1")
    assert choice["text"] == text[:3]
    pd.idle()

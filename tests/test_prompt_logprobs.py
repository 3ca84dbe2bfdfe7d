"""Prompt logprobs, scored by the prefill forward: SGLang's logprob_start_len on /generate
(input_token_logprobs, input_top_logprobs) and OpenAI's echo with logprobs on /v1/completions.

The check that pins positions and values: greedy-generate G after a prompt P with output
logprobs, then score P + G as a prompt. G's input logprobs must be G's output logprobs (same
model, same positions), so an off-by-one or a chunk seam shows. Chunks of 8 tokens put seams
inside every prompt here. Run on a single worker and on a PD pair behind our router (prefill
scores, decode answers), scoring-only requests (max_tokens 0) included.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import httpx
import openai
import pytest

from tests.server_proc import Server

CONTEXT = 256
FLAGS = ("--context-length", str(CONTEXT), "--chunked-prefill-size", "8",
         "--max-prefill-tokens", "24")  # fmt: skip


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def generate(url: str, ids: list[int], max_new: int, **fields) -> dict:
    body = {"input_ids": ids, "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
            **fields}  # fmt: skip
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def close(a: list, b: list, tol: float = 2e-4) -> bool:
    return len(a) == len(b) and all(
        x == y or (x is not None and y is not None and abs(x - y) <= tol) for x, y in zip(a, b)
    )


def check_generate(url: str) -> None:
    p = prompt(1, 21)
    out = generate(url, p, 6, top_logprobs_num=3)
    g = out["output_ids"]
    want = out["meta_info"]["output_token_logprobs"]
    scored = generate(url, p + g, 1, top_logprobs_num=3, logprob_start_len=len(p))
    meta = scored["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == g
    assert close([e[0] for e in meta["input_token_logprobs"]], [e[0] for e in want])
    tops, want_tops = meta["input_top_logprobs"], out["meta_info"]["output_top_logprobs"]
    assert [[t[1] for t in top] for top in tops] == [[t[1] for t in top] for top in want_tops]
    # the continuation after P + G is what greedy decoding of P wrote next
    assert scored["output_ids"] == generate(url, p, 7)["output_ids"][6:]
    whole = generate(url, p, 2, logprob_start_len=0)["meta_info"]
    entries = whole["input_token_logprobs"]
    assert [e[1] for e in entries] == p and entries[0][0] is None
    assert all(e[0] < 0 for e in entries[1:]) and whole["input_top_logprobs"][0] is None
    assert "input_token_logprobs" not in generate(url, p, 2)["meta_info"]  # not asked for
    tail = generate(url, p, 2, logprob_start_len=len(p) - 3)["meta_info"]["input_token_logprobs"]
    assert tail == entries[-3:]


def check_echo(url: str, model: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    p = prompt(2, 13)
    out = generate(url, p, 5, top_logprobs_num=2)
    g = out["output_ids"]
    body = {"model": model, "prompt": p + g, "temperature": 0, "logprobs": 2, "echo": True,
            "max_tokens": 3, "extra_body": {"ignore_eos": True}}  # fmt: skip
    echoed = client.completions.create(**body).choices[0]
    lp = echoed.logprobs
    assert len(lp.tokens) == len(p) + len(g) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert close(lp.token_logprobs[len(p) : len(p) + len(g)],
                 [e[0] for e in out["meta_info"]["output_token_logprobs"]])  # fmt: skip
    # top 2 + the chosen token, keyed by text (distinct ids may share a text)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and echoed.text.startswith("".join(lp.tokens[: len(p)]))
    chunks = list(client.completions.create(**body, stream=True))
    streamed = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens]
    assert streamed == lp.tokens
    assert "".join(ch.text for c in chunks for ch in c.choices) == echoed.text
    plain = client.completions.create(**{**body, "echo": False}).choices[0].logprobs
    assert plain.tokens == lp.tokens[len(p) + len(g) :]


def check_scoring_only(url: str, single_url: str, pair, model: str) -> None:
    """max_tokens 0 scores the prompt in PD as on one worker: prefill scores it and sends the
    scores to decode with Success; no KV moves and nothing is sampled."""
    p = prompt(5, 19)
    body = {"input_ids": p, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 0}}  # fmt: skip
    via_pd = httpx.post(url + "/generate", json=body, timeout=60)
    alone = httpx.post(single_url + "/generate", json=body, timeout=60)
    assert via_pd.status_code == alone.status_code == 200, via_pd.text
    got, want = via_pd.json(), alone.json()
    assert got["output_ids"] == want["output_ids"] == []
    assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    for key in ("input_token_logprobs", "input_top_logprobs"):
        assert len(got["meta_info"][key]) == len(p)
    entries = [[e[0] for e in got["meta_info"]["input_token_logprobs"]],
               [e[0] for e in want["meta_info"]["input_token_logprobs"]]]  # fmt: skip
    assert close(*entries)
    echo = {"model": model, "prompt": p, "max_tokens": 0, "echo": True, "logprobs": 1}
    via_pd, alone = (httpx.post(u + "/v1/completions", json=echo, timeout=60).json()
                     for u in (url, single_url))  # fmt: skip
    assert via_pd["usage"] == alone["usage"] and via_pd["usage"]["completion_tokens"] == 0
    lp, want_lp = via_pd["choices"][0]["logprobs"], alone["choices"][0]["logprobs"]
    assert lp["tokens"] == want_lp["tokens"] and close(lp["token_logprobs"],
                                                       want_lp["token_logprobs"])  # fmt: skip
    # a worker that disagrees with its peer on max_new_tokens fails the room on both sides
    decode, prefill = pair.dispatch("/generate", body)
    assert decode.status_code == prefill.status_code == 200  # the same body: both agree
    one = {**body, "sampling_params": {"max_new_tokens": 1}}
    room = pair.bootstrap()
    out: dict[str, httpx.Response] = {}

    def post(name: str, url: str, payload: dict) -> None:
        out[name] = httpx.post(url + "/generate", json={**payload, **room}, timeout=60)

    sent = [threading.Thread(target=post, args=("prefill", pair.prefill.url, body)),
            threading.Thread(target=post, args=("decode", pair.decode.url, one))]  # fmt: skip
    for t in sent:
        t.start()
    for t in sent:
        t.join()
    assert out["prefill"].status_code == out["decode"].status_code == 502, out
    assert "max_new_tokens" in out["prefill"].json()["error"]["message"]


@pytest.fixture(scope="module")
def single(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = Server(tiny_ckpt, *FLAGS, log_dir=tmp_path_factory.mktemp("prompt-logprobs"))
    yield srv
    assert srv.stop() == 0


def test_single_worker(single: Server, tiny_ckpt: Path) -> None:
    check_generate(single.url)
    check_echo(single.url, str(tiny_ckpt))
    # scoring only: max_tokens 0 still runs the prefill
    client = openai.OpenAI(base_url=single.url + "/v1", api_key="none", max_retries=0)
    p = prompt(3, 9)
    scored = client.completions.create(
        model=str(tiny_ckpt), prompt=p, max_tokens=0, echo=True, logprobs=0
    )
    lp = scored.choices[0].logprobs
    assert len(lp.tokens) == 9 and lp.token_logprobs[0] is None
    assert scored.usage.completion_tokens == 0
    bad = {"input_ids": p, "return_logprob": True, "logprob_start_len": -2}
    assert httpx.post(single.url + "/generate", json=bad, timeout=30).status_code == 400
    single.idle_pool()


def test_pd_pair_behind_our_router(
    single: Server, tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    pytest.importorskip("mooncake.engine")
    from tests.pd_pair import PDPair
    from tests.router_proc import RouterProc

    logs = tmp_path_factory.mktemp("prompt-logprobs-pd")
    pair = PDPair(tiny_ckpt, logs, prefill_flags=FLAGS, decode_flags=FLAGS)
    router = None
    try:
        router = RouterProc("--pd-disaggregation", "--prefill", pair.prefill.url,
                            str(pair.bootstrap_port), "--decode", pair.decode.url,
                            "--health-check-interval-secs", "0.2",
                            "--health-success-threshold", "1", log_dir=logs)  # fmt: skip
        router.wait_ready()
        check_generate(router.url)
        check_echo(router.url, str(tiny_ckpt))
        p = prompt(4, 17)
        via_pd = generate(router.url, p, 3, top_logprobs_num=2, logprob_start_len=0)
        alone = generate(single.url, p, 3, top_logprobs_num=2, logprob_start_len=0)
        assert via_pd["output_ids"] == alone["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            got, want = via_pd["meta_info"][key], alone["meta_info"][key]
            assert [e[1] for e in got] == [e[1] for e in want]
            assert close([e[0] for e in got], [e[0] for e in want])
        check_scoring_only(router.url, single.url, pair, str(tiny_ckpt))
        pair.idle()
    finally:
        if router is not None:
            router.stop()
        pair.stop()

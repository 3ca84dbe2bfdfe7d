"""PD disaggregation with real processes: a prefill and a decode worker, real HTTP, real ZMQ,
the real Mooncake engine over loopback TCP. Greedy output through the pair equals the single
worker's; failures end in clean errors; every row, page and aux row is free afterwards."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from tests.pd_pair import PDPair
from tests.server_proc import Server
from tests.waiting import wait_until

pytest.importorskip("mooncake.engine")


def greedy_body(ids: list[int], n: int) -> dict:
    return {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
    }


def destinations_sent(decode: Server) -> int:
    """Rooms whose KV destinations decode has sent to prefill, their KV not all arrived."""
    return decode.stats()["num_decode_transfer_queue_reqs"]


def rooms_held(decode: Server) -> int:
    """Rooms decode holds before their KV has all arrived: finding prefill, waiting for
    memory, or waiting for the KV."""
    stats = decode.stats()
    return stats["num_decode_prealloc_queue_reqs"] + stats["num_decode_transfer_queue_reqs"]


def prompts() -> list[list[int]]:
    """Short, longer than index_topk (32), not aligned to the page size (16) or kpool (4)."""
    g = torch.Generator().manual_seed(5)
    lengths = [3, 5, 17, 33, 47, 61, 70, 97, 113, 29, 41, 55]
    return [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def single(tiny_ckpt, tmp_path_factory):
    srv = Server(tiny_ckpt, log_dir=tmp_path_factory.mktemp("single"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def pair(tiny_ckpt, tmp_path_factory):
    p = PDPair(
        tiny_ckpt,
        tmp_path_factory.mktemp("pd"),
        prefill_flags=("--chunked-prefill-size", "16", "--max-prefill-tokens", "48"),
        decode_flags=(
            "--max-running-requests",
            "4",
            "--disaggregation-decode-extra-slots",
            "8",
            "--decode-log-interval",
            "4",
            "--log-requests",
        ),
    )
    yield p
    p.stop()


def test_pd_greedy_equals_single_worker_with_extra_slots(pair, single):
    ps = prompts()
    expected = [
        httpx.post(single.url + "/generate", json=greedy_body(p, 10), timeout=60).json()[
            "output_ids"
        ]
        for p in ps
    ]
    got: dict[int, dict] = {}

    def run(i: int) -> None:
        decode, prefill = pair.dispatch("/generate", greedy_body(ps[i], 10))
        assert prefill.status_code == 200 and decode.status_code == 200, decode.text
        assert prefill.json()["meta_info"]["completion_tokens"] == 1
        got[i] = decode.json()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=360)  # a hang guard; each request's own limit is dispatch's timeout
    assert [got[i]["output_ids"] if i in got else None for i in range(len(ps))] == expected
    stats = pair.decode.stats()
    assert stats["total_rows"] == 12
    assert stats["peak_used_rows"] > 4, "rows beyond max_running_requests were never used"
    pair.idle()


def test_pd_seeded_sampling_equals_single_worker(pair, single):
    """Decode continues prefill's first token with its own sampler; a seeded draw is keyed by
    output position, so the pair samples exactly what one worker samples, seed by seed."""

    def body(seed: int) -> dict:
        sampling = {"max_new_tokens": 6, "temperature": 1.0, "seed": seed, "ignore_eos": True}
        return {"input_ids": prompts()[2], "sampling_params": sampling}

    seeds = range(6)
    want = [httpx.post(single.url + "/generate", json=body(s), timeout=60).json() for s in seeds]
    got = [pair.dispatch("/generate", body(s))[0].json() for s in seeds]
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert len({tuple(w["output_ids"]) for w in want}) == len(seeds)  # the seeds really sample
    pair.idle()


def test_pd_first_token_top_logprobs_equal_single_worker(pair, single):
    """The first token's logprob and top logprobs are prefill's, carried in the host part of
    the aux row (serving/memory/pool.AuxRows); the pair answers what one worker answers."""
    body = {**greedy_body(prompts()[4], 4), "return_logprob": True, "top_logprobs_num": 5}
    want = httpx.post(single.url + "/generate", json=body, timeout=60).json()
    decode, prefill = pair.dispatch("/generate", body)
    assert prefill.status_code == 200 and decode.status_code == 200, decode.text
    got, want = decode.json()["meta_info"], want["meta_info"]
    g_tok, w_tok = got["output_token_logprobs"], want["output_token_logprobs"]
    assert [e[1] for e in g_tok] == [e[1] for e in w_tok] and len(w_tok) == 4
    g_top, w_top = got["output_top_logprobs"], want["output_top_logprobs"]
    assert len(g_top) == len(w_top) == 4 and len(g_top[0]) == 5
    for g_step, w_step in zip([g_tok] + g_top, [w_tok] + w_top):
        assert [e[1] for e in g_step] == [e[1] for e in w_step]
        assert all(abs(a[0] - b[0]) <= 2e-4 for a, b in zip(g_step, w_step)), (g_step, w_step)
    assert g_tok[0][0] != 0.0 and g_top[0][0][0] != 0.0  # prefill's values, not an empty row
    pair.idle()


STAGES = ("queue_time", "prefill_forward_time")
DECODE_STAGES = (
    *STAGES,
    "prefill_arrival_wait_time",
    "decode_prealloc_time",
    "kv_transfer_time",
    "decode_queue_time",
    "first_decode_step_time",
)


def test_pd_stage_times_keep_a_late_prefill_arrival_out_of_the_kv_transfer(pair):
    """Decode's destinations reach prefill before the request itself does (here: it is sent
    to prefill 1.5 s after decode sent them): the wait is prefill_arrival_wait_time, not KV
    transfer time, and the TTFT parts still add up to at most the TTFT. Margins for a loaded
    machine: the destinations may take up to half a second into prefill's loop, the tiny
    model's transfer up to a second."""
    full = {**greedy_body(prompts()[5], 4), **pair.bootstrap()}
    res = {}

    def decode() -> None:
        res["d"] = httpx.post(pair.decode.url + "/generate", json=full, timeout=120)

    t = threading.Thread(target=decode)
    sent = time.perf_counter()
    t.start()
    wait_until(lambda: destinations_sent(pair.decode) == 1, 60, what="decode's destinations")
    time.sleep(1.5)  # the late arrival under test
    assert httpx.post(pair.prefill.url + "/generate", json=full, timeout=120).status_code == 200
    t.join()
    elapsed = time.perf_counter() - sent
    meta = res["d"].json()["meta_info"]
    stages = {k: meta[k] for k in DECODE_STAGES}
    assert stages["prefill_arrival_wait_time"] >= 1.0, stages
    assert stages["kv_transfer_time"] < 1.0, stages  # the old arithmetic: over 1.5 s
    assert sum(v for k, v in stages.items() if k != "first_decode_step_time") <= elapsed, stages
    pair.idle()


def test_pd_stage_times_split_the_ttft(pair):
    """decode's meta_info splits the time to first token into its stages, prefill's carried in
    the Success message: all present, none negative, together no more than the TTFT the client
    measured (less the first decode step, which under overlap follows the first output); the batch
    log lines and the finish line are in both workers' logs."""
    full = {**greedy_body(prompts()[7], 6), **pair.bootstrap(), "stream": True}
    res = {}

    def prefill() -> None:
        body = {**full, "stream": False}
        res["p"] = httpx.post(pair.prefill.url + "/generate", json=body, timeout=120)

    t = threading.Thread(target=prefill)
    sent = time.perf_counter()
    t.start()
    events = []
    with httpx.stream("POST", pair.decode.url + "/generate", json=full, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                if not events:
                    ttft = time.perf_counter() - sent
                events.append(json.loads(line[6:]))
    t.join()
    meta = events[-1]["meta_info"]
    assert events[-1]["output_ids"] and meta["completion_tokens"] == 6
    stages = {k: meta[k] for k in DECODE_STAGES}
    assert all(v >= 0 for v in stages.values()), stages
    # the overlap scheduler streams the adopted first token before the first decode step runs
    before_first = sum(v for k, v in stages.items() if k != "first_decode_step_time")
    assert before_first <= ttft, (stages, ttft)
    assert stages["prefill_forward_time"] > 0 and stages["first_decode_step_time"] > 0, stages
    # the KV transfer's two parts seen at prefill: behind other writes, and its own writes
    parts = meta["kv_ship_wait_time"] + meta["kv_write_time"]
    assert meta["kv_write_time"] > 0 and parts <= stages["kv_transfer_time"], meta
    # not a TTFT part: the worker's own first token to finish, inside what the client waited
    assert 0 < meta["decode_time"] < time.perf_counter() - sent, meta
    prefill_meta = res["p"].json()["meta_info"]
    assert all(prefill_meta[k] >= 0 for k in (*STAGES, "kv_transfer_time")), prefill_meta
    pair.idle()
    for _ in range(3):  # decode lines every 4 decode steps
        assert pair.dispatch("/generate", greedy_body(prompts()[3], 6))[0].status_code == 200
    prefill_log = pair.prefill.log_path.read_text()
    decode_log = pair.decode.log_path.read_text()
    assert "Prefill batch, #new-seq: " in prefill_log
    assert "#prealloc-req: " in prefill_log and "#inflight-req: " in prefill_log
    line = next(ln for ln in decode_log.splitlines() if "Decode batch, #running-req: " in ln)
    for part in ("#token: ", "token usage: ", "#prealloc-req: ", "#transfer-req: "):
        assert part in line, line
    assert "gen throughput (token/s): " in line and "#queue-req: " in line, line
    assert "Finish: rid: " in decode_log and "first_decode_step_time" in decode_log
    pair.idle()


def test_pd_chat_streaming_through_decode(pair, single):
    body = {
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    want = httpx.post(single.url + "/v1/chat/completions", json=body, timeout=60).json()
    decode, _ = pair.dispatch("/v1/chat/completions", body)
    assert (
        decode.json()["choices"][0]["message"]["content"]
        == want["choices"][0]["message"]["content"]
    )
    room = pair.bootstrap()
    full = {**body, **room, "stream": True}
    res = {}

    def prefill() -> None:
        res["p"] = httpx.post(pair.prefill.url + "/v1/chat/completions", json=full, timeout=60)

    t = threading.Thread(target=prefill)
    t.start()
    with httpx.stream("POST", pair.decode.url + "/v1/chat/completions", json=full, timeout=60) as r:
        chunks = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    t.join()
    assert chunks[-1] == "data: [DONE]"
    text = "".join(
        json.loads(c[6:])["choices"][0]["delta"].get("content") or ""
        for c in chunks[:-1]
        if json.loads(c[6:])["choices"]
    )
    assert text == want["choices"][0]["message"]["content"]
    pair.idle()


def test_pd_prefill_caches_prefixes_and_decode_gets_everything(pair, tiny_ckpt):
    """The prefix cache is on by default on prefill (off on decode): a repeated prefix is not
    prefilled again, decode still receives the whole KV and state, and meta_info.cached_tokens
    reports prefill's hit on both sides."""
    from serving.config import ModelConfig
    from serving.models.loader import load_weights
    from serving.tools.generate import StepRunner

    model, _ = load_weights(tiny_ckpt, ModelConfig.from_pretrained(tiny_ckpt), torch.float32)
    g = torch.Generator().manual_seed(9)
    head = torch.randint(0, 1000, (150,), generator=g).tolist()
    for i in range(3):
        ids = head + [1000 + i] + torch.randint(0, 1000, (5,), generator=g).tolist()
        decode, prefill = pair.dispatch("/generate", greedy_body(ids, 10))
        assert decode.status_code == 200, decode.text
        assert decode.json()["output_ids"] == StepRunner(model, 1, 512).greedy([ids], 10)[0]
        hit = 0 if i == 0 else 128
        assert decode.json()["meta_info"]["cached_tokens"] == hit
        assert prefill.json()["meta_info"]["cached_tokens"] == hit
    pair.idle()
    assert pair.prefill.stats()["cached_pages"] > 0
    assert pair.decode.stats()["total_state_slots"] == 0  # no cache on decode


def test_missing_and_duplicate_rooms_are_refused(pair):
    for srv in (pair.prefill, pair.decode):
        r = httpx.post(srv.url + "/generate", json=greedy_body([1, 2, 3], 2), timeout=30)
        assert r.status_code == 400 and "bootstrap" in r.json()["error"]["message"]
    room = pair.bootstrap()
    body = {**greedy_body([4, 5, 6], 2), **room}
    first = {}
    t = threading.Thread(
        target=lambda: first.setdefault(
            "r", httpx.post(pair.decode.url + "/generate", json=body, timeout=30)
        )
    )
    t.start()
    wait_until(lambda: rooms_held(pair.decode) == 1, 30, what="the first request's room")
    dup = httpx.post(pair.decode.url + "/generate", json=body, timeout=30)
    assert dup.status_code == 400 and "already in use" in dup.json()["error"]["message"]
    httpx.post(pair.prefill.url + "/generate", json=body, timeout=30)
    t.join()
    assert first["r"].status_code == 200
    pair.idle()


def test_prefill_times_out_when_decode_never_sends_destinations(pair):
    body = {**greedy_body(list(range(20)), 4), **pair.bootstrap()}
    t0 = time.monotonic()
    r = httpx.post(pair.prefill.url + "/generate", json=body, timeout=90)
    assert r.status_code == 504, r.text
    assert "decode sent no KV destinations" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 60  # the bootstrap timeout (15 s) and no longer hang
    pair.idle()


def test_client_disconnect_while_transfer_pending_frees_after_ack(pair):
    """Decode got the request, prefill never did: the client leaves; decode aborts the room at
    prefill and reuses the memory once prefill acknowledged (well before the ack timeout)."""
    body = {**greedy_body(list(range(40)), 50), "stream": True, **pair.bootstrap()}
    with pytest.raises(httpx.ReadTimeout):
        with httpx.stream("POST", pair.decode.url + "/generate", json=body, timeout=1.5) as r:
            for _ in r.iter_lines():
                pass
    t0 = time.monotonic()
    pair.decode.idle_pool(timeout=25)
    assert time.monotonic() - t0 < 25  # the ack timeout is 30 s
    pair.idle()


def test_prefill_death_fails_the_room_and_frees_decode(tiny_ckpt, tmp_path):
    pd = PDPair(tiny_ckpt, tmp_path)
    try:
        body = {**greedy_body(list(range(30)), 5), **pd.bootstrap()}
        res = {}
        t = threading.Thread(
            target=lambda: res.setdefault(
                "r", httpx.post(pd.decode.url + "/generate", json=body, timeout=60)
            )
        )
        t.start()
        wait_until(lambda: destinations_sent(pd.decode) == 1, 60, what="decode's destinations")
        for pid in pd.prefill.children():
            os.kill(pid, signal.SIGKILL)
        pd.prefill.proc.send_signal(signal.SIGKILL)
        t.join(timeout=60)
        r = res["r"]
        assert r.status_code in (502, 503), r.text
        assert "prefill" in r.json()["error"]["message"]
        pd.decode.idle_pool()
        again = httpx.post(
            pd.decode.url + "/generate",
            json={**greedy_body([1, 2], 2), **pd.bootstrap()},
            timeout=30,
        )
        assert again.status_code in (502, 503, 504)  # no prefill: a clean error, still serving
        pd.decode.idle_pool()
    finally:
        pd.stop()


def test_page_size_mismatch_is_refused_at_handshake(tiny_ckpt, tmp_path):
    pd = PDPair(tiny_ckpt, tmp_path, decode_flags=("--page-size", "32"))
    try:
        decode, prefill = pd.dispatch("/generate", greedy_body(list(range(10)), 3))
        assert decode.status_code == 502
        assert "page size: prefill 16, decode 32" in decode.json()["error"]["message"]
        assert prefill.status_code >= 400
        pd.idle()
    finally:
        pd.stop()


def test_seed_commands_start_and_serve(tiny_ckpt, tmp_path):
    """The seed's prefill and decode flags (one device, our checkpoint; the kernel backends and
    graph flags this CPU machine cannot honour swapped for ours) start and serve."""
    common = (
        "--served-model-name",
        "GLM-5.3-Flash",
        "--tp-size",
        "1",
        "--ep-size",
        "1",
        "--pp-size",
        "1",
        "--dp-size",
        "1",
        "--dcp-size",
        "1",
        "--mem-fraction-static",
        "0.70",
        "--context-length",
        "4096",
        "--kv-cache-dtype",
        "auto",
        "--cuda-graph-backend-prefill",
        "disabled",
        "--cuda-graph-backend-decode",
        "disabled",
        "--cuda-graph-max-bs-decode",
        "32",
        "--disable-shared-experts-fusion",
        "--reasoning-parser",
        "glm45",
        "--tool-call-parser",
        "glm47",
        "--skip-server-warmup",
        "--watchdog-timeout",
        "600",
        "--max-running-requests",
        "32",
        "--chunked-prefill-size",
        "8192",
        "--max-prefill-tokens",
        "8192",
        "--disaggregation-transfer-backend",
        "mooncake",
        "--disable-overlap-schedule",
        "--nccl-port",
        str(random.randint(20000, 30000)),
    )
    pd = PDPair(
        tiny_ckpt,
        tmp_path,
        prefill_flags=common,
        decode_flags=(*common, "--disaggregation-decode-extra-slots", "64"),
    )
    try:
        body = {
            "model": "GLM-5.3-Flash",
            "temperature": 0,
            "max_tokens": 16,
            "stream": False,
            "messages": [
                {
                    "role": "user",
                    "content": "List three things to check when an HTTP service returns 503.",
                }
            ],
        }
        decode, prefill = pd.dispatch("/v1/chat/completions", body)
        assert decode.status_code == 200, decode.text
        assert decode.json()["usage"]["completion_tokens"] >= 1
        assert pd.decode.stats()["total_rows"] == 32 + 64
        pd.idle()
    finally:
        pd.stop()


def test_pd_with_eagle_uses_rows_up_to_the_extra_slots(distilled_ckpt, tmp_path):
    """The seed's configuration: EAGLE 1/1/2 on both sides, decode at 32 running + 64 extra
    slots. Enough concurrent requests that rows near 96 are held while requests decode; every
    request completes with the single worker's greedy tokens (speculation off)."""
    from training.distill_nextn import training_prompts

    spec = (
        "--speculative-algorithm",
        "EAGLE",
        "--speculative-num-steps",
        "1",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "2",
    )
    ps = training_prompts(1024, 96, 16, seed=0)
    # 16 tokens each: the first requests must still be decoding when the last ones arrive (all
    # 96 held at once), also on a loaded machine where the 96 arrivals take seconds; with 8,
    # a CI run under load peaked at 87
    tokens = 16
    single = Server(distilled_ckpt, log_dir=tmp_path)

    def alone(p: list[int]) -> list[int]:
        r = httpx.post(single.url + "/generate", json=greedy_body(p, tokens), timeout=120)
        return r.json()["output_ids"]

    try:  # batched as the pair batches them (greedy tokens do not depend on the batch)
        with ThreadPoolExecutor(16) as pool:
            expected = list(pool.map(alone, ps))
    finally:
        single.stop()
    pd = PDPair(
        distilled_ckpt,
        tmp_path,
        prefill_flags=spec,
        decode_flags=(
            *spec,
            "--max-running-requests",
            "32",
            "--disaggregation-decode-extra-slots",
            "64",
        ),
    )
    try:
        got: dict[int, list[int]] = {}

        def run(i: int) -> None:
            decode, _ = pd.dispatch("/generate", greedy_body(ps[i], tokens), timeout=300)
            assert decode.status_code == 200, decode.text
            got[i] = decode.json()["output_ids"]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ps))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=360)  # a hang guard; each request's own limit is dispatch's timeout
        assert [got.get(i) for i in range(len(ps))] == expected
        stats = pd.decode.stats()
        assert stats["total_rows"] == 96
        assert stats["peak_used_rows"] >= 90, stats
        assert stats["spec_committed_tokens"] > stats["spec_verify_steps"]  # drafts accepted
        pd.idle()
    finally:
        pd.stop()

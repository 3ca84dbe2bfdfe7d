"""A TP worker over real HTTP on CPU (2 gloo rank processes, tiny checkpoint, float32).

Greedy tokens equal one rank's, also for concurrent ragged batches and chunked prefill; a killed
rank ends the whole worker non-zero with a message naming the rank, and nothing hangs.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import threading

import httpx
import pytest
import torch

from serving.config import ModelConfig
from serving.models.loader import load_weights
from serving.tools.generate import StepRunner
from tests.server_proc import Server, eagle_flags

CONTEXT = 256


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (n,), generator=g).tolist()


def generate(url: str, ids: list[int], n: int, timeout: float = 120) -> httpx.Response:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
    }
    return httpx.post(url + "/generate", json=body, timeout=timeout)


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    config = ModelConfig.from_pretrained(tiny_ckpt)
    model, _ = load_weights(tiny_ckpt, config, torch.float32)
    return lambda ids, n: StepRunner(model, 1, 512).greedy([ids], n)[0]


def test_tp2_greedy_equals_one_rank(tiny_ckpt, reference, tmp_path):
    srv = Server(
        tiny_ckpt,
        "--tp-size",
        "2",
        "--context-length",
        str(CONTEXT),
        "--chunked-prefill-size",
        "8",
        "--max-prefill-tokens",
        "24",
        log_dir=tmp_path,
    )
    try:
        prompts = [prompt(s, n) for s, n in ((0, 5), (1, 37), (2, 90), (3, 61))]
        want = [reference(p, 12) for p in prompts]
        for p, w in zip(prompts[:2], want):
            r = generate(srv.url, p, 12)
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == w
        got: dict[int, list[int]] = {}

        def one(i: int) -> None:
            got[i] = generate(srv.url, prompts[i], 12).json()["output_ids"]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert [got.get(i) for i in range(len(prompts))] == want  # ragged batches together
        # the prefix cache: followers replay rank 0's snapshot saves (in the forward, and after
        # decode steps) and loads (on a hit) on their own heads' states
        head = prompt(9, 150)
        for i in range(3):
            ids = head + [1000 + i] + prompt(20 + i, 3)
            r = generate(srv.url, ids, 50)
            assert r.json()["output_ids"] == reference(ids, 50)
            assert r.json()["meta_info"]["cached_tokens"] == (0 if i == 0 else 128)
        # /start_profile: every rank profiles the same steps and writes its own trace
        traces = tmp_path / "traces"
        body = {"output_dir": str(traces), "with_stack": False}
        start = httpx.post(srv.url + "/start_profile", json=body, timeout=60)
        assert start.status_code == 200, start.text
        assert generate(srv.url, prompts[0], 3).json()["output_ids"] == want[0][:3]
        assert httpx.post(srv.url + "/stop_profile", timeout=120).status_code == 200
        for rank in (0, 1):
            [trace] = traces.glob(f"*-TP-{rank}.trace.json.gz")
            assert json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
        srv.idle_pool()
    finally:
        assert srv.stop() == 0


def test_killed_rank_ends_the_worker(tiny_ckpt, tmp_path):
    srv = Server(
        tiny_ckpt,
        "--tp-size",
        "2",
        "--ep-size",
        "2",
        "--context-length",
        str(CONTEXT),
        "--watchdog-timeout",
        "60",
        log_dir=tmp_path,
    )
    try:
        assert generate(srv.url, prompt(4, 9), 4).status_code == 200  # TP2+EP2 serves
        m = re.search(r"rank 1 of 2: pid (\d+)", srv.log_path.read_text())
        assert m, srv.log_path.read_text()
        events: list[str] = []
        streaming = threading.Event()

        def long_request() -> None:
            body = {
                "input_ids": prompt(5, 20),
                "stream": True,
                "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True},
            }
            try:
                with httpx.stream("POST", srv.url + "/generate", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            streaming.set()
            except httpx.HTTPError:
                events.append("cut")  # the front went away first
            streaming.set()

        t = threading.Thread(target=long_request)
        t.start()
        assert streaming.wait(timeout=60)  # the rank dies while the request runs, not before
        os.kill(int(m.group(1)), signal.SIGKILL)
        code = srv.proc.wait(timeout=60)  # nothing hangs: the worker exits by itself
        t.join(timeout=60)
        log = srv.log_path.read_text()
        assert code != 0
        assert "scheduler rank 1 of 2 exited first (code -9)" in log, log
        # the request did not finish as if nothing happened: it ended with an error or was cut
        last = json.loads(events[-2]) if len(events) > 1 and events[-1] == "[DONE]" else None
        finished = last is not None and last.get("meta_info", {}).get("completion_tokens") == 200
        assert not finished, events[-3:]
    finally:
        srv.stop()


def test_tp2_eagle_greedy_equals_one_rank(tiny_ckpt, reference, tmp_path):
    """EAGLE (2 draft steps, the NextN draft sharded like the target) under TP2+EP2: greedy
    tokens equal plain one-rank decoding, alone and batched, with chunked prefill."""
    srv = Server(
        tiny_ckpt,
        "--tp-size",
        "2",
        "--ep-size",
        "2",
        "--context-length",
        str(CONTEXT),
        "--chunked-prefill-size",
        "16",
        *eagle_flags(2),
        log_dir=tmp_path,
    )
    try:
        prompts = [prompt(s, n) for s, n in ((10, 7), (11, 45), (12, 70))]
        want = [reference(p, 10) for p in prompts]
        r = generate(srv.url, prompts[0], 10)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == want[0]
        got: dict[int, list[int]] = {}

        def one(i: int) -> None:
            got[i] = generate(srv.url, prompts[i], 10).json()["output_ids"]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert [got.get(i) for i in range(len(prompts))] == want
        # the prefix cache: a verify step's accepted run crosses position 128 and every rank
        # snapshots its own heads from the verify history; the next turn starts from there
        first = prompt(13, 100)
        out = generate(srv.url, first, 40).json()["output_ids"]
        assert out == reference(first, 40)
        second = first + out + prompt(14, 5)
        r = generate(srv.url, second, 8).json()
        assert r["output_ids"] == reference(second, 8)
        assert r["meta_info"]["cached_tokens"] == 128
        stats = srv.idle_pool()
        assert stats["spec_num_steps"] == 2 and stats["spec_verify_steps"] > 0, stats
    finally:
        assert srv.stop() == 0

"""The per-token cost of the output path between the scheduler and the HTTP handlers, on the CPU.

    python -m bench.front [--batch 32] [--steps 400] [--tokenizer DIR]

scheduler side: building one step's BatchOutput (a SequenceOutput per running request) and
pickling it, as scheduler_process does after every step; unpickling it, as the front's receive
loop does first. front side: a real EngineClient
receives the pickled messages over a ZMQ ipc socket, routes them to per-request queues, and
`--batch` consumers take them through run_seqs (incremental detokenization included), as
/generate does. Both are reported in microseconds per token; the front's is its wall time from
the first message to the last consumer's end, divided by the tokens (the messages are sent
ahead, so the front runs flat out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import tempfile
import threading
import time
from pathlib import Path

import zmq
from tokenizers import Tokenizer

from serving.front.api.sequences import make_seqs, run_seqs
from serving.front.engine_client import EngineClient
from serving.protocol import (
    BatchOutput,
    FinishReason,
    SchedulerReady,
    SchedulerStats,
    SequenceOutput,
)
from serving.sampling_params import SamplingParams

DEFAULT_TOKENIZER = Path(__file__).resolve().parents[1] / "serving" / "assets" / "small_model"


def step_outputs(batch: int, step: int, steps: int) -> BatchOutput:
    last = step == steps - 1
    outputs = [
        SequenceOutput(
            rid=f"bench-{i}",
            new_token_ids=[100 + (step * 7 + i) % 500],
            finished=last,
            finish_reason=FinishReason.length() if last else None,
            prompt_tokens=1024,
            completion_tokens=step + 1,
            stage_times={"queue_time": 0.01} if last else None,
        )
        for i in range(batch)
    ]
    return BatchOutput(outputs, SchedulerStats(running=batch, generation_tokens_total=step))


def scheduler_side(batch: int, steps: int) -> tuple[dict[str, float], list[bytes]]:
    """(us per token to build, to pickle and to unpickle the steps' messages; the messages)."""
    per_token = 1e6 / (batch * steps)
    started = time.perf_counter()
    built = [step_outputs(batch, s, steps) for s in range(steps)]
    pickled = time.perf_counter()
    messages = [pickle.dumps(m, -1) for m in built]
    unpickled = time.perf_counter()
    for m in messages:
        pickle.loads(m)
    done = time.perf_counter()
    costs = {
        "build": (pickled - started) * per_token,
        "pickle": (unpickled - pickled) * per_token,
        "unpickle": (done - unpickled) * per_token,
    }
    return costs, messages


async def front_side(batch: int, messages: list[bytes], tokenizer: Tokenizer) -> float:
    """us per token for the front to receive, route and detokenize every message."""
    workdir = tempfile.mkdtemp(prefix="bench-front-")
    to_front, to_scheduler = f"ipc://{workdir}/out", f"ipc://{workdir}/in"
    client = EngineClient(to_scheduler, to_front)
    await client.start()
    client.mark_ready(SchedulerReady(1000, 4096, [0], batch, batch, 1024, 64, "cpu", "float32"))
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)  # the requests (ignored: the outputs are scripted)
    pull.bind(to_scheduler)
    push = ctx.socket(zmq.PUSH)
    push.connect(to_front)
    sampling = SamplingParams(max_new_tokens=len(messages))
    seqs = make_seqs(tokenizer, "bench", [[1, 2, 3]] * batch, [sampling] * batch, 1)
    for i, seq in enumerate(seqs):
        seq.request.rid = f"bench-{i}"
    tokens = 0

    async def consume() -> None:
        nonlocal tokens
        async for update in run_seqs(client, seqs):
            tokens += len(update.text) >= 0

    task = asyncio.create_task(consume())
    while pull.poll(0) or len(client.inflight_rids()) < batch:
        if pull.poll(0):
            pull.recv()
        await asyncio.sleep(0.01)
    started = time.perf_counter()
    sender = threading.Thread(target=lambda: [push.send(m, copy=False) for m in messages])
    sender.start()
    await task
    elapsed = time.perf_counter() - started
    sender.join()
    await client.close()
    pull.close(0)
    push.close(0)
    ctx.term()
    return elapsed / (batch * len(messages)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--repeat", type=int, default=5, help="best of this many runs")
    ap.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER))
    args = ap.parse_args()
    tokenizer = Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json"))
    sched, front, size = [], [], 0
    for _ in range(args.repeat):
        costs, messages = scheduler_side(args.batch, args.steps)
        sched.append(costs)
        size = len(messages[len(messages) // 2])
        front.append(asyncio.run(front_side(args.batch, messages, tokenizer)))
    result = {
        "batch": args.batch,
        "steps": args.steps,
        "message_bytes": size,
        **{f"{k}_us_per_token": round(min(c[k] for c in sched), 2) for k in sched[0]},
        "front_us_per_token": round(min(front), 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()

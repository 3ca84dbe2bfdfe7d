"""The overlap scheduler's effect, in-process: the same greedy requests with and without
--disable-overlap-schedule, timing every step and the forwards inside it.

    python -m bench.overlap --model-path serving/assets/small_model --requests 8

Per mode: steps, steps/s, output tok/s, the forward's time per step and the host's (the rest of
the step: scheduling, inputs, sampling, commit, outputs). On CUDA the forward is only enqueued
(the host returns before the device is done), so with overlap a step costs about
max(device, host) instead of device + host. On the CPU every op finishes before it returns:
nothing can overlap, and the figures show the host work per step the overlap would hide on a
device, and that overlapping costs the host nothing extra. The modes alternate (--rounds), so
the first run's warm-up shows as such. Also checks that every run gives the same tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from serving.engine.build import build_engine
from serving.protocol import GenerateRequest
from serving.sampling_params import SamplingParams
from serving.server_args import ServerArgs


def run_mode(args: argparse.Namespace, overlap: bool) -> tuple[dict, dict[str, list[int]]]:
    flags = ["--model-path", args.model_path, "--device", args.device, "--skip-server-warmup"]
    flags += ["--max-running-requests", str(args.requests)] + args.extra.split()
    if not overlap:
        flags.append("--disable-overlap-schedule")
    sched, _ = build_engine(ServerArgs.from_cli(flags))
    forward_s = 0.0
    forward = sched.runner.forward

    def timed_forward(*a, **kw):
        nonlocal forward_s
        started = time.perf_counter()
        out = forward(*a, **kw)
        forward_s += time.perf_counter() - started
        return out

    sched.runner.forward = timed_forward
    g = torch.Generator().manual_seed(0)
    vocab = sched.pool.config.vocab_size
    for i in range(args.requests):
        prompt = torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()
        params = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        sched.add(GenerateRequest(f"r{i}", prompt, params))
    tokens: dict[str, list[int]] = {}
    steps = 0
    started = time.perf_counter()
    while sched.has_work:
        for o in sched.step():
            tokens.setdefault(o.rid, []).extend(o.new_token_ids)
        steps += 1
    wall = time.perf_counter() - started
    total = sum(len(t) for t in tokens.values())
    return {
        "overlap": overlap,
        "steps": steps,
        "wall_s": round(wall, 3),
        "steps_per_s": round(steps / wall, 2),
        "output_tok_per_s": round(total / wall, 1),
        "forward_ms_per_step": round(1e3 * forward_s / steps, 3),
        "host_ms_per_step": round(1e3 * (wall - forward_s) / steps, 3),
    }, tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--extra", default="", help="more server flags, one string")
    ap.add_argument("--rounds", type=int, default=2, help="both modes, this many times each")
    ap.add_argument("--out", help="write the JSON here too")
    args = ap.parse_args(argv)
    results, outputs = [], []
    for n in range(args.rounds):  # alternating, so neither mode alone pays the warm-up
        for overlap in (False, True):
            result, tokens = run_mode(args, overlap)
            results.append({"round": n, **result})
            outputs.append(tokens)
    same = all(t == outputs[0] for t in outputs)
    report = {"device": args.device, "runs": results, "same_tokens": same}
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())

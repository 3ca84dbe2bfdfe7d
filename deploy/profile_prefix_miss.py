"""Where a prefix-cache miss's TTFT goes, one engine in process (issue 26's 3% target).

    # the GPU machine, repository root, fla-core on PYTHONPATH (deploy/gpu_wheels.sh), a bench
    # checkpoint (python -m serving.tools.tiny_model /tmp/bench --preset bench --device cuda):
    python3 deploy/profile_prefix_miss.py --model-path /tmp/bench --out $OUT [--prepare]
    python3 deploy/profile_prefix_miss.py --model-path /tmp/bench --out $OUT --disable-radix-cache

Fresh prompts of --prompt-len random tokens, one at a time (--output-len tokens each): --warm
of them untimed (they compile what they need), --timed of them timed (TTFT, and the wall time
of each of the first scheduler steps, the prefill step's thread CPU time beside it, the
threads and the load average), then two under cProfile and two under the torch profiler
(CPU and CUDA). --prepare runs the worker's start-up kernel warm-up first
(scheduler_process.prepare), as bench_prefix_cache and a server do. Writes
profile_<variant>.txt: the JSON summary line, cProfile's top functions by own time, the torch
profiler's tables by own CPU time and by device time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import threading
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from serving.engine.scheduler_process import build_engine, prepare
from serving.server_args import ServerArgs
from serving.tools.bench_prefix_cache import Driver, stall_counters, stalls_since, watch_compiles


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--prepare", action="store_true", help="the start-up kernel warm-up first")
    ap.add_argument("--disable-radix-cache", action="store_true")
    ap.add_argument("--worker-args", default="", help="more server flags")
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--timed", type=int, default=6)
    a = ap.parse_args()

    variant = "no_cache" if a.disable_radix_cache else "cache"
    flags = ["--disable-radix-cache"] if a.disable_radix_cache else []
    args = ServerArgs.from_cli(
        ["--model-path", a.model_path, "--skip-server-warmup", *flags, *a.worker_args.split()]
    )
    args.validate()
    watch_compiles()
    t0 = time.perf_counter()
    sched = build_engine(args)[0]
    report: dict = {"variant": variant, "build_s": round(time.perf_counter() - t0, 1)}
    if a.prepare:
        t0 = time.perf_counter()
        prepare(sched)
        report["prepare_s"] = round(time.perf_counter() - t0, 1)
    report["pages"] = sched.pool.plan.pages
    rng, drv = random.Random(5), Driver(sched)
    # per request: the wall time of its first scheduler steps, and the prefill step's thread CPU
    first_steps: dict[str, tuple[list[float], float]] = {}

    def one(rid: str) -> None:
        drv.submit(rid, [rng.randrange(1000) for _ in range(a.prompt_len)], a.output_len)
        steps = []
        while True:
            t, cpu = time.perf_counter(), time.thread_time()
            done = drv.step()
            steps.append(round((time.perf_counter() - t) * 1e3, 2))
            if len(steps) == 1:  # the prefill step: this thread's CPU time against its wall time
                prefill_cpu = round((time.thread_time() - cpu) * 1e3, 2)
            if done:
                break
        first_steps[rid] = (steps[:6], prefill_cpu)

    for i in range(a.warm):
        one(f"warm{i}")
    stalls = stall_counters()
    for i in range(a.timed):
        one(f"t{i}")
    report["stalls"] = stalls_since(stalls)
    report["ttft_ms"] = [round(drv.ttft[f"t{i}"] * 1e3, 2) for i in range(a.timed)]
    timed = {f"t{i}": first_steps[f"t{i}"] for i in range(a.timed)}
    report["first_steps_ms"] = {k: steps for k, (steps, _) in timed.items()}
    # wall time the scheduler thread was not on a CPU: waiting for the device, or for a core
    report["first_step_thread_cpu_ms"] = {k: cpu for k, (_, cpu) in timed.items()}
    report["threads"], report["loadavg_1m"] = threading.active_count(), os.getloadavg()[0]
    text = io.StringIO()
    prof = cProfile.Profile()
    prof.enable()
    for i in range(2):
        one(f"cprofile{i}")
    prof.disable()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as tp:
        for i in range(2):
            one(f"torch{i}")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    table = tp.key_averages().table
    text.write("\n== torch profiler, by own CPU time ==\n")
    text.write(table(sort_by="self_cpu_time_total", row_limit=30))
    if torch.cuda.is_available():
        text.write("\n== torch profiler, by device time ==\n")
        text.write(table(sort_by="self_device_time_total", row_limit=25))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"profile_{variant}.txt").write_text(json.dumps(report) + "\n" + text.getvalue())
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()

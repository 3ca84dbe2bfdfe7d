"""Where a prefix-cache miss's TTFT goes, one engine in process (issue 26's 3% target).

    # the GPU machine, repository root, fla-core on PYTHONPATH (bench/gpu_wheels.sh), a bench
    # checkpoint (python -m serving.tools.tiny_model /tmp/bench --preset bench --device cuda):
    python3 -m bench.profile_prefix_miss --model-path /tmp/bench --out $OUT [--prepare]
    python3 -m bench.profile_prefix_miss --model-path /tmp/bench --out $OUT --disable-radix-cache
    python3 -m bench.profile_prefix_miss --model-path /tmp/bench --out $OUT --prepare --alternate

Fresh prompts of --prompt-len random tokens, one at a time (--output-len tokens each): --warm
of them untimed (they compile what they need), --timed of them timed (TTFT, and the wall time
of each of the first scheduler steps, the prefill step's thread CPU time beside it, the
threads and the load average, every thread's CPU time over the timed requests (native threads
too, from /proc), the CPU the scheduler thread is on, and a fixed pure-Python loop's time after
the build, the warm-up and the timed requests: a process-wide slowdown shows there), then two
under cProfile and two under the torch profiler (CPU and CUDA). --prepare runs the worker's
start-up kernel warm-up first (engine/build.prepare), as bench.prefix_cache and a server
do. Writes
profile_<variant>.txt: the JSON summary line, cProfile's top functions by own time, the torch
profiler's tables by own CPU time and by device time.

--alternate: the 3% comparison itself, made immune to the host's speed. Both engines (cache and
--disable-radix-cache) are built in this one process, each with --mem-fraction-static 0.4 on a
GPU unless --worker-args gives one, and their timed misses alternate (cache first on even turns,
no cache first on odd ones), so a virtual CPU that slows down or speeds up (the GPU machine's
do, by up to 1.8x: bench/prefix_cache.py's docstring) weighs on both alike. Writes
alternate.json: each variant's TTFTs, mean and median, and the cache's overhead in percent.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import statistics
import threading
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.prefix_cache import (
    Driver,
    python_loop_ms,
    stall_counters,
    stalls_since,
    watch_compiles,
)
from serving.engine.build import build_engine, prepare
from serving.engine.scheduler import Scheduler
from serving.server_args import ServerArgs


def random_prompt(rng: random.Random, n: int) -> list[int]:
    """Fresh token ids: a miss (ids below 1000, every checkpoint's vocabulary holds them)."""
    return [rng.randrange(1000) for _ in range(n)]


def thread_cpu_ticks() -> dict[str, int]:
    """CPU time (clock ticks, user + system) of every thread of this process, by 'name/tid'."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        out[f"{name}/{task.name}"] = int(fields[11]) + int(fields[12])
    return out


def current_cpu() -> int:
    return int(Path("/proc/thread-self/stat").read_text().rsplit(")", 1)[1].split()[36])


def engine(a: argparse.Namespace, cache: bool, extra: list[str]) -> Scheduler:
    flags = [] if cache else ["--disable-radix-cache"]
    args = ServerArgs.from_cli(
        ["--model-path", a.model_path, "--skip-server-warmup", *flags, *a.worker_args.split()]
        + extra
    )
    args.validate()
    return build_engine(args)[0]


def alternate(a: argparse.Namespace) -> dict:
    extra = []
    if torch.cuda.is_available() and "--mem-fraction-static" not in a.worker_args:
        extra = ["--mem-fraction-static", "0.4"]  # two engines share the GPU
    drivers: dict[str, Driver] = {}
    report: dict = {"mode": "alternate", "prompt_len": a.prompt_len}
    for name in ("cache", "no_cache"):
        sched = engine(a, name == "cache", extra)
        if a.prepare:
            prepare(sched)
        drivers[name] = Driver(sched)
    rng = random.Random(5)

    def miss(name: str, rid: str) -> float:
        drv = drivers[name]
        drv.submit(rid, random_prompt(rng, a.prompt_len), a.output_len)
        while rid not in drv.step():
            pass
        return drv.ttft[rid] * 1e3

    for i in range(a.warm):
        for name in drivers:
            miss(name, f"warm{i}")
    ttft: dict[str, list[float]] = {name: [] for name in drivers}
    loops = [python_loop_ms()]
    for i in range(a.timed):
        for name in list(drivers) if i % 2 == 0 else list(reversed(drivers)):
            ttft[name].append(round(miss(name, f"t{i}"), 2))
    loops.append(python_loop_ms())
    for name, values in ttft.items():
        report[name] = {
            "ttft_ms": values,
            "mean": round(statistics.fmean(values), 2),
            "median": round(statistics.median(values), 2),
        }
    on, off = report["cache"], report["no_cache"]
    for stat in ("mean", "median"):
        report[f"cache_overhead_pct_{stat}"] = round(100 * (on[stat] / off[stat] - 1), 2)
    report["python_loop_ms"] = loops
    return report


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
    ap.add_argument("--alternate", action="store_true", help="both variants, misses alternating")
    a = ap.parse_args()
    if a.alternate:
        watch_compiles()
        report = alternate(a)
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "alternate.json").write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps(report), flush=True)
        return

    variant = "no_cache" if a.disable_radix_cache else "cache"
    watch_compiles()
    t0 = time.perf_counter()
    sched = engine(a, not a.disable_radix_cache, [])
    report: dict = {"variant": variant, "build_s": round(time.perf_counter() - t0, 1)}
    report["python_loop_ms"] = {"built": python_loop_ms()}
    if a.prepare:
        t0 = time.perf_counter()
        prepare(sched)
        report["prepare_s"] = round(time.perf_counter() - t0, 1)
        report["python_loop_ms"]["prepared"] = python_loop_ms()
    report["pages"] = sched.pool.plan.pages
    rng, drv = random.Random(5), Driver(sched)
    # per request: the wall time of its first scheduler steps, and the prefill step's thread CPU
    first_steps: dict[str, tuple[list[float], float]] = {}

    def one(rid: str) -> None:
        drv.submit(rid, random_prompt(rng, a.prompt_len), a.output_len)
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
    stalls, ticks, wall = stall_counters(), thread_cpu_ticks(), time.perf_counter()
    for i in range(a.timed):
        one(f"t{i}")
    report["stalls"] = stalls_since(stalls)
    ms_per_tick = 1e3 / os.sysconf("SC_CLK_TCK")
    busy = {k: (v - ticks.get(k, 0)) * ms_per_tick for k, v in thread_cpu_ticks().items()}
    report["timed_wall_ms"] = round((time.perf_counter() - wall) * 1e3, 1)
    report["thread_cpu_ms"] = dict(sorted(busy.items(), key=lambda kv: -kv[1])[:8])
    report["python_loop_ms"]["timed"] = python_loop_ms()
    report["cpu"], report["cpus_allowed"] = current_cpu(), len(os.sched_getaffinity(0))
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

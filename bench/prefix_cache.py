"""The prefix cache on one worker (in-process scheduler): multi-turn chat and random prompts,
with the radix cache and with --disable-radix-cache, one engine after the other.

    python -m bench.prefix_cache --model-path DIR --out "$OUT/prefix_cache.json"

multi-turn: --conversations conversations share one --system-len-token system prompt; each runs
--turns turns of a --user-len-token user message and a --output-len-token greedy reply. Turn
t+1's prompt is turn t's prompt + its reply + a new user message, as token ids (so what can be
reused is exact, not at the mercy of re-tokenising a reply). Every conversation starts at once
and submits its next turn as soon as its reply is complete. TTFT = submitted -> its first token
out of Scheduler.step(), queueing included; reported for turn 1 and for turns 2..N.
random: --random-requests prompts of --random-len unique random tokens (--random-output-len
tokens each), at each --random-concurrency: what the cache costs when nothing is reused.
hit rate: prompt tokens served from the cache / prompt tokens, over each workload (the
scheduler's counters, which /metrics reports as sglang:cache_hit_rate).
stalls: per workload, the CUDA allocator's cudaMalloc / cudaFree calls and retries, Python's full
collections and the Triton kernels built under it (host stalls that device time does not show).

Each variant runs in a child process (so each gets the whole GPU, with default memory
settings) with a Triton cache directory of its own (--shared-triton-cache: the default one),
so neither variant runs on kernels the other compiled or tuned: build the engine, prepare its
kernels as a worker does at start-up (engine/build.prepare; prepare_s), random workloads,
flush, multi-turn. The first request of each workload (first batch at concurrency > 1) is
reported apart from the rest (`first`, `rest`): a kernel compiled under a request shows there.
The JSON is rewritten after every variant; a summary line per workload goes to stdout.

Host speed: the GPU machine's virtual CPUs differ and drift (H200, session 7: a fixed
pure-Python loop took 7.5-8.3 ms on some of its 16 and 12.7-15.4 ms on the others, which ones
changing from machine to machine; on one pinned CPU the same loop went from 13.7 to 7.7 ms within
a minute), so an engine's host-bound steps may run up to 1.8x slower in one variant than in the
other. --cpu N pins both variants to CPU N once their kernels are prepared (a cold preparation
pinned to one CPU took over 5 minutes); each variant reports `python_loop_ms` (that loop before
and after its workloads) and the CPUs it ran on, so a comparison can be checked for it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from serving.engine.build import build_engine, prepare
from serving.engine.scheduler import Scheduler
from serving.protocol import GenerateRequest, SamplingParams
from serving.server_args import ServerArgs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.prefix_cache",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--out", type=Path, required=True, help="the JSON report")
    ap.add_argument(
        "--worker-args", default="", help="server flags for both variants (--worker-args='...')"
    )
    ap.add_argument("--variants", default="cache,no_cache", help="cache, no_cache or both")
    ap.add_argument("--system-len", type=int, default=4096)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--user-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--random-requests", type=int, default=16)
    ap.add_argument("--random-len", type=int, default=4096)
    ap.add_argument("--random-output-len", type=int, default=16)
    ap.add_argument("--random-concurrency", default="1,16")
    ap.add_argument(
        "--shared-triton-cache",
        action="store_true",
        help="both variants use the default Triton cache (the second reuses the first's kernels)",
    )
    ap.add_argument("--vocab", type=int, default=1000, help="prompt token ids are below this")
    ap.add_argument("--cpu", type=int, help="pin both variants to this CPU (host speed)")
    ap.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)  # run_child's
    return ap.parse_args(argv)


def stats_ms(values: list[float]) -> dict:
    if not values:
        return {}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {
        "mean": round(statistics.fmean(values) * 1000, 2),
        "p50": round(pick(0.5) * 1000, 2),
        "p90": round(pick(0.9) * 1000, 2),
        "n": len(values),
    }


class Driver:
    """Submits requests to a scheduler and steps it, timing each request's first token."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.submitted: dict[str, float] = {}
        self.ttft: dict[str, float] = {}
        self.tokens: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}

    def submit(self, rid: str, ids: list[int], n: int) -> None:
        sampling = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
        self.submitted[rid] = time.perf_counter()
        self.tokens[rid] = []
        self.sched.add(GenerateRequest(rid, ids, sampling))

    def step(self) -> list[str]:
        """One scheduler step; returns the rids that finished in it."""
        outs = self.sched.step()
        now = time.perf_counter()
        done = []
        for o in outs:
            if o.new_token_ids and o.rid not in self.ttft:
                self.ttft[o.rid] = now - self.submitted[o.rid]
            self.tokens[o.rid].extend(o.new_token_ids)
            if o.finished:
                if o.finish_reason.kind == "abort":
                    raise RuntimeError(f"{o.rid} failed: {o.finish_reason.message}")
                self.cached[o.rid] = o.cached_tokens
                done.append(o.rid)
        return done


def counters(sched: Scheduler) -> tuple[int, int]:
    return sched.stats.cache_hit_tokens_total, sched.stats.cache_lookup_tokens_total


# Triton kernels built in this process since start-up, in order: (name, loaded from the disk
# cache); appended by watch_compiles' listener
COMPILED: list[tuple[str, bool]] = []


def watch_compiles() -> None:
    """Record every Triton kernel this process builds (compiled, or loaded from the disk cache)
    through triton.knobs.compilation.listener, chaining any listener already set. Once per
    process: a second listener chained on the first would record every build twice."""
    try:
        from triton import knobs

        previous = knobs.compilation.listener
    except (ImportError, AttributeError):  # no Triton, or one older than its knobs (3.4)
        return
    if getattr(previous, "records_builds", False):
        return

    def listener(*, src, metadata, metadata_group, times, cache_hit) -> None:
        COMPILED.append((getattr(src, "name", str(src)), bool(cache_hit)))
        if previous is not None:
            previous(
                src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                cache_hit=cache_hit,
            )  # fmt: skip

    listener.records_builds = True
    knobs.compilation.listener = listener


def python_loop_ms() -> float:
    """Median wall time of a fixed pure-Python loop: this process's host speed now."""
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        total = 0
        for i in range(200_000):
            total += i % 7
        runs.append(time.perf_counter() - t)
    return round(sorted(runs)[2] * 1e3, 2)


def stall_counters() -> dict:
    """What can stall the host between kernels and is invisible in device time: the CUDA caching
    allocator's cudaMalloc / cudaFree calls and its retries (an allocation that failed, freed
    every cached block and tried again: synchronizing), Python's full collections, and Triton
    kernels built (a compile under a request costs it seconds)."""
    out = {"gc_full_collections": gc.get_stats()[2]["collections"], "triton_builds": len(COMPILED)}
    if torch.cuda.is_available():
        mem = torch.cuda.memory_stats()
        for key in ("num_alloc_retries", "num_device_alloc", "num_device_free"):
            out[key] = mem.get(key, 0)
    return out


def stalls_since(before: dict) -> dict:
    out = {k: v - before[k] for k, v in stall_counters().items()}
    built = COMPILED[before["triton_builds"] :]
    out["triton_built"] = sorted({name + ("" if hit else " (compiled)") for name, hit in built})
    return out


def hit_rate(before: tuple[int, int], after: tuple[int, int]) -> float:
    prompt = after[1] - before[1]
    return round((after[0] - before[0]) / prompt, 4) if prompt else 0.0


def random_prompts(sched: Scheduler, a: argparse.Namespace, concurrency: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(a.vocab) for _ in range(a.random_len)] for _ in range(a.random_requests)
    ]
    drv, before, stalls = Driver(sched), counters(sched), stall_counters()
    todo = list(enumerate(prompts))
    live = 0
    t0 = time.perf_counter()
    while todo or live:
        while todo and live < concurrency:
            i, ids = todo.pop(0)
            drv.submit(f"rand{seed}-{i}", ids, a.random_output_len)
            live += 1
        live -= len(drv.step())
    wall = time.perf_counter() - t0
    ttft = [drv.ttft[f"rand{seed}-{i}"] for i in range(len(prompts))]
    return {
        "concurrency": concurrency,
        "ttft_ms": stats_ms(ttft),
        "ttft_ms_first": stats_ms(ttft[:concurrency]),  # the first request / first batch
        "ttft_ms_rest": stats_ms(ttft[concurrency:]),
        "wall_s": round(wall, 2),
        "hit_rate": hit_rate(before, counters(sched)),
        "stalls": stalls_since(stalls),
    }


def multi_turn(sched: Scheduler, a: argparse.Namespace) -> dict:
    rng = random.Random(7)
    user = lambda: [rng.randrange(a.vocab) for _ in range(a.user_len)]  # noqa: E731
    system = [rng.randrange(a.vocab) for _ in range(a.system_len)]
    drv, before, stalls = Driver(sched), counters(sched), stall_counters()
    prompts = {c: system + user() for c in range(a.conversations)}
    turn_of: dict[str, tuple[int, int]] = {}
    ttft_by_turn: dict[int, list[float]] = {t: [] for t in range(1, a.turns + 1)}
    hits_by_turn: dict[int, list[int]] = {t: [] for t in range(1, a.turns + 1)}
    prompt_tokens = 0
    t0 = time.perf_counter()
    for c, ids in prompts.items():
        turn_of[f"c{c}-t1"] = (c, 1)
        drv.submit(f"c{c}-t1", ids, a.output_len)
        prompt_tokens += len(ids)
    live = len(prompts)
    while live:
        for rid in drv.step():
            live -= 1
            c, turn = turn_of[rid]
            ttft_by_turn[turn].append(drv.ttft[rid])
            hits_by_turn[turn].append(drv.cached[rid])
            if turn < a.turns:
                prompts[c] = prompts[c] + drv.tokens[rid] + user()
                nxt = f"c{c}-t{turn + 1}"
                turn_of[nxt] = (c, turn + 1)
                drv.submit(nxt, prompts[c], a.output_len)
                prompt_tokens += len(prompts[c])
                live += 1
    wall = time.perf_counter() - t0
    output_tokens = sum(len(t) for t in drv.tokens.values())
    later = [x for t in range(2, a.turns + 1) for x in ttft_by_turn[t]]
    return {
        "ttft_ms_turn_1": stats_ms(ttft_by_turn[1]),
        "ttft_ms_turns_2_plus": stats_ms(later),
        "ttft_ms_mean_by_turn": {t: stats_ms(v).get("mean") for t, v in ttft_by_turn.items() if v},
        "cached_tokens_mean_by_turn": {
            t: round(statistics.fmean(v), 1) for t, v in hits_by_turn.items() if v
        },
        "wall_s": round(wall, 2),
        "requests": len(drv.tokens),
        "output_tok_per_s": round(output_tokens / wall, 1),
        "prompt_tok_per_s": round(prompt_tokens / wall, 1),
        "hit_rate": hit_rate(before, counters(sched)),
        "stalls": stalls_since(stalls),
    }


def run_variant(a: argparse.Namespace, name: str) -> dict:
    flags = shlex.split(a.worker_args) + (["--disable-radix-cache"] if name == "no_cache" else [])
    args = ServerArgs.from_cli(["--model-path", a.model_path, "--skip-server-warmup", *flags])
    args.validate()
    watch_compiles()
    t0 = time.perf_counter()
    sched = build_engine(args)[0]
    out: dict = {"flags": flags, "build_s": round(time.perf_counter() - t0, 1)}
    out["state_slots"] = sched.pool.plan.state_slots
    out["kv_tokens"] = sched.pool.plan.pages * sched.pool.plan.page_size
    t0 = time.perf_counter()
    prepare(sched)  # what a worker does at start-up, no more
    out["prepare_s"] = round(time.perf_counter() - t0, 1)
    if a.cpu is not None:  # after the build and warm-up: compiling on one CPU takes minutes
        os.sched_setaffinity(0, {a.cpu})
    out["python_loop_ms"] = {"before": python_loop_ms()}
    concurrencies = [int(c) for c in a.random_concurrency.split(",") if c]
    out["random"] = [random_prompts(sched, a, c, seed=1000 + c) for c in concurrencies]
    sched.flush_cache()
    out["multi_turn"] = multi_turn(sched, a)
    out["python_loop_ms"]["after"] = python_loop_ms()
    out["cpus"] = sorted(os.sched_getaffinity(0))
    return out


def run_child(argv: list[str], a: argparse.Namespace, name: str) -> dict:
    """run_variant in a fresh process: the engine's memory goes with it."""
    with tempfile.TemporaryDirectory() as tmp:
        part = Path(tmp) / f"{name}.json"
        cmd = [sys.executable, "-m", "bench.prefix_cache", *argv]
        env = dict(os.environ)
        if not a.shared_triton_cache:
            env["TRITON_CACHE_DIR"] = str(Path(tmp) / "triton")  # fla's autotune results too
        subprocess.run([*cmd, "--variants", name, "--child-out", str(part)], check=True, env=env)
        return json.loads(part.read_text())


def summarise(report: dict) -> dict:
    v = report["variants"]
    if not {"cache", "no_cache"} <= v.keys():
        return {}
    on, off = v["cache"], v["no_cache"]
    later_on = on["multi_turn"]["ttft_ms_turns_2_plus"]["mean"]
    later_off = off["multi_turn"]["ttft_ms_turns_2_plus"]["mean"]
    out = {
        "multi_turn_ttft_turns_2_plus_ms": {"cache": later_on, "no_cache": later_off},
        "multi_turn_ttft_speedup": round(later_off / later_on, 2),
        "multi_turn_output_tok_per_s": {
            k: x["multi_turn"]["output_tok_per_s"] for k, x in (("cache", on), ("no_cache", off))
        },
        "multi_turn_hit_rate": on["multi_turn"]["hit_rate"],
        "random": [],
    }
    for r_on, r_off in zip(on["random"], off["random"]):
        row = {"concurrency": r_on["concurrency"], "hit_rate": r_on["hit_rate"]}
        # all requests; the first request / batch alone; the rest (steady state), mean and p50
        for label, key, stat in (
            ("all", "ttft_ms", "mean"),
            ("first", "ttft_ms_first", "mean"),
            ("rest", "ttft_ms_rest", "mean"),
            ("rest_p50", "ttft_ms_rest", "p50"),
        ):
            m_on, m_off = r_on.get(key, {}).get(stat), r_off.get(key, {}).get(stat)
            if m_on is None or not m_off:
                continue
            row[f"ttft_ms_{label}"] = {"cache": m_on, "no_cache": m_off}
            row[f"cache_overhead_pct_{label}"] = round(100 * (m_on / m_off - 1), 2)
        out["random"].append(row)
    t1_on, t1_off = (x["multi_turn"]["ttft_ms_turn_1"]["mean"] for x in (on, off))
    out["multi_turn_ttft_turn_1_ms"] = {"cache": t1_on, "no_cache": t1_off}
    for key in ("prepare_s", "python_loop_ms"):
        out[key] = {"cache": on.get(key), "no_cache": off.get(key)}
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    if a.child_out is not None:
        a.child_out.write_text(json.dumps(run_variant(a, a.variants)))
        return
    report: dict = {
        "args": {k: str(v) for k, v in vars(a).items()},
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "variants": {},
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for name in a.variants.split(","):
        report["variants"][name] = run_child(argv, a, name)
        report["summary"] = summarise(report)
        report["total_s"] = round(time.perf_counter() - t0, 1)
        a.out.write_text(json.dumps(report, indent=2) + "\n")
        res = report["variants"][name]
        print(json.dumps({"variant": name, "multi_turn": res["multi_turn"]}), flush=True)
        print(json.dumps({"variant": name, "random": res["random"]}), flush=True)
    print(json.dumps({"summary": report.get("summary"), "total_s": report["total_s"]}), flush=True)


if __name__ == "__main__":
    main()

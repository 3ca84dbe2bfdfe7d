"""The prefix cache on one worker (in-process scheduler): multi-turn chat and random prompts,
with the radix cache and with --disable-radix-cache, the two engines alternating in one process;
with --pd, the multi-turn chat over HTTP too: one worker, then a PD pair behind our router.

    python -m bench.prefix_cache --model-path DIR --out "$OUT/prefix_cache.json" \
        [--repeats 3] [--pd]

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
phases: per workload, the mean host-phase split of its prefill steps (serving/engine/
step_phases.py: radix match, admission, snapshot plan, admission's batched device work, the
forward's launch, its device time, the wait and processing); for multi-turn, over the steps that
admit turns 2.. (`phases_turns_2_plus`) and turn 1 apart.

One child process builds both engines (each --mem-fraction-static 0.4 on CUDA unless
--worker-args says otherwise) and prepares their kernels as a worker does at start-up
(engine/build.prepare; prepare_s: the second finds the first's kernels built), then runs
--repeats rounds: each workload on each engine, the engines' order flipped every round, the
cache flushed before each workload, so the host's drift (below) weighs on both alike. Every
run is reported (`variants.NAME.runs`) and `summary` gives each figure's runs and median and
the ratios of the medians. The first request of each random workload (first batch at
concurrency > 1) is reported apart from the rest (`first`, `rest`): a kernel compiled under a
request shows there. Unpinned by default, as users run.

--pd (after the child exited, so the GPU is free): a worker with the cache (launch_server), then
a prefill worker (caching), a decode worker and our router (Mooncake over loopback TCP, as
bench/pd_bench.py starts them), each loaded with the same multi-turn chat over streaming
/generate (TTFT at the first chunk with tokens); `servers` holds both, `summary`
pd_over_single_turns_2_plus their ratio. --pd-only: the servers alone (the in-process rounds
take ~230 s on the H200, the servers ~200 s more). --pd-decode-cache: then the PD pair again
with --disaggregation-decode-enable-radix-cache on decode (`servers.pd_decode_cache`, summary
pd_decode_cache_over_single_turns_2_plus). Run from the repository root (it imports
deploy/).
The JSON is rewritten after each part; a summary line per run goes to stdout.

Host speed: the GPU machine's virtual CPUs differ and drift (H200, session 7: a fixed
pure-Python loop took 7.5-8.3 ms on some of its 16 and 12.7-15.4 ms on the others, which ones
changing from machine to machine; on one pinned CPU the same loop went from 13.7 to 7.7 ms within
a minute), so an engine's host-bound steps may run up to 1.8x slower in one run than in another.
--cpu N pins the process to CPU N once the kernels are prepared; each run reports
`python_loop_ms` (that loop before and after the round) and the CPUs it ran on.
"""

from __future__ import annotations

import argparse
import asyncio
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
from serving.engine.step_phases import StepPhases, phase_means
from serving.protocol import GenerateRequest
from serving.sampling_params import SamplingParams
from serving.server_args import ServerArgs

SHARED_DEVICE_FRACTION = 0.4  # per engine or worker, two sharing one GPU


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
    ap.add_argument("--repeats", type=int, default=3, help="rounds, the variants alternating")
    ap.add_argument(
        "--pd",
        action="store_true",
        help="then the multi-turn chat over HTTP: one worker, and a PD pair behind the router",
    )
    ap.add_argument(
        "--pd-only",
        action="store_true",
        help="--pd's servers alone, without the in-process engines (a device call too short "
        "for both)",
    )
    ap.add_argument(
        "--pd-decode-cache",
        action="store_true",
        help="with --pd/--pd-only: the PD pair again, decode keeping its prefix cache",
    )
    ap.add_argument("--server-timeout", type=float, default=300, help="seconds to get healthy")
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
        sched.prefill.phases = []  # every prefill step's host-phase split (step_phases.py)
        self.submitted: dict[str, float] = {}
        self.ttft: dict[str, float] = {}
        self.tokens: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}
        self.phases: list[StepPhases] = []

    def submit(self, rid: str, ids: list[int], n: int) -> None:
        sampling = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
        self.submitted[rid] = time.perf_counter()
        self.tokens[rid] = []
        self.sched.add(GenerateRequest(rid, ids, sampling))

    def step(self) -> list[str]:
        """One scheduler step; returns the rids that finished in it."""
        outs = self.sched.step()
        now = time.perf_counter()
        self.phases += self.sched.prefill.phases
        self.sched.prefill.phases.clear()
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
        "phases": phase_means(drv.phases),
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
        # the prefill steps that admit turns 2.. (each admits the conversations' next turns)
        "phases_turns_2_plus": phase_means(
            [p for p in drv.phases if p.rids and all(turn_of[r][1] > 1 for r in p.rids)]
        ),
        "phases_turn_1": phase_means(
            [p for p in drv.phases if any(turn_of[r][1] == 1 for r in p.rids)]
        ),
    }


def build_variant(a: argparse.Namespace, name: str) -> tuple[Scheduler, dict]:
    flags = shlex.split(a.worker_args) + (["--disable-radix-cache"] if name == "no_cache" else [])
    if torch.cuda.is_available() and "--mem-fraction-static" not in flags:
        flags += ["--mem-fraction-static", str(SHARED_DEVICE_FRACTION)]  # two engines, one GPU
    args = ServerArgs.from_cli(["--model-path", a.model_path, "--skip-server-warmup", *flags])
    args.validate()
    t0 = time.perf_counter()
    sched = build_engine(args)[0]
    out: dict = {"flags": flags, "build_s": round(time.perf_counter() - t0, 1)}
    out["state_slots"] = sched.pool.plan.state_slots
    out["kv_tokens"] = sched.pool.plan.pages * sched.pool.plan.page_size
    t0 = time.perf_counter()
    prepare(sched)  # what a worker does at start-up, no more
    out["prepare_s"] = round(time.perf_counter() - t0, 1)
    return sched, out


def run_in_process(a: argparse.Namespace) -> dict:
    """Both variants' engines in this process; --repeats rounds, each running every workload on
    every engine, the engines alternating (their order flipped each round), so the host's
    drift weighs on both alike. The cache is flushed before each workload."""
    watch_compiles()
    names = a.variants.split(",")
    engines, report = {}, {}
    for name in names:
        engines[name], report[name] = build_variant(a, name)
        report[name]["runs"] = []
    if a.cpu is not None:  # after the builds and warm-ups: compiling on one CPU takes minutes
        os.sched_setaffinity(0, {a.cpu})
    concurrencies = [int(c) for c in a.random_concurrency.split(",") if c]
    for r in range(a.repeats):
        order = names if r % 2 == 0 else names[::-1]
        runs = {name: {"python_loop_ms": {"before": python_loop_ms()}} for name in order}
        for c in concurrencies:
            for name in order:
                engines[name].flush_cache()
                seed = 1000 + c + 100 * r  # prompts no earlier run has seen: misses
                runs[name].setdefault("random", []).append(
                    random_prompts(engines[name], a, c, seed)
                )
        for name in order:
            engines[name].flush_cache()
            runs[name]["multi_turn"] = multi_turn(engines[name], a)
        for name in order:
            runs[name]["python_loop_ms"]["after"] = python_loop_ms()
            runs[name]["cpus"] = sorted(os.sched_getaffinity(0))
            report[name]["runs"].append(runs[name])
    return report


def run_child(argv: list[str], a: argparse.Namespace) -> dict:
    """run_in_process in a fresh process: the engines' memory goes with it (the PD part's
    workers need the GPU next)."""
    with tempfile.TemporaryDirectory() as tmp:
        part = Path(tmp) / "in_process.json"
        cmd = [sys.executable, "-m", "bench.prefix_cache", *argv]
        subprocess.run([*cmd, "--child-out", str(part)], check=True)
        return json.loads(part.read_text())


# ---- the same multi-turn chat over HTTP: one worker, and a PD pair behind the router ----
async def http_turn(client, url: str, ids: list[int], n: int) -> tuple[float, list[int], dict]:
    """One streamed /generate: (TTFT in s, the output ids, the last chunk's meta_info)."""
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
    }
    start, ttft, out, meta = time.perf_counter(), None, [], {}
    async with client.stream("POST", url + "/generate", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            out, meta = chunk["output_ids"], chunk.get("meta_info") or meta
            if out and ttft is None:
                ttft = time.perf_counter() - start
    return ttft, out, meta


async def http_multi_turn(url: str, a: argparse.Namespace) -> dict:
    """multi_turn's workload through a server: every conversation at once, each submitting its
    next turn when its reply is complete."""
    import httpx

    rng = random.Random(7)
    user = lambda: [rng.randrange(a.vocab) for _ in range(a.user_len)]  # noqa: E731
    system = [rng.randrange(a.vocab) for _ in range(a.system_len)]
    ttft: dict[int, list[float]] = {t: [] for t in range(1, a.turns + 1)}
    cached: dict[int, list[int]] = {t: [] for t in range(1, a.turns + 1)}

    async def conversation(client) -> None:
        ids = system + user()
        for turn in range(1, a.turns + 1):
            first, out, meta = await http_turn(client, url, ids, a.output_len)
            ttft[turn].append(first)
            cached[turn].append(meta.get("cached_tokens", 0))
            ids = ids + out + user()

    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=a.conversations + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.gather(*(conversation(client) for _ in range(a.conversations)))
    later = [x for t in range(2, a.turns + 1) for x in ttft[t]]
    return {
        "ttft_ms_turn_1": stats_ms(ttft[1]),
        "ttft_ms_turns_2_plus": stats_ms(later),
        "ttft_ms_mean_by_turn": {t: stats_ms(v).get("mean") for t, v in ttft.items() if v},
        "cached_tokens_mean_by_turn": {
            t: round(statistics.fmean(v), 1) for t, v in cached.items() if v
        },
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def run_servers(a: argparse.Namespace, out_dir: Path) -> dict:
    """One worker with the cache (launch_server), then a PD pair + our router (the prefill
    worker caching; Mooncake over loopback, as deploy/pd_bench.py starts it), one after the
    other on this machine, each running http_multi_turn once."""
    from deploy.launch_local import Proc, build, start, stop, take_port, wait_ready

    model = Path(a.model_path).resolve()
    worker = a.worker_args
    if "--mem-fraction-static" not in worker:
        worker += f" --mem-fraction-static {SHARED_DEVICE_FRACTION}"  # two workers, one GPU
    results: dict = {}
    stacks: dict[str, list[Proc]] = {}
    port = take_port("127.0.0.1", 0, "single worker")
    single = [
        sys.executable, "-m", "serving.launch_server", "--model-path", str(model),
        "--host", "127.0.0.1", "--port", str(port), *shlex.split(worker),
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    stacks["single"] = [Proc("single", single, url, "/health", out_dir / "single.log")]
    ns = argparse.Namespace(
        host="127.0.0.1", port=0, prefill_port=0, bootstrap_port=0, decode_port=0,
        prefill_args=worker, decode_args=worker,
    )  # fmt: skip
    stacks["pd"] = build(ns, model, model.name, out_dir)
    if a.pd_decode_cache:
        cached = out_dir / "pd_decode_cache"
        cached.mkdir(exist_ok=True)
        ns.decode_args = f"{worker} --disaggregation-decode-enable-radix-cache"
        stacks["pd_decode_cache"] = build(ns, model, model.name, cached)
    for name, procs in stacks.items():
        t0 = time.monotonic()
        try:
            for p in procs:
                start(p)
            wait_ready(procs, a.server_timeout, t0)
            res = asyncio.run(http_multi_turn(procs[-1].url, a))
            res["startup_s"] = round(time.monotonic() - t0, 1)
            results[name] = res
        except Exception as e:  # noqa: BLE001 (the report names it; the other stack still runs)
            tails = {p.role: p.log_tail(30) for p in procs if p.log_path.is_file()}
            results[name] = {"error": repr(e), "log_tails": tails}
        finally:
            stop(procs)
        print(json.dumps({"server": name, **results[name]}), flush=True)
    return results


# ---- the report ----
def median_of(runs: list[float | None]) -> dict:
    values = [v for v in runs if v is not None]
    return {"runs": runs, "median": round(statistics.median(values), 2) if values else None}


def summarise(report: dict) -> dict:
    """Every run's figure and the median over runs, per variant; ratios of the medians."""
    v = report.get("variants", {})
    out: dict = {}
    if {"cache", "no_cache"} <= v.keys():
        on, off = v["cache"]["runs"], v["no_cache"]["runs"]
        for key, label in (("ttft_ms_turns_2_plus", "turns_2_plus"), ("ttft_ms_turn_1", "turn_1")):
            fig = {
                name: median_of([r["multi_turn"][key]["mean"] for r in runs])
                for name, runs in (("cache", on), ("no_cache", off))
            }
            out[f"multi_turn_ttft_{label}_ms"] = fig
            if fig["cache"]["median"]:
                out[f"multi_turn_ttft_{label}_speedup"] = round(
                    fig["no_cache"]["median"] / fig["cache"]["median"], 2
                )
        out["multi_turn_hit_rate"] = median_of([r["multi_turn"]["hit_rate"] for r in on])
        out["random"] = []
        for i, first in enumerate(on[0]["random"]):
            row: dict = {"concurrency": first["concurrency"]}
            for label, key, stat in (
                ("all", "ttft_ms", "mean"),
                ("first", "ttft_ms_first", "mean"),
                ("rest", "ttft_ms_rest", "mean"),
            ):
                per = {
                    name: [r["random"][i].get(key, {}).get(stat) for r in runs]
                    for name, runs in (("cache", on), ("no_cache", off))
                }
                if None in per["cache"] + per["no_cache"]:
                    continue
                row[f"ttft_ms_{label}"] = {name: median_of(x) for name, x in per.items()}
                pairs = [100 * (c / n - 1) for c, n in zip(per["cache"], per["no_cache"])]
                row[f"cache_overhead_pct_{label}"] = median_of([round(p, 2) for p in pairs])
            out["random"].append(row)
    for name, res in v.items():
        per_run = [r["multi_turn"]["phases_turns_2_plus"] for r in res["runs"]]
        keys = [k for k, x in per_run[0].items() if isinstance(x, (int, float))]
        medians = {k: median_of([p.get(k) for p in per_run])["median"] for k in keys}
        out.setdefault("phases_turns_2_plus", {})[name] = {"median": medians, "runs": per_run}
    servers = report.get("servers", {})
    single = servers.get("single", {}).get("ttft_ms_turns_2_plus", {}).get("mean")
    pd = servers.get("pd", {}).get("ttft_ms_turns_2_plus", {}).get("mean")
    if single and pd:
        out["pd_over_single_turns_2_plus"] = round(pd / single, 2)
    cached = servers.get("pd_decode_cache", {}).get("ttft_ms_turns_2_plus", {}).get("mean")
    if single and cached:
        out["pd_decode_cache_over_single_turns_2_plus"] = round(cached / single, 2)
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    if a.child_out is not None:
        a.child_out.write_text(json.dumps(run_in_process(a)))
        return
    report: dict = {
        "args": {k: str(v) for k, v in vars(a).items()},
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def write() -> None:
        report["summary"] = summarise(report)
        report["total_s"] = round(time.perf_counter() - t0, 1)
        a.out.write_text(json.dumps(report, indent=2) + "\n")

    report["variants"] = {} if a.pd_only else run_child([x for x in argv if x != "--pd"], a)
    write()
    for name, res in report["variants"].items():
        for r, run in enumerate(res["runs"]):
            print(json.dumps({"variant": name, "run": r, "multi_turn": run["multi_turn"]}))
            print(json.dumps({"variant": name, "run": r, "random": run["random"]}), flush=True)
    if a.pd or a.pd_only:
        logs = a.out.parent / (a.out.stem + "_logs")
        logs.mkdir(parents=True, exist_ok=True)
        report["servers"] = run_servers(a, logs)
        write()
    print(json.dumps({"summary": report["summary"], "total_s": report["total_s"]}), flush=True)


if __name__ == "__main__":
    main()

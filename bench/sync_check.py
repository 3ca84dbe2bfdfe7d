"""Host syncs on the engine's step launches, on CUDA. The overlap scheduler (scheduler.py) helps
only if launching step N+1 never waits for the device, which is still running step N.

    python -m bench.sync_check --out "$OUT" [--preset bench] [--prompt-len 1024]
        [--prefill-requests 2] [--decode-batch 8] [--sleep-ms 500]

Builds --preset with random weights (bench.fast_path.make_model), a pool, decode CUDA graphs up to
--decode-batch and the Scheduler as a worker runs it (overlap on, the compute stream), runs the
workload below once to compile and tune every kernel it meets, then again with one launch of each
path watched (Scheduler._launch: scheduling and memory, the inputs, the forward, the sampling, all
queued on the device):
- prefill: --prefill-requests prompts of --prompt-len tokens, one batch;
- decode_graphs, decode_eager (graphs off for that launch): --decode-batch running requests, half
  greedy and half sampled (temperature, top-k, top-p), each last token still pending on the device
  (read as FUTURE), so the step before is in flight, as under overlap.
check() on a scheduler with EAGLE (tests/test_gpu.py) watches its overlapped decode steps (y and n
FUTURE, acceptance on the device); its prefill steps run sync by design and are not watched.
A watched launch is queued behind a --sleep-ms device sleep, and two things are recorded:
- syncs: torch.cuda.set_sync_debug_mode("warn")'s warnings (.item(), .tolist(), blocking copies,
  a 0-dim device index, ...), each site as the innermost frames of this repository and of fla;
- blocked: whether the sleep had finished by the time the launch returned (an event behind it
  had been reached). A launch that waited for the device in any way (also one torch does not
  flag, e.g. a non-blocking copy from pageable memory that the driver staged) is blocked, and
  its launch_ms includes the sleep. So is one whose host work outlasted the sleep, and one that
  launched more kernels than the device queues (about a thousand pending launches): the CLI
  traces each watched launch (WaitTracer) and names, for a blocked one, the call that was
  running when the sleep ended (waited_in), which tells these apart.
The JSON (printed, and written to --out: a file, or sync_check.json in a directory) has, per path,
syncs, sites, blocked, launch_ms (the host's time to launch the step, traced), sleep_ms (the
sleep as the device timed it) and waited_in, and the seconds each phase took. check() is also
what tests/test_gpu.py runs on the tiny model (untraced).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import warnings
import zlib
from collections import Counter
from pathlib import Path

import torch

from serving.engine.request import SchedulerConfig
from serving.engine.scheduler import Scheduler
from serving.executor.model_runner import ModelRunner
from serving.executor.sampler import Sampler
from serving.executor.streams import use_compute_stream
from serving.memory.pool import MemoryPool, PoolPlan
from serving.protocol import GenerateRequest
from serving.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[1]
DECODE_PROMPT = 48  # tokens of each decode request's prompt
DECODE_TOKENS = 24  # output tokens of each decode request: past the watched steps
SITES_WALKED = 64  # syncs per watched launch whose call site is looked up


def _site() -> str:
    """The innermost frames of ours and of fla's on the stack, down to one outside this file
    (a sync raised between the watched launch's frames, in a deallocation say, names the line
    of this file it surfaced at)."""
    picked: list[str] = []
    for frame in reversed(traceback.extract_stack()[:-2]):  # not _site, not the warning hook
        path = Path(frame.filename)
        if path == Path(__file__).resolve():
            picked.append(f"sync_check.py:{frame.lineno} ({frame.name})")
            continue
        if "/fla/" in frame.filename:
            if not picked:
                picked.append(f"fla/{frame.filename.split('/fla/', 1)[1]}:{frame.lineno}")
        elif "site-packages" not in frame.filename and path.is_relative_to(REPO):
            picked.append(f"{path.relative_to(REPO)}:{frame.lineno} ({frame.name})")
            break
    return " <- ".join(picked) or "unattributed"


def _cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / start.elapsed_time(end)


class WaitTracer:
    """sys.setprofile hook for one watched launch: the call (a Python function, or a builtin
    such as a torch op or a kernel launch) that was running when `done()` turned True, found
    as the first call to return after it did, with its enclosing calls of ours. Its ms tell a
    wait (about the rest of the sleep) from host work that merely outlasted the sleep (its own
    cost). A kernel launch there, not a copy or a sync, means the device's queue of pending
    launches was full behind the sleep: a launch of more kernels than that queue holds (about a
    thousand) waits for the device to drain it, sync or none."""

    def __init__(self, done) -> None:
        self.done = done
        # the calls under way: (caller's or callee's code, its line then, builtin or None,
        # start); named only once found, so each event costs a tuple
        self.stack: list[tuple] = []
        self.found: dict | None = None

    def __call__(self, frame, event: str, arg) -> None:
        if self.found is not None:
            return
        if event in ("call", "c_call"):
            builtin = arg if event == "c_call" else None
            self.stack.append((frame.f_code, frame.f_lineno, builtin, time.perf_counter()))
        elif event in ("return", "c_return", "c_exception") and self.stack:
            call = self.stack.pop()
            if self.done():
                self.found = {
                    "call": _call_name(*call[:3]),
                    "ms": round(1000 * (time.perf_counter() - call[3]), 2),
                    "within": [_call_name(*c[:3]) for c in reversed(self.stack) if _ours(c[0])][:4],
                }


def _call_name(code, line: int, builtin) -> str:
    """`qualname (file:line)` of a Python call, `builtin (from file:line)` of a builtin's."""
    filename = code.co_filename
    if Path(filename).is_relative_to(REPO) and "site-packages" not in filename:
        filename = str(Path(filename).relative_to(REPO))
    else:
        filename = filename.split("site-packages/", 1)[-1]
    if builtin is not None:
        return f"{getattr(builtin, '__qualname__', repr(builtin))} (from {filename}:{line})"
    return f"{code.co_qualname} ({filename}:{line})"


def _ours(code) -> bool:
    """Whether code is this repository's (outside site-packages) or fla's."""
    filename = code.co_filename
    if "/fla/" in filename:
        return True
    return "site-packages" not in filename and Path(filename).is_relative_to(REPO)


class Watch:
    """Wraps a scheduler's _launch; while `path` is set, the next launch is watched and its
    record stored under that name."""

    def __init__(self, sched: Scheduler, sleep_ms: float, trace: bool = False) -> None:
        self.sched, self.launch, self.trace = sched, sched._launch, trace
        self.sleep_cycles = int(sleep_ms * _cycles_per_ms())
        self.path: str | None = None
        self.records: dict[str, dict] = {}
        sched._launch = self._watched

    def _watched(self):
        if self.path is None:
            return self.launch()
        path, self.path = self.path, None
        ahead = torch.cuda.Event(enable_timing=True)
        ahead.record()
        torch.cuda._sleep(self.sleep_cycles)  # stands for more of the step in flight
        behind = torch.cuda.Event(enable_timing=True)
        behind.record()
        sites: Counter[str] = Counter()
        with warnings.catch_warnings():
            warnings.simplefilter("always")

            def show(message, category, filename, lineno, file=None, line=None):
                # a stack walk per sync made a launch that autotunes (thousands of syncs in
                # triton's do_bench) run for minutes: only the first SITES_WALKED are walked
                # the sync warning's own words: the first set_sync_debug_mode also warns once
                # that the mode "does not yet detect all synchronizing operations"
                if "called a synchronizing" in str(message):
                    walked = sum(sites.values()) < SITES_WALKED
                    sites[_site() if walked else "not attributed (over SITES_WALKED)"] += 1

            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            tracer = WaitTracer(behind.query)
            started = time.perf_counter()
            if self.trace:  # costs host time: the launch takes longer than it would
                sys.setprofile(tracer)
            try:
                launched, batch = self.launch()
            finally:
                if self.trace:
                    sys.setprofile(None)
                launch_ms = 1000 * (time.perf_counter() - started)
                torch.cuda.set_sync_debug_mode("default")
        blocked = behind.query()
        behind.synchronize()
        self.records[path] = {
            "requests": 0 if batch is None else len(getattr(batch, "plan", None) or batch.reqs),
            "syncs": sum(sites.values()),
            "sites": dict(sites.most_common()),
            "blocked": blocked,
            "launch_ms": round(launch_ms, 2),
            # the sleep as the device ran it (its cycles per ms are measured once, at a clock
            # that may differ): a launch slower than this on the host is blocked either way
            "sleep_ms": round(ahead.elapsed_time(behind), 2),
            "waited_in": tracer.found if blocked and self.trace else None,
        }
        return launched, batch


def _add(sched: Scheduler, tag: str, n: int, length: int, max_tokens: int, sampled: int) -> None:
    """n requests of `length` random tokens; the last `sampled` of them sample."""
    g = torch.Generator().manual_seed(zlib.crc32(tag.encode()))
    vocab = sched.pool.config.vocab_size
    for i in range(n):
        params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        if i >= n - sampled:
            params = SamplingParams(
                max_new_tokens=max_tokens, temperature=0.8, top_k=50, top_p=0.9, ignore_eos=True
            )
        prompt = torch.randint(0, vocab, (length,), generator=g).tolist()
        sched.add(GenerateRequest(f"{tag}-{i}", prompt, params))


def _finish(sched: Scheduler) -> None:
    while sched.has_work:
        sched.step()


def _workload(sched: Scheduler, watch: Watch, prompt_len: int, prefills: int, batch: int, tag):
    """The prefill launch, then the decode launches with and without graphs (watched when
    watch.records is to be filled: `tag` is "check")."""
    watching = tag == "check"
    _add(sched, f"{tag}-prefill", prefills, prompt_len, 2, 0)
    # EAGLE's prefill steps run sync by design (scheduler.py): only its decode steps are watched
    watch.path = "prefill" if watching and sched.spec is None else None
    sched.step()  # launches the prefill batch: nothing else is queued
    _finish(sched)
    _add(sched, f"{tag}-decode", batch, DECODE_PROMPT, DECODE_TOKENS, batch // 2)
    # every request running, a step in flight: the next launches read FUTURE tokens
    for _ in range(batch + 8):
        if not sched.prefill.queued and len(sched.running) == batch and sched.inflight:
            break
        sched.step()
    else:
        raise RuntimeError(f"{batch} requests never ran at once (--max-running-requests?)")
    sched.step()  # one more decode step: the decode inputs at steady state
    holder = sched.runner if sched.spec is None else sched.spec  # whose .graphs decode replays
    if holder.graphs is not None:
        watch.path = "decode_graphs" if watching else None
        sched.step()
    graphs, holder.graphs = holder.graphs, None
    try:
        watch.path = "decode_eager" if watching else None
        sched.step()
    finally:
        holder.graphs = graphs
    _finish(sched)


def check(
    sched: Scheduler,
    prompt_len: int,
    prefill_requests: int,
    decode_batch: int,
    sleep_ms: float,
    trace: bool = False,
) -> tuple[dict[str, dict], dict[str, float]]:
    """(per path: syncs, sites, blocked, launch_ms, sleep_ms, waited_in; seconds per phase)
    for a CUDA scheduler with the overlap scheduler on and decode graphs up to decode_batch
    (or none). trace: find where a blocked launch waited (WaitTracer; slows the launches)."""
    assert sched.cfg.overlap, "the check is about the overlap scheduler's launches"
    watch = Watch(sched, sleep_ms, trace)
    seconds = {}
    try:
        for tag in ("warmup", "check"):
            started = time.monotonic()
            _workload(sched, watch, prompt_len, prefill_requests, decode_batch, tag)
            torch.cuda.synchronize()
            seconds[tag] = round(time.monotonic() - started, 1)
    finally:
        del sched._launch  # the class's again
    sched.check_invariants()
    return watch.records, seconds


def build(args: argparse.Namespace) -> Scheduler:
    from bench.fast_path import make_model

    use_compute_stream(args.device)
    config, model, _ = make_model(args.preset, args.device)  # the draft is not used
    rows = max(args.prefill_requests, args.decode_batch) + 2
    context = args.prompt_len + 2 * DECODE_TOKENS
    plan = PoolPlan(rows=rows, pages=rows * -(-context // 64), page_size=64, max_context=context)
    pool = MemoryPool(config, plan, model.dtype, args.device)
    runner = ModelRunner(model, pool)
    runner.enable_decode_graphs(args.decode_batch)
    tokens = args.prefill_requests * args.prompt_len
    return Scheduler(
        runner,
        pool,
        Sampler(config.vocab_size, args.device),
        SchedulerConfig(rows, tokens, tokens, context),
        frozenset(config.eos_token_ids),
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", help="a JSON file, or a directory for sync_check.json")
    ap.add_argument("--preset", default="bench", help="serving.tools.tiny_model's presets")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--prefill-requests", type=int, default=2)
    ap.add_argument("--decode-batch", type=int, default=8)
    ap.add_argument("--sleep-ms", type=float, default=500, help="device sleep before a launch")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    started = time.monotonic()
    sched = build(args)
    torch.cuda.synchronize()
    built = round(time.monotonic() - started, 1)
    paths, seconds = check(
        sched, args.prompt_len, args.prefill_requests, args.decode_batch, args.sleep_ms, True
    )
    report = {
        "tool": "sync_check",
        "preset": args.preset,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "prompt_len": args.prompt_len,
        "prefill_requests": args.prefill_requests,
        "decode_batch": args.decode_batch,
        "sleep_ms": args.sleep_ms,
        "paths": paths,
        "seconds": {"build": built, **seconds},
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        out = Path(args.out)
        (out / "sync_check.json" if out.is_dir() else out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What a prefix-cache hit costs the host: torch ops dispatched per admitted hit, counted on the
CPU with a TorchDispatchMode, where the GPU's cost of a hit's step is mostly host work.

    python -m bench.hit_ops --model-path serving/assets/small_model [--hits 4,12]

Each conversation's first turn (a shared --system-len-token prompt + --user-len own tokens,
--output-len greedy tokens) runs to the end; then every conversation's second turn (its whole
history + --user-len new tokens: a hit) is submitted at once and the one step that admits them
is counted, for each count of --hits in its own engine. Per hit = the difference between the two
counts over the difference in hits (the step's fixed cost drops out).

Phases of the counted step: `admission` (PrefillManager.schedule: match, rows, pages, state
restores, snapshot plan), `forward` (ModelRunner.forward) and `launch_rest` (the rest of
PrefillManager.launch: sampling, cache inserts). A kernel (a function of kernels/*, one or a few
launches on the GPU, a Python loop on the CPU's references) counts as one op, and so does the
indexer's scoring (`_score_heads`, and `_score_ragged` around it where it exists: one Triton
launch on the GPU, a loop over requests in the reference), so the forward's count is the GPU's
launches, not the CPU references' arithmetic. `host_ms`: each phase's CPU wall time (the CPU
runs every op as it is dispatched, so it includes the arithmetic; a comparison, not a figure).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kernels.indexer
import kernels.kda
import kernels.mhc
import kernels.moe
import kernels.norm
import kernels.sparse_mla
import serving.layers.attention.dsa
import serving.layers.norm
from serving.engine.build import build_engine
from serving.engine.scheduler import Scheduler
from serving.protocol import GenerateRequest
from serving.sampling_params import SamplingParams
from serving.server_args import ServerArgs


class OpCounter(TorchDispatchMode):
    """Counts aten ops by phase; a call of a wrapped kernel counts once, its insides not."""

    def __init__(self) -> None:
        super().__init__()
        self.phase: str | None = None
        self.inside_kernel = 0
        self.ops: dict[str, Counter] = {}

    def count(self, name: str) -> None:
        if self.phase is not None and not self.inside_kernel:
            self.ops.setdefault(self.phase, Counter())[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def wrap_kernels(counter: OpCounter) -> list:
    """Make every kernel function count as one op; returns the (owner, name, original) to undo."""
    undo = []

    def wrap(owner, name: str) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            counter.count(f"kernel:{name}")
            counter.inside_kernel += 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter.inside_kernel -= 1

        undo.append((owner, name, fn))
        setattr(owner, name, counted)

    for module in (
        kernels.indexer, kernels.kda, kernels.mhc, kernels.moe, kernels.norm, kernels.sparse_mla
    ):  # fmt: skip
        for name, fn in vars(module).items():
            if inspect.isfunction(fn) and fn.__module__ == module.__name__ and name[0] != "_":
                wrap(module, name)
    wrap(serving.layers.norm, "rms_norm")
    wrap(serving.layers.attention.dsa, "_score_heads")
    if hasattr(serving.layers.attention.dsa, "_score_ragged"):  # one Triton call on the GPU
        wrap(serving.layers.attention.dsa, "_score_ragged")
    return undo


def phased(counter: OpCounter, times: Counter, phase: str, fn):
    """fn, its ops counted and its wall time taken under `phase` (exclusive of inner phases)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        outer, counter.phase = counter.phase, phase
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = time.perf_counter() - start
            times[phase] += spent
            if outer is not None:
                times[outer] -= spent
            counter.phase = outer

    return run


def greedy(rid: str, ids: list[int], n: int) -> GenerateRequest:
    return GenerateRequest(rid, ids, SamplingParams(max_new_tokens=n, temperature=0.0))


def drain(sched: Scheduler) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while sched.has_work:
        for o in sched.step():
            out.setdefault(o.rid, []).extend(o.new_token_ids)
    return out


def count_hits(a: argparse.Namespace, hits: int) -> dict:
    flags = ["--model-path", a.model_path, "--device", "cpu", "--skip-server-warmup"]
    args = ServerArgs.from_cli([*flags, *a.worker_args.split()])
    args.validate()
    sched = build_engine(args)[0]
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(10, 1000, (n,), generator=g).tolist()  # noqa: E731
    system = rand(a.system_len)
    first = {f"c{c}": system + rand(a.user_len) for c in range(hits)}
    # one conversation first, so the others hit the system prompt, as the bench's turn 1 does
    for rid, ids in first.items():
        sched.add(greedy(rid, ids, a.output_len))
        if rid == "c0":
            replies = drain(sched)
    replies.update(drain(sched))
    second = {rid: ids + replies[rid] + rand(a.user_len) for rid, ids in first.items()}

    counter, times = OpCounter(), Counter()
    prefill, plans = sched.prefill, []
    schedule = prefill.schedule

    def schedule_recorded(running: int):
        batch = schedule(running)
        plans.append(0 if batch is None else len(batch.plan))
        return batch

    prefill.schedule = phased(counter, times, "admission", schedule_recorded)
    prefill.launch = phased(counter, times, "launch_rest", prefill.launch)
    sched.runner.forward = phased(counter, times, "forward", sched.runner.forward)
    undo = wrap_kernels(counter)
    cached_before = sched.stats.cache_hit_tokens_total
    try:
        for rid, ids in second.items():
            sched.add(greedy(rid + "-t2", ids, 1))
        with counter:
            sched.step()  # the step that admits every second turn
    finally:
        for owner, name, fn in undo:
            setattr(owner, name, fn)
    drain(sched)
    return {
        "hits": hits,
        "admitted_in_step": plans[0],
        "cached_tokens": sched.stats.cache_hit_tokens_total - cached_before,
        "ops": {phase: sum(c.values()) for phase, c in counter.ops.items()},
        "ops_by_name": {phase: dict(c.most_common()) for phase, c in counter.ops.items()},
        "host_ms": {phase: round(t * 1e3, 2) for phase, t in times.items()},
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.hit_ops", description=__doc__)
    ap.add_argument("--model-path", default="serving/assets/small_model")
    ap.add_argument("--worker-args", default="", help="more server flags")
    ap.add_argument("--hits", default="4,12", help="two hit counts, one engine each")
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--user-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=4)
    ap.add_argument("--verbose", action="store_true", help="ops by name too")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    runs = [count_hits(a, int(h)) for h in a.hits.split(",")]
    lo, hi = runs[0], runs[-1]
    span = hi["hits"] - lo["hits"]
    per_hit = {
        phase: round((hi["ops"].get(phase, 0) - lo["ops"].get(phase, 0)) / span, 1)
        for phase in hi["ops"]
    } if span else {}  # fmt: skip
    if not a.verbose:
        for r in runs:
            r.pop("ops_by_name")
    print(json.dumps({"runs": runs, "ops_per_hit": per_hit}, indent=1))


if __name__ == "__main__":
    main()

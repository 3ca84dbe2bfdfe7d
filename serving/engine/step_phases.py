"""Where a prefill step's time goes (issue 47: a prefix-cache hit's TTFT on an ordinary host).
A record per prefill step, kept while PrefillManager.phases is a list (the prefix-cache bench
sets it; None, the default, records nothing). Recording costs a few clock reads per step, two
CUDA events and a sync-debug flag around the forward.

Host phases, in the order a step meets them (ms):
    match          radix-tree matches of the step's admissions (Admission.match_s)
    admit          the rest of admission on the host: locks, free lists, eviction, page lists
    plan_save      picking the chunks' snapshot points
    pool_apply     launching admission's device work in one batch (row resets, page maps, state
                   restores: MemoryPool.batched)
    forward_host   the forward's launch (ModelRunner.forward), any host sync inside it included
    launch_rest    the rest of the launch: first-token draws, cache inserts
    between        launch done -> processing starts: the next step's launch under the overlap
                   scheduler, and the wait below
    wait           the host blocked on the step's device work (its event) before processing
    process        committing the first tokens
Device: forward_device (CUDA events around the forward; None off CUDA). forward_syncs: the host
syncs torch flagged inside the forward (CUDA only). A hit's TTFT in its step is about
schedule (match + admit + plan_save + pool_apply) + forward_host + launch_rest + between +
process, of which the device needs forward_device.
"""

from __future__ import annotations

import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

PHASES = (
    "match",
    "admit",
    "plan_save",
    "pool_apply",
    "forward_host",
    "launch_rest",
    "between",
    "wait",
    "process",
)


@dataclass
class StepPhases:
    rids: list[str] = field(default_factory=list)  # requests admitted in the step
    hits: int = 0  # of them, those that started from a cached prefix
    cached_tokens: int = 0
    new_tokens: int = 0
    ms: dict[str, float] = field(default_factory=dict)
    forward_device_ms: float | None = None
    forward_syncs: int | None = None
    # in flight: the forward's CUDA events, and when the launch ended
    events: tuple | None = None
    launched_at: float = 0.0

    def add(self, phase: str, seconds: float) -> None:
        self.ms[phase] = self.ms.get(phase, 0.0) + seconds * 1e3

    def settle(self, processed_at: float, waited: float) -> None:
        """After the step's processing started: the device time and the time between."""
        if self.events is not None:
            start, end = self.events
            self.forward_device_ms = start.elapsed_time(end)
            self.events = None
        self.add("between", processed_at - self.launched_at)
        self.add("wait", waited)

    def to_json(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("events", "launched_at", "ms")}
        out.update({f"{p}_ms": round(self.ms.get(p, 0.0), 3) for p in PHASES})
        return out


@contextmanager
def timed(record: StepPhases | None, phase: str):
    """The block's wall time added to `phase` of `record` (None: not recorded)."""
    if record is None:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        record.add(phase, time.perf_counter() - start)


@contextmanager
def forward_watch(record: StepPhases | None, device: torch.device):
    """The forward's host time, its device time (CUDA events, read once the step completed) and
    the host syncs torch flags inside it (None: not recorded)."""
    if record is None or device.type != "cuda":
        with timed(record, "forward_host"):
            yield
        return
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        start.record()
        try:
            with timed(record, "forward_host"):
                yield
        finally:
            end.record()
            torch.cuda.set_sync_debug_mode(before)
    record.events = (start, end)
    record.forward_syncs = sum("synchroniz" in str(w.message) for w in caught)


def phase_means(records: list[StepPhases]) -> dict:
    """Mean ms per phase over `records`, with their count and mean hits per step."""
    if not records:
        return {"steps": 0}
    n = len(records)
    mean = lambda xs: round(sum(xs) / len(xs), 3) if xs else None  # noqa: E731
    out = {
        "steps": n,
        "hits_per_step": mean([r.hits for r in records]),
        "new_tokens_per_step": mean([r.new_tokens for r in records]),
    }
    for p in PHASES:
        out[f"{p}_ms"] = mean([r.ms.get(p, 0.0) for r in records])
    device = [r.forward_device_ms for r in records if r.forward_device_ms is not None]
    out["forward_device_ms"] = mean(device)
    syncs = [r.forward_syncs for r in records if r.forward_syncs is not None]
    out["forward_syncs"] = mean(syncs)
    host = ("match", "admit", "plan_save", "pool_apply", "forward_host", "launch_rest")
    out["launch_host_ms"] = round(sum(out[f"{p}_ms"] for p in host), 3)
    return out

"""SGLang's /start_profile and /stop_profile inside the scheduler process: the torch profiler on
every rank, one trace per rank, written when profiling stops.

RankProfiler is one rank's profiler (rank 0 and every follower hold one). ProfileControl is rank
0's: it starts and stops its own and, under TP/EP, the followers' through the step fanout
(Fanout.ask_profilers), so every rank profiles the same steps; a follower answers
each order with its error or its trace's path. Traces are SGLang's
`<prefix-><profile id>-TP-<rank>[-EP-<rank>].trace.json.gz` (gzip-compressed Chrome trace JSON).
On rank 0 each scheduler step is a STEP_RANGE range in the trace (serving.tools.trace_summary
counts and times them); followers mark none.

Hazard: a trace is only written by stop; a profiler left running keeps every event in memory,
so `num_steps` counts down in `after_step` and stops it by itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import torch

from serving.executor.fanout import ONE_RANK, Fanout
from serving.protocol import StartProfile

log = logging.getLogger(__name__)

ACTIVITIES = ("CPU", "GPU")
IN_PROGRESS = "Profiling is already in progress. Call /stop_profile first."
NOT_IN_PROGRESS = "Profiling is not in progress. Call /start_profile first."
STEP_RANGE = "scheduler.step"  # record_function name of one scheduler step in a trace


def default_dir(profile_dir: str | None) -> str:
    """--profile-dir, else $SGLANG_TORCH_PROFILER_DIR, else /tmp (SGLang's default)."""
    return profile_dir or os.environ.get("SGLANG_TORCH_PROFILER_DIR") or "/tmp"


class RankProfiler:
    """One rank's torch profiler. `name` is the rank's part of the file name (TP-r[-EP-r])."""

    def __init__(self, name: str, profile_dir: str | None) -> None:
        self.name, self.default_dir = name, default_dir(profile_dir)
        self.profile: torch.profiler.profile | None = None
        self.path: Path | None = None

    @property
    def active(self) -> bool:
        return self.profile is not None

    def start(self, req: StartProfile) -> str | None:
        """Start profiling; the reason when it cannot (nothing changes then)."""
        if self.profile is not None:
            return IN_PROGRESS
        unknown = [a for a in req.activities if a not in ACTIVITIES]
        if unknown or not req.activities:
            return f"activities {req.activities}: supported here are {list(ACTIVITIES)}"
        activities = []
        if "CPU" in req.activities:
            activities.append(torch.profiler.ProfilerActivity.CPU)
        if "GPU" in req.activities and torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if not activities:
            return f"activities {req.activities}: no CUDA device here; ask for CPU"
        out = Path(req.output_dir or self.default_dir).expanduser()
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            return f"output_dir {str(out)!r}: cannot create it ({e.strerror or e})"
        if not os.access(out, os.W_OK | os.X_OK):
            return f"output_dir {str(out)!r}: not writable by the server"
        prefix = f"{req.profile_prefix}-" if req.profile_prefix else ""
        self.path = out / f"{prefix}{req.profile_id}-{self.name}.trace.json.gz"
        self.profile = torch.profiler.profile(
            activities=activities, with_stack=req.with_stack, record_shapes=req.record_shapes
        )
        self.profile.start()
        return None

    def stop(self, write: bool = True) -> tuple[str | None, str]:
        """Stop and (with `write`) export the trace: (error, the trace's path)."""
        if self.profile is None:
            return NOT_IN_PROGRESS, ""
        profile, path, self.profile = self.profile, self.path, None
        profile.stop()
        if not write:
            return None, ""
        try:
            profile.export_chrome_trace(str(path))  # a .gz name: torch writes it gzipped
        except OSError as e:
            return f"could not write {path}: {e.strerror or e}", ""
        return None, str(path)

    def handle(self, order: tuple) -> tuple[str | None, str]:
        """A follower's answer to rank 0's ("start", req) / ("stop",) / ("cancel",)."""
        if order[0] == "start":
            return self.start(order[1]), ""
        return self.stop(write=order[0] == "stop")


def rank_name(rank: int, ep_size: int) -> str:
    return f"TP-{rank}-EP-{rank}" if ep_size > 1 else f"TP-{rank}"


class ProfileControl:
    """Rank 0's: its own RankProfiler plus the followers' (through `fanout`)."""

    def __init__(self, local: RankProfiler, fanout: Fanout = ONE_RANK) -> None:
        self.local, self.fanout = local, fanout
        self.steps_left: int | None = None

    def _followers(self, order: tuple) -> list[tuple[str | None, str]]:
        return self.fanout.ask_profilers(order)

    def start(self, req: StartProfile) -> str | None:
        error = self.local.start(req)
        if error is not None:
            return error
        failed = [e for e, _ in self._followers(("start", req)) if e is not None]
        if failed:  # every rank profiles or none
            self.local.stop(write=False)
            self._followers(("cancel",))
            return failed[0]
        self.steps_left = req.num_steps
        log.info(
            "Profiling starts. Traces will be saved to: %s (%s)",
            self.local.path.parent,
            f"{req.num_steps} steps" if req.num_steps else "until /stop_profile",
        )
        return None

    def stop(self) -> tuple[str | None, str]:
        """(error, the trace files written, one per rank)."""
        if not self.local.active:
            return NOT_IN_PROGRESS, ""
        self.steps_left = None
        results = [self.local.stop(), *self._followers(("stop",))]
        errors = [e for e, _ in results if e is not None]
        paths = [p for _, p in results if p]
        log.info("Profiling done. Traces are saved to: %s", ", ".join(paths) or "(none)")
        if errors:
            return "; ".join(errors), ", ".join(paths)
        return None, ", ".join(paths)

    def step_range(self) -> contextlib.AbstractContextManager:
        """Wrap one scheduler step: a STEP_RANGE range while profiling, nothing otherwise."""
        if not self.local.active:
            return contextlib.nullcontext()
        return torch.profiler.record_function(STEP_RANGE)

    def after_step(self) -> None:
        """Call after every forward step: `num_steps` profiling stops by itself."""
        if self.steps_left is None:
            return
        self.steps_left -= 1
        if self.steps_left <= 0:
            error, _ = self.stop()
            if error is not None:
                log.error("profiling stopped after its steps: %s", error)

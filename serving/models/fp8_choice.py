"""Which block-FP8 projections run FP8 on this device, and the record of what runs FP8.

The rule (--fp8-linears timed, the default): on CUDA, at load, every distinct weight shape
[N, K] of the projections that would hold FP8 (the Linears with a `kind`, minus the kinds in
--fp8-keep-bf16) is timed once on random data, FP8 against dense: block_fp8_linear (activation
quantization plus the GEMM it picks for the shape) against F.linear in the model's dtype, at
TOKENS (a decode-sized and a prefill-sized count), as device time under a CUDA graph
(kernels/triton/fp8.time_linear). A shape runs FP8 only where FP8 is faster at every count;
otherwise every weight of that shape is dequantized to the model's dtype at load, as
--fp8-keep-bf16 does for a whole kind. Each shape's line is logged at start-up (shape, the
projections it serves, FP8 and dense microseconds, the choice), and /get_server_info lists
which weights run FP8 and why (`summary`).

Why both counts: FP8 pays an activation quantization per call; on the H200 it loses at 8,192
tokens (0.2-0.64x bf16) for the small projections (N <= 512 or K = 128), and at 32 tokens
torch._scaled_mm's block-scaled GEMM loses for every N below 8,192 (0.4-0.9x; MLA o, 4096 x
16384: 52 against 43 us), so only KDA q/k/v, MLA q_b and the dense gate/up at TP1 win both
(docs/notebook/2026-11-29_2026-12-03.md, block FP8, "Session 6"). A shape that loses either goes
dense: the dense path is also the more accurate one. The routed experts are not timed: the fused
FP8 MoE measured 1.4-1.8x bf16 from 1 to 8,192 tokens, and they are most of the weight bytes.

Rank 0 times and broadcasts its choice: every rank holds the same shapes and must hold the same
dtypes (the plan, the weight bytes per GPU). --fp8-linears all skips the timing (every
projection FP8: the kernel and accuracy checks). Nothing is timed on the CPU (it dequantizes
everything at load), with PDSERVE_TORCH_KERNELS=1 (the oracle) or for a bf16 checkpoint.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

import kernels
from serving.distributed import broadcast_object, state

log = logging.getLogger(__name__)

# (decode-sized, prefill-sized): the seed's largest decode graph batch, a --chunked-prefill-size
TOKENS = (32, 8192)
POLICIES = ("timed", "all")


def fp8_wins(fp8_us: Iterable[float], dense_us: Iterable[float]) -> bool:
    """The rule: FP8 strictly faster than dense at every timed token count."""
    fp8_us, dense_us = tuple(fp8_us), tuple(dense_us)
    if len(fp8_us) != len(dense_us) or not fp8_us:
        raise ValueError(f"timings of different token counts: {fp8_us} vs {dense_us}")
    return all(f < d for f, d in zip(fp8_us, dense_us))


@dataclass(frozen=True)
class ShapeTiming:
    """One weight shape timed at TOKENS: microseconds per call, FP8 and dense."""

    shape: tuple[int, int]
    fp8_us: tuple[float, ...]
    dense_us: tuple[float, ...]
    gemm: str  # the FP8 GEMM block_fp8_linear picked: "scaled_mm" or "triton"

    @property
    def fp8(self) -> bool:
        return fp8_wins(self.fp8_us, self.dense_us)


@dataclass(frozen=True)
class LinearChoice:
    """The decision for one model: policy, and the timings it came from (none: not timed)."""

    policy: str
    timings: tuple[ShapeTiming, ...] = ()
    tokens: tuple[int, ...] = TOKENS

    @property
    def dense_shapes(self) -> frozenset[tuple[int, int]]:
        """The shapes dequantized at load because FP8 was not faster."""
        return frozenset(t.shape for t in self.timings if not t.fp8)

    def timing(self, shape: tuple[int, int]) -> ShapeTiming | None:
        return next((t for t in self.timings if t.shape == shape), None)


def linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """The weight shape a projection with FP8 kernels is timed by (None: the routed experts)."""
    if getattr(module, "kind", None) in (None, "moe"):
        return None
    return tuple(module.weight.shape)  # type: ignore[return-value]


def choose_linears(
    shapes: dict[tuple[int, int], list[str]], dtype: torch.dtype, device, policy: str
) -> LinearChoice:
    """Decide (see the module doc) for `shapes`: weight shape -> the module paths it serves."""
    if policy not in POLICIES:
        raise ValueError(f"--fp8-linears {policy!r}: choose from {', '.join(POLICIES)}")
    if policy == "all" or not shapes or not can_time(device):
        return LinearChoice(policy)
    ps = state()
    timings = None
    if ps.processes == 1 or ps.rank == 0:
        timings = tuple(measure(shape, dtype, device) for shape in sorted(shapes))
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()  # the timing graphs' pools: not kept from the KV pool
    timings = broadcast_object(timings)
    choice = LinearChoice(policy, timings)
    dense = str(dtype).removeprefix("torch.")
    for t in timings:
        log.info(
            "FP8 linear %dx%d (%s): FP8 %s us (%s), %s %s us at %s tokens: %s",
            *t.shape,
            _names(shapes[t.shape]),
            "/".join(f"{us:.1f}" for us in t.fp8_us),
            t.gemm,
            dense,
            "/".join(f"{us:.1f}" for us in t.dense_us),
            "/".join(map(str, choice.tokens)),
            "runs FP8" if t.fp8 else f"FP8 not faster: dequantized to {dense} at load",
        )
    return choice


def can_time(device) -> bool:
    """Whether the FP8 kernels run here and can be timed (CUDA, the fast path)."""
    return torch.device(device).type == "cuda" and not kernels.TORCH_ONLY


def measure(shape: tuple[int, int], dtype: torch.dtype, device) -> ShapeTiming:
    """One shape timed at TOKENS (kernels/triton/fp8.time_linear)."""
    from kernels.triton.fp8 import scaled_mm_usable, time_linear

    n, k = shape
    runs = [time_linear(n, k, tokens, dtype, device) for tokens in TOKENS]
    gemm = "scaled_mm" if scaled_mm_usable(n, k, dtype, device) else "triton"
    return ShapeTiming(
        shape,
        tuple(round(f, 2) for f, _ in runs),
        tuple(round(d, 2) for _, d in runs),
        gemm,
    )


_LAYER = re.compile(r"^layers\.\d+\.")


def _names(paths: Iterable[str]) -> str:
    """Module paths with their layer index dropped, each once."""
    return ", ".join(sorted({_LAYER.sub("", p) for p in paths}))


def summary(
    modules: dict[str, nn.Module], choice: LinearChoice | None, keep_bf16: frozenset[str]
) -> dict | None:
    """/get_server_info's record of the modules with FP8 kernels: per (kind, shape, outcome)
    the projections, how many, whether they run FP8 and why; None for a model with no FP8
    weight held nor decided (a bf16 checkpoint, or any model on the CPU)."""
    groups: dict[tuple, dict] = {}
    for role, root in modules.items():
        for path, module in root.named_modules():
            kind = getattr(module, "kind", None)
            if kind is None:
                continue
            held = getattr(module, "weight_scale_inv", getattr(module, "w13_scale_inv", None))
            shape = linear_shape(module)
            timing = choice.timing(shape) if choice is not None and shape else None
            if timing is not None:
                why = "timed: FP8 faster" if timing.fp8 else "timed: FP8 not faster"
            elif held is None:
                why = "--fp8-keep-bf16" if kind in keep_bf16 else "not FP8 in the checkpoint"
            elif shape is None:
                why = "routed experts: not timed"
            elif choice is not None and choice.policy == "all":
                why = "--fp8-linears all"
            else:
                why = "not timed (no CUDA fast path)"
            weight = module.weight if shape else module.w13
            key = (kind, tuple(weight.shape), held is not None, why)
            entry = groups.setdefault(
                key,
                {
                    "kind": kind,
                    "shape": list(weight.shape),
                    "runs": "fp8" if held is not None else str(weight.dtype).removeprefix("torch."),
                    "why": why,
                    "modules": 0,
                    "names": set(),
                },
            )
            entry["modules"] += 1
            entry["names"].add(("draft." if role == "draft" else "") + _LAYER.sub("", path))
            if timing is not None:
                entry.update(gemm=timing.gemm, fp8_us=timing.fp8_us, dense_us=timing.dense_us)
    if choice is None and not any(e["runs"] == "fp8" for e in groups.values()):
        return None
    for entry in groups.values():
        entry["names"] = sorted(entry["names"])
    return {
        "linears": None if choice is None else choice.policy,
        "keep_bf16": sorted(keep_bf16),
        "tokens": list(TOKENS),
        "weights": sorted(groups.values(), key=lambda e: (e["kind"], e["shape"])),
    }

"""Which block-FP8 projections run FP8 on this device, and the record of what runs FP8.

The rule (--fp8-linears timed, the default): on CUDA, at load, every distinct weight shape
[N, K] that FP8 would run (the Linears with a `kind`, minus the kinds in --fp8-keep-bf16) is
timed once on random data, FP8 against dense: block_fp8_linear (the activation quantization
and the GEMM it runs at that token count: the skinny split-K GEMM up to
kernels/triton/fp8.py's SKINNY_MAX_TOKENS rows, else torch._scaled_mm or the Triton GEMM)
against the dense linear a bf16 weight runs (serving/layers/linear.py: the skinny GEMM up to
SKINNY_DENSE_MAX_TOKENS rows, else cuBLAS), at TOKENS (a decode-sized and a prefill-sized count), as
device time under a CUDA graph (kernels/triton/fp8.time_linear). A projection that is a part of
a StackedProjections is timed at the shape of the stacked GEMM it runs in (linear_shape; the
KDA stack at TP8 is 3344 x 4096, its parts 1024, 128 and 8 rows), and its whole stack runs FP8
or dense together. Where FP8 loses, every weight of that shape is dequantized to the model's
dtype at load, as --fp8-keep-bf16 does for a whole kind. Each shape's line is logged at
start-up (shape, the projections it serves, FP8 and dense microseconds, the GEMMs, the choice),
and /get_server_info lists which weights run FP8 and why (`summary`).

How the two counts weigh (fp8_wins): FP8 runs where it spends less device time per token,
summed over the two counts (us / tokens at 32 plus us / tokens at 8,192), i.e. as if a request
decoded as many tokens as it prefilled. A decode call carries at most 32 tokens and a prefill
call 8,192, so a microsecond lost at decode weighs 256 times one lost at prefill; a prompt 16
times longer than its output still leaves decode 16 times the weight. Why not "faster at both
counts" (the rule before the skinny GEMM): the prefill GEMMs of the small projections that
do not stack still lose to bf16 at 8,192 tokens (0.2-0.7x on the H200, session 6: cuBLASLt
refuses or garbles K <= 256, and the separate activation quantization costs more than the GEMM
saves for N <= 512: KDA's f_b/g_b, the shared expert's gate/up and down, the indexer's wq_b at
TP8), so that rule would keep them bf16 at decode too, where FP8 halves their reads, to save
tens of microseconds per prefill call (KDA's f_b/g_b: about 26 us, 1.8 ms of a 310 ms
8,192-token chunk at TP8). Prefill FP8 GEMMs at those shapes are issue 44's. A tie stays dense
(the dense path is the more accurate one).

The routed experts are not timed: the fused FP8 MoE measured 1.4-1.8x bf16 from 1 to 8,192
tokens, and they are most of the weight bytes.

Rank 0 times and broadcasts its choice: every rank holds the same shapes and must hold the same
dtypes (the plan, the weight bytes per GPU). --fp8-linears all skips the timing (every
projection FP8: the kernel and accuracy checks). Nothing is timed on the CPU (it dequantizes
everything at load), with PDSERVE_TORCH_KERNELS=1 (the oracle) or for a bf16 checkpoint.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

import kernels
from serving.distributed import broadcast_object, state

log = logging.getLogger(__name__)

# (decode-sized, prefill-sized): the seed's largest decode graph batch, a --chunked-prefill-size
TOKENS = (32, 8192)
POLICIES = ("timed", "all")


def fp8_wins(
    fp8_us: Iterable[float], dense_us: Iterable[float], tokens: Iterable[int] = TOKENS
) -> bool:
    """The rule: FP8's device time per token, summed over the token counts, strictly below
    dense's (see the module doc)."""
    fp8_us, dense_us, tokens = tuple(fp8_us), tuple(dense_us), tuple(tokens)
    if not len(fp8_us) == len(dense_us) == len(tokens) or not fp8_us:
        raise ValueError(f"timings of different token counts: {fp8_us} vs {dense_us} ({tokens})")
    return sum(f / t for f, t in zip(fp8_us, tokens)) < sum(d / t for d, t in zip(dense_us, tokens))


@dataclass(frozen=True)
class ShapeTiming:
    """One weight shape timed at TOKENS: microseconds per call, FP8 and dense."""

    shape: tuple[int, int]
    fp8_us: tuple[float, ...]
    dense_us: tuple[float, ...]
    gemm: str  # the FP8 GEMMs block_fp8_linear ran per count, e.g. "skinny/scaled_mm"

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


def linear_shape(
    module: nn.Module, fp8: Callable[[nn.Module], bool] | None = None
) -> tuple[int, int] | None:
    """The weight shape a projection with FP8 kernels is timed by (None: the routed experts):
    its own, or, for a part of a StackedProjections, the shape of the stacked GEMM it runs in
    when the parts fp8(part) selects hold FP8 (default: every part with a `kind`)."""
    if getattr(module, "kind", None) in (None, "moe"):
        return None
    n, k = module.weight.shape
    stack = getattr(module, "stacked_in", None)
    if stack is not None:
        n = stack.fp8_rows(module, fp8 or (lambda part: part.kind is not None))
    return n, k


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
    from kernels.triton.fp8 import linear_gemm, time_linear

    n, k = shape
    runs = [time_linear(n, k, tokens, dtype, device) for tokens in TOKENS]
    gemm = "/".join(linear_gemm(tokens, n, k, dtype, device) for tokens in TOKENS)
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

    def selected(part: nn.Module) -> bool:  # what the load held FP8 or timed
        return part.kind is not None and part.kind not in keep_bf16

    for role, root in modules.items():
        for path, module in root.named_modules():
            kind = getattr(module, "kind", None)
            if kind is None:
                continue
            held = getattr(module, "weight_scale_inv", getattr(module, "w13_scale_inv", None))
            shape = linear_shape(module, selected)
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
                entry.update(
                    timed_shape=list(timing.shape),
                    gemm=timing.gemm,
                    fp8_us=timing.fp8_us,
                    dense_us=timing.dense_us,
                )
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

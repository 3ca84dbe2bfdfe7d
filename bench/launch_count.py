"""Kernel launches of one decode step, by layer kind, counted on a CPU (issue 43 point 1):

    python -m bench.launch_count [--batch 1] [--preset tiny45] [--eagle N] [--out launches.json]

The engine runs the fast path on CPU tensors under Triton's interpreter (kernels.INTERPRETED;
fla-core from PYTHONPATH where installed, `make test` puts it in .venv/fla-interp), on a
checkpoint with GLM-5.3-Flash's layer pattern and tiny widths (tiny_model's tiny45: 34 KDA + 11
DSA layers, 3 dense MLPs then 42 MoE). A launch is a Triton kernel (an interpreter grid call) or
a torch op that launches a CUDA kernel (any op but views, allocations and scalar reads; a matmul
is counted once, cuBLAS may split it), by bench.step_costs.layer_kinds's labels: KDA, DSA, MoE
(its shared expert too), dense MLP, mHC (collapse, boundary, expansion), lm_head, and rest
(embedding, final norm, the logits' rows). A decode forward of a steady
step is counted (the Nth, --step); the sampler is not. With --eagle N (chain drafts), the Nth
EAGLE step's two device programs instead (draft steps + verify; KDA roll-back + the draft's
catch-up), the draft's layers labelled too; its "rest" holds the roll-back, the draft chain's
argmax and the stashes. Widths change no launch count as long
as a batch takes the same paths: the small-batch MoE (at most SMALL_MOE_MAX_TOKENS tokens), the
fused mHC boundary, DSA's step path. Without TP there are no collectives (the simulated rank's
fake backend launches none either).

The H200 trace it stands for: rank 0 of TP8/EP8, batch 1, 502 kernels a replayed decode step
(docs/BENCHMARKS.md, the real-size launches row). A JSON object: {"batch", "world", "total",
"by_kind": {kind: {"triton", "torch", "per_layer"}}, "kernels": {kind: {name: count}}}.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

# ops that launch no kernel on CUDA: allocations, metadata, host scalars
NO_KERNEL = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "lift_fresh",
    "detach",
    "alias",
    "_local_scalar_dense",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "is_nonzero",
    "set_",
    "resize_",
    "record_stream",
}


class Launches(TorchDispatchMode):
    """Counts launches by (kind, name); `kind` is the innermost open region."""

    def __init__(self) -> None:
        super().__init__()
        self.regions: list[str] = ["rest"]
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.on = False
        self.in_kernel = 0

    @contextlib.contextmanager
    def region(self, kind: str):
        self.regions.append(kind)
        try:
            yield
        finally:
            self.regions.pop()

    def add(self, name: str) -> None:
        if self.on and not self.in_kernel:
            self.counts[self.regions[-1]][name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        base = func.overloadpacket.__name__
        if not func.is_view and base not in NO_KERNEL:
            self.add(f"aten.{base}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _labelled(counter: Launches, *modules) -> Iterator[None]:
    """While open: each Triton launch counted once (the interpreter's own work inside it not at
    all), and every op charged to bench.step_costs.layer_kinds's label of `modules`' layer that
    runs it."""
    import triton.runtime.interpreter as interpreter

    from bench.step_costs import layer_kinds

    def region(label: str, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            with counter.region(label):
                return fn(*args, **kwargs)

        return call

    launch = interpreter.GridExecutor.__call__

    def grid_call(self, *args, **kwargs):
        counter.add(self.fn.__name__)
        counter.in_kernel += 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            counter.in_kernel -= 1

    interpreter.GridExecutor.__call__ = grid_call
    try:
        with layer_kinds(*modules, wrap=region):
            yield
    finally:
        interpreter.GridExecutor.__call__ = launch


@contextlib.contextmanager
def counting(model, step: int) -> Iterator[Launches]:
    """Counts the launches of `model`'s step-th decode forward (1-based) while open."""
    counter, decodes = Launches(), [0]
    forward = model.forward

    def model_forward(fb, *args, **kwargs):
        decodes[0] += fb.is_decode
        counter.on = fb.is_decode and decodes[0] == step
        try:
            with counter:
                return forward(fb, *args, **kwargs)
        finally:
            counter.on = False

    model.forward = model_forward
    try:
        with _labelled(counter, model):
            yield counter
    finally:
        del model.forward  # back to the class's


@contextlib.contextmanager
def counting_eagle(spec, step: int) -> Iterator[Launches]:
    """Counts the launches of the step-th EAGLE step (1-based) while open: its two device
    programs (serving/speculative/eagle.py: the draft steps + verify, the KDA roll-back + the
    draft's catch-up), the target's and the draft's layers labelled, the rest (embeddings, the
    draft chain, the roll-back, the stashes) under "rest"; the acceptance between them is the
    sampler's and is not counted."""
    counter, steps = Launches(), [0]

    def program(fn, first: bool):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            steps[0] += first
            counter.on = steps[0] == step
            try:
                with counter:
                    return fn(*args, **kwargs)
            finally:
                counter.on = False

        return call

    spec.draft_and_verify = program(spec.draft_and_verify, True)
    spec.roll_back_and_catch_up = program(spec.roll_back_and_catch_up, False)
    try:
        with _labelled(counter, spec.target, spec.draft):
            yield counter
    finally:
        del spec.draft_and_verify, spec.roll_back_and_catch_up  # back to the class's


def summary(counter: Launches, config) -> dict:
    """{"total", "by_kind": {kind: {"triton", "torch", "per_layer"}}, "kernels"}."""
    from serving.config import DSA, KDA

    per = {"KDA": config.layer_types.count(KDA), "DSA": config.layer_types.count(DSA)}
    per["dense MLP"] = config.mlp_layer_types.count("dense")
    per["MoE"] = len(config.mlp_layer_types) - per["dense MLP"]
    per["mHC"] = 2 * len(config.layer_types)  # a collapse or boundary before each sublayer
    per["lm_head"] = 1
    by_kind = {}
    for kind, names in sorted(counter.counts.items()):
        triton_n = sum(n for k, n in names.items() if not k.startswith("aten."))
        torch_n = sum(n for k, n in names.items() if k.startswith("aten."))
        by_kind[kind] = {"triton": triton_n, "torch": torch_n}
        if kind in per:
            by_kind[kind]["per_layer"] = round((triton_n + torch_n) / per[kind], 2)
    total = sum(v["triton"] + v["torch"] for v in by_kind.values())
    kernels = {k: dict(sorted(v.items())) for k, v in sorted(counter.counts.items())}
    return {"total": total, "by_kind": by_kind, "kernels": kernels}


def count(ckpt: Path, batch: int, step: int, world: int, eagle: int = 0) -> dict:
    from serving.engine.build import build_engine
    from serving.protocol import GenerateRequest
    from serving.sampling_params import SamplingParams
    from serving.server_args import ServerArgs

    args = ServerArgs.from_cli(
        [
            *("--model-path", str(ckpt), "--device", "cpu", "--dtype", "bfloat16"),
            *("--page-size", "16", "--max-total-tokens", "2048", "--skip-server-warmup"),
            "--disable-radix-cache",
            *(
                ("--simulate-rank", "0", "--tp-size", str(world), "--ep-size", str(world))
                if world > 1
                else ()
            ),
            *(
                (
                    *("--speculative-algorithm", "EAGLE", "--speculative-num-steps", str(eagle)),
                    *("--speculative-num-draft-tokens", str(eagle + 1)),
                )
                if eagle
                else ()
            ),
        ]
    )
    sched = build_engine(args)[0]
    for i in range(batch):
        tokens = step * (eagle + 1) + 1  # enough for `step` steps at any accept length
        params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
        sched.add(GenerateRequest(f"r{i}", list(range(3, 11 + i)), params))
    counted = counting_eagle(sched.spec, step) if eagle else counting(sched.runner.model, step)
    with counted as counter:
        while sched.has_work:
            sched.step()
    found = {"batch": batch, "world": world, **summary(counter, sched.runner.model.config)}
    return {**found, "eagle_steps": eagle} if eagle else found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--step", type=int, default=2, help="which decode forward to count")
    ap.add_argument("--preset", default="tiny45")
    ap.add_argument("--world", type=int, default=8, help="rank 0 of TP/EP this size (1: none)")
    ap.add_argument("--eagle", type=int, default=0, help="count an EAGLE step of this many drafts")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    # before Triton's import (the interpreter) and kernels' (INTERPRETED)
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["PDSERVE_INTERPRET_FAST_PATH"] = "1"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from serving.tools.tiny_model import write_checkpoint
    from tests.triton_interp import patch_triton_interpreter

    patch_triton_interpreter()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(Path(tmp), preset=a.preset)
        result = count(ckpt, a.batch, a.step, a.world, a.eagle)
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()

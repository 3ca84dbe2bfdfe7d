"""The model's fast path (kernels/triton/, fla-core) beside its torch path on one GPU, and one
rank's step at the real shapes (--simulate-rank).

    python -m bench.fast_path --out results.jsonl [--budget-s 240]
        [--stages logits,prefill,decode,greedy,profile]
    python -m bench.fast_path --out rank.jsonl --model-path REAL_CONFIG_DIR \
        --simulate-rank 0 --tp-size 8 --ep-size 8 --context-fill mapped --contexts 4096,65536 \
        --batch-sizes 1,8,32 --prefill-tokens 8192 --no-torch-path \
        --stages prefill,decode,eagle,layers,collectives,floor

In one process, on random weights built in memory (serving/models/random_init.py): the --preset
config (default bench, bf16), or --model-path's config.json; with --simulate-rank R only rank R's
shard of the --tp-size/--ep-size world, its collectives through the fake backend
(serving/distributed.init_simulated), so one GPU runs one rank of the real model.
1. logits: last-token logits of a prefill, fast path vs torch path (relative error);
2. prefill: one request of each --prefill-tokens in one forward (ms; the torch path too where it
   takes under a few seconds, unless --no-torch-path);
3. decode: a decode step with CUDA graphs at each --batch-sizes after each --contexts tokens
   (ms). --context-fill prefill runs the prompts through prefill first; mapped only maps the
   context's pages (the cache holds zeros: a step's cost does not depend on the cache's values,
   and 32 x 64k tokens would take minutes to prefill);
4. eagle: EAGLE's step (--spec-steps draft steps + verify + roll-back and the draft's catch-up,
   greedy sampling on the host between) with its CUDA graphs, same batches and contexts, mapped;
5. greedy: tiny preset, float32: greedy tokens of the fast path equal the torch path's;
6. profile: the top kernels of a decode step at batch 1 and of the largest --prefill-tokens;
7. layers: device time per layer kind (KDA, DSA, MoE, dense MLP, mHC, lm_head, the rest) of
   eager decode steps at batch 1, an eager EAGLE step and the largest prefill
   (bench/step_costs.py);
8. collectives: the tensor collectives each of those steps issues, counted with their bytes, and
   the projected time on --tp-size/--ep-size GPUs at --bus-gbps and --collective-us per call;
   with the decode, eagle and prefill stages' numbers, the projected TP step;
9. floor: the HBM floor of each decode and EAGLE step measured (bytes moved over --hbm-tbps)
   and the measured step's ratio to it.
With --variant NAME=MODULE.ATTR=VALUE[;MODULE.ATTR=VALUE...] (repeatable) the prefill, mapped
decode, eagle and layers stages run once more per variant with those module switches set (e.g.
serving.layers.mlp.GROUPED_MIN_PAIRS_PER_EXPERT=0), in the same process on the same weights;
decode and EAGLE capture their graphs again under each (a graph holds the kernels chosen at its
capture); rows carry "variant" ("base" for the tree's defaults). The floor and collectives
stages use the base figures.
With --fp8, the model is also quantized to block FP8 in memory (serving/tools/quantize_fp8.py's
choice; W8A8 kernels; the projections --fp8-linears keeps dense as a server would, recorded in
the "fp8_quantized" row) and the prefill and decode stages run it after the bf16 model (rows
carry "weights": "bf16" or "fp8"; the torch path is timed for bf16 only). A --model-path config
with `quantization_config` (tiny_model --preset real --fp8) is built in block FP8 from the start,
as a simulated worker builds it (every stage runs FP8; "weights_built" says which weights run
FP8). The logits stage adds the FP8
model's last-token logits against the bf16 model's. On random weights that drift is large and
is no bug: rounding is amplified layer by layer (CPU, float32, 96 tokens: bf16-rounded weights
move the small preset's logits 7.5%, FP8 W8A8 36%; the bench preset's 14.6% bf16 drift on the
GPU predicts its 72% FP8 drift at the same ratio); the trained small model moves 8% in FP8 with
every greedy argmax kept (eval_small's fp8 stage).
Each stage appends JSON lines to --out as it ends, and stages past --budget-s are skipped, so a
run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import importlib
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import kernels
from bench.step_costs import (
    allreduce_ms,
    graph_kernels,
    graph_steps,
    hbm_floor,
    layer_kinds,
    profiler_activities,
    split_by_kind,
)
from serving.config import ModelConfig
from serving.distributed import count_collectives, destroy_parallel, init_simulated, state
from serving.executor.model_runner import ModelRunner, StepInput
from serving.executor.sampler import Sampler, SamplingState
from serving.memory.pool import MemoryPool, PoolPlan
from serving.models.fp8_choice import POLICIES
from serving.models.loader import resolve_dtype
from serving.models.random_init import random_weights
from serving.sampling_params import SamplingParams
from serving.speculative.eagle import Eagle, Proposal, SpecConfig
from serving.tools.tiny_model import TINY_VOCAB, build_config, random_model
from serving.tools.tokenizer_build import write_tokenizer_files


class Run:
    def __init__(self, out: Path, budget_s: float) -> None:
        self.out, self.deadline = out, time.monotonic() + budget_s

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def record(self, **row) -> None:
        print(json.dumps(row), flush=True)
        with self.out.open("a") as f:
            f.write(json.dumps(row) + "\n")


def on_path(torch_only: bool):
    """Every op on its torch reference (torch_only) or on the fast path, for a with-block."""
    return kernels.torch_path() if torch_only else contextlib.nullcontext()


def parse_variant(text: str) -> tuple[str, dict[str, object]]:
    """NAME=mod.ATTR=VALUE;... -> (NAME, {"mod.ATTR": value}), each VALUE a Python literal."""
    name, _, body = text.partition("=")
    sets = {}
    for item in filter(None, body.split(";")):
        target, sep, value = item.partition("=")
        module, _, attr = target.strip().rpartition(".")
        if not (sep and module and attr):
            raise argparse.ArgumentTypeError(f"--variant {text!r}: want MODULE.ATTR=VALUE")
        if not hasattr(importlib.import_module(module), attr):
            raise argparse.ArgumentTypeError(f"--variant {text!r}: {module} has no {attr}")
        sets[target.strip()] = ast.literal_eval(value.strip())
    return name, sets


@contextlib.contextmanager
def switched(sets: dict[str, object]):
    """Module switches set for a with-block, restored after (they are read at call time)."""
    saved = []
    try:
        for target, value in sets.items():
            module, _, attr = target.rpartition(".")
            mod = importlib.import_module(module)
            saved.append((mod, attr, getattr(mod, attr)))
            setattr(mod, attr, value)
        yield
    finally:
        for mod, attr, value in reversed(saved):
            setattr(mod, attr, value)


def make_model(preset: str, device: str):
    with tempfile.TemporaryDirectory() as tmp:
        specials = write_tokenizer_files(Path(tmp), vocab_size=TINY_VOCAB)
    raw = build_config(preset, specials)
    config, target, draft = random_model(raw, device)
    return config, target, draft


@dataclass
class Bench:
    """The model under test and what the stages measured so far (later stages project from
    earlier ones)."""

    run: Run
    config: ModelConfig
    model: torch.nn.Module
    draft: torch.nn.Module | None
    device: str
    args: argparse.Namespace
    measured: dict[tuple, float] = field(default_factory=dict)  # (stage, batch, context) -> ms
    fp8_model: torch.nn.Module | None = None  # --fp8: the model quantized in memory
    built: str = "bf16"  # what `model` was built as: "fp8" for a config in block FP8
    weights: str = "bf16"  # what `model` holds while a stage runs: "bf16" or "fp8"

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def key(self, *k) -> tuple:
        """A `measured` key; --fp8's runs get their own, so the projections read the built
        model's."""
        return k if self.weights == self.built else (*k, self.weights)


def build(args: argparse.Namespace) -> Bench:
    """The --preset model, or --model-path's config with random weights (rank R's shard with
    --simulate-rank R)."""
    run = Run(Path(args.out), args.budget_s)
    if args.model_path is None:
        config, model, draft = make_model(args.preset, args.device)
    else:
        config = ModelConfig.from_pretrained(args.model_path)
        if args.simulate_rank is not None:
            init_simulated(args.simulate_rank, args.tp_size, args.ep_size)
        dtype = resolve_dtype("auto", args.model_path)
        started = time.monotonic()
        model, draft = random_weights(config, dtype, args.device, fp8_linears=args.fp8_linears)
        _sync()
        run.record(
            stage="weights_built",
            seconds=round(time.monotonic() - started, 2),
            fp8=fp8_record(model, draft),
        )
    built = "fp8" if getattr(model, "fp8_choice", None) is not None else "bf16"
    fp8_model = None
    if args.fp8:
        from serving.models.fp8_choice import choose_linears, linear_shape
        from serving.tools.quantize_fp8 import quantize_model

        if built == "fp8":
            raise SystemExit("--fp8: the model is built in block FP8 already (its config.json)")
        shapes: dict[tuple[int, int], list[str]] = {}
        for path, module in model.named_modules():
            if (shape := linear_shape(module)) is not None:
                shapes.setdefault(shape, []).append(path)
        dtype = next(model.parameters()).dtype
        choice = choose_linears(shapes, dtype, args.device, args.fp8_linears)
        fp8_model = quantize_model(copy.deepcopy(model), choice.dense_shapes)
        fp8_model.fp8_choice = choice
        run.record(stage="fp8_quantized", fp8=fp8_record(fp8_model, None))
    return Bench(
        run,
        config,
        model,
        draft,
        args.device,
        args,
        fp8_model=fp8_model,
        built=built,
        weights=built,
    )


def fp8_record(model: torch.nn.Module, draft: torch.nn.Module | None) -> dict | None:
    """Which weights run FP8 and why (serving/models/fp8_choice.summary), for the JSON."""
    from serving.models.fp8_choice import summary

    roles = {"target": model} if draft is None else {"target": model, "draft": draft}
    return summary(roles, getattr(model, "fp8_choice", None), frozenset())


def run_stage(b: Bench, name: str) -> None:
    """Stage `name` on the bf16 model, then (--fp8) its FP8 counterpart."""
    if not (name == "logits" and b.args.no_torch_path):
        STAGES[name](b)
    if b.fp8_model is None or b.run.time_left() < 30:
        return
    if name == "logits":
        stage_logits_fp8(b)
    elif name in ("prefill", "decode"):
        bf16, b.model, b.weights = b.model, b.fp8_model, "fp8"
        try:
            STAGES[name](b)
        finally:
            b.model, b.weights = bf16, b.built


def engine(
    model, device: str, rows: int, ctx: int, spec_steps: int = 0
) -> tuple[ModelRunner, list[int]]:
    plan = PoolPlan(
        rows=rows,
        pages=rows * -(-ctx // 64),
        page_size=64,
        max_context=ctx,
        with_draft=spec_steps > 0,
        num_draft_tokens=spec_steps + 1,
    )
    pool = MemoryPool(model.config, plan, model.dtype, device)
    runner = ModelRunner(model, pool)
    got = [pool.alloc_row() for _ in range(rows)]
    for r in got:
        assert pool.grow(r, [], ctx)
    return runner, got


def prompts(batch: int, length: int, vocab: int, seed: int = 1234, low: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, (batch, length), generator=g).tolist()


def own_tokens(vocab: int) -> tuple[int, int]:
    """[low, high) of the token ids whose embedding rows this rank holds. A simulated rank gets
    zero embeddings for every other id (the all-reduce that would add the other ranks' rows
    returns at once), and all-zero hidden states would route every token to the same experts:
    its inputs come from here, so its MoE work is a real rank's."""
    ps = state()
    if ps.tp_size == 1:
        return 0, vocab
    share = -(-vocab // ps.tp_size)
    low = ps.tp_rank * share
    return low, min(vocab, low + share)


def row_tokens(vocab: int, rows: int) -> list[int]:
    """A token id per batch row, all different and all this rank's (own_tokens): rows fed one
    token at one position over the same (mapped, zero) context would compute the same hidden
    states and route to the same experts, so a batch's MoE would read one token's experts
    instead of a real batch's (until 2026-12-05 the decode and EAGLE stages did just that)."""
    low, high = own_tokens(vocab)
    span = high - low - 1
    assert span >= 1, (low, high)
    return [low + 1 + i % span for i in range(rows)]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeat: int = 3) -> float:
    """Median ms of fn() over `repeat` runs after one warm-up (which compiles the kernels)."""
    fn()
    _sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(1000 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


def prefill(runner: ModelRunner, row: int, ids: list[int]):
    return runner.forward([StepInput(row, 0, ids)])


def stage_logits_fp8(b: Bench) -> None:
    low, high = own_tokens(b.config.vocab_size)
    ids = prompts(1, 512, high, low=low)[0]
    out = {}
    for name, m in (("bf16", b.model), ("fp8", b.fp8_model)):
        runner, rows = engine(m, b.device, 1, 600)
        out[name] = prefill(runner, rows[0], ids).logits.float()[-1]
        del runner
    rel = ((out["fp8"] - out["bf16"]).norm() / out["bf16"].norm()).item()
    same = int(out["fp8"].argmax()) == int(out["bf16"].argmax())
    b.run.record(stage="logits_fp8_vs_bf16", prompt=512, rel_err=rel, argmax_equal=same)


def stage_logits(b: Bench) -> None:
    model, device = b.model, b.device
    low, high = own_tokens(model.config.vocab_size)
    ids = prompts(1, 512, high, low=low)[0]
    out = {}
    for name, torch_only in (("fast", False), ("torch", True)):
        with on_path(torch_only):
            runner, rows = engine(model, device, 1, 600)
            out[name] = prefill(runner, rows[0], ids).logits.float()[-1]
        del runner
    rel = ((out["fast"] - out["torch"]).norm() / out["torch"].norm()).item()
    same = int(out["fast"].argmax()) == int(out["torch"].argmax())
    b.run.record(stage="logits_fast_vs_torch", prompt=512, rel_err=rel, argmax_equal=same)


def stage_prefill(b: Bench) -> None:
    model, device, run = b.model, b.device, b.run
    for n in b.args.prefill_tokens:
        if run.time_left() < 20:
            return
        low, high = own_tokens(model.config.vocab_size)
        ids = prompts(1, n, high, low=low)[0]
        for variant, sets in b.args.variant:
            if variant != "base" and run.time_left() < 20:
                return
            row = {"stage": "prefill", "tokens": n, "weights": b.weights, "variant": variant}
            for name, torch_only in (("fast_ms", False), ("torch_ms", True)):
                if torch_only and (
                    n > 2048 or b.args.no_torch_path or b.weights != "bf16" or variant != "base"
                ):
                    continue  # 12-15 s per forward on the torch path (docs/BENCHMARKS.md)
                with on_path(torch_only), switched(sets):
                    runner, rows = engine(model, device, 1, n + 64)
                    repeat = min(2, b.args.repeat)
                    row[name] = timed(
                        lambda r=runner, x=rows[0], p=ids: prefill(r, x, p), repeat=repeat
                    )
                del runner
            if variant == "base":
                b.measured[b.key("prefill", 1, n)] = row["fast_ms"]
            run.record(**row)


def stage_decode(b: Bench) -> None:
    if b.args.context_fill == "mapped":
        return stage_decode_mapped(b)
    model, device, run = b.model, b.device, b.run
    for prompt_len in b.args.contexts:
        for bs in b.args.batch_sizes:
            if run.time_left() < 30:
                return
            runner, rows = engine(model, device, bs, prompt_len + 64)
            low, high = own_tokens(model.config.vocab_size)
            batch = prompts(bs, prompt_len, high, low=low)
            for i in range(0, bs, 8):  # prefill in chunks of 8 requests
                items = [StepInput(r, 0, ids) for r, ids in zip(rows[i : i + 8], batch[i : i + 8])]
                runner.forward(items)
            if b.cuda:
                runner.enable_decode_graphs(bs)
            ms = timed(_decode_steps(runner, rows, prompt_len), repeat=b.args.repeat)
            b.measured[b.key("decode", bs, prompt_len)] = ms
            run.record(
                stage="decode_graphs", batch=bs, prompt_len=prompt_len, ms=ms, weights=b.weights
            )
            del runner
            _empty_cache()


def stage_decode_mapped(b: Bench) -> None:
    """Per variant: one pool for the largest batch and context, graphs captured once, then each
    (context, batch) timed from that context on (pages mapped, no prefill: the module doc)."""
    bs_max, ctx_max = max(b.args.batch_sizes), max(b.args.contexts)
    # Positions used past a context: timed's warm-up and repeats, then the traced steps; a
    # step past the mapped pages indexes out of bounds on the device (a device assert).
    steps = 1 + b.args.repeat + (b.args.trace_steps if b.cuda else 0)
    for variant, sets in b.args.variant:
        if b.run.time_left() < 30:
            return
        with switched(sets):
            runner, rows = engine(b.model, b.device, bs_max, ctx_max + steps + 1)
            if b.cuda:
                started = time.monotonic()
                runner.enable_decode_graphs(bs_max)
                _sync()
                b.run.record(
                    stage="decode_graphs_captured",
                    up_to=bs_max,
                    seconds=_since(started),
                    variant=variant,
                )
            for context in b.args.contexts:
                for bs in b.args.batch_sizes:
                    if b.run.time_left() < 20:
                        return
                    step = _decode_steps(runner, rows[:bs], context)
                    ms = timed(step, repeat=b.args.repeat)
                    if variant == "base":
                        b.measured[b.key("decode", bs, context)] = ms
                    b.run.record(
                        stage="decode_graphs",
                        batch=bs,
                        context=context,
                        fill="mapped",
                        ms=ms,
                        weights=b.weights,
                        variant=variant,
                    )
                    if b.cuda and b.args.trace_steps and context == b.args.contexts[0]:
                        _trace_graph_steps(b, step, bs, context, variant)
            del runner
            _empty_cache()


def _trace_graph_steps(b: Bench, step, bs: int, context: int, variant: str) -> None:
    """Kernels per replayed decode step, their busy time and the graph's gaps (graph_steps),
    the median over --trace-steps profiled steps, and the kernels taking the most time
    (graph_kernels; with PDL on, a kernel's time includes its wait for the one before)."""
    from torch.profiler import profile, record_function

    from serving.tools.trace_summary import load

    with profile(activities=profiler_activities(True)) as prof:
        for _ in range(b.args.trace_steps):
            with record_function("step"):
                step()
            _sync()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = load(path)
        rows = graph_steps(trace, "step")
    if not rows:
        b.run.record(
            stage="decode_graph_trace",
            batch=bs,
            context=context,
            variant=variant,
            error="no kernels",
        )
        return
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    b.run.record(
        stage="decode_graph_trace",
        batch=bs,
        context=context,
        variant=variant,
        steps=len(rows),
        kernels=med["kernels"],
        busy_ms=round(med["busy_us"] / 1000, 4),
        span_ms=round(med["span_us"] / 1000, 4),
        gap_ms=round(med["gap_us"] / 1000, 4),
        top_kernels=graph_kernels(trace, "step"),
    )


def _decode_steps(runner: ModelRunner, rows: list[int], start: int):
    """A function running one decode step of every row per call, at the next position."""
    position = [start]
    tokens = row_tokens(runner.model.config.vocab_size, len(rows))

    def step() -> None:
        runner.forward([StepInput(r, position[0], [t]) for r, t in zip(rows, tokens)])
        position[0] += 1

    return step


def _eagle(b: Bench, rows: int, ctx: int, graphs: bool) -> tuple[Eagle, list[int]]:
    runner, got = engine(b.model, b.device, rows, ctx, b.args.spec_steps)
    sampler = Sampler(b.config.vocab_size, b.device)
    spec = Eagle(b.model, b.draft, runner.pool, sampler, SpecConfig(b.args.spec_steps))
    if graphs and b.cuda:
        started = time.monotonic()
        spec.enable_graphs(rows)
        _sync()
        b.run.record(stage="eagle_graphs_captured", up_to=rows, seconds=_since(started))
    return spec, got


def _eagle_steps(spec: Eagle, rows: list[int], start: int):
    """A function running one EAGLE step (draft + verify, greedy accept on the host, roll-back
    and catch-up) of every row per call; each row moves on by what it committed."""
    params = SamplingParams(temperature=0.0)
    states = [SamplingState(params, [], [], frozenset()) for _ in rows]
    positions = {r: start for r in rows}
    tokens = row_tokens(spec.target.config.vocab_size, len(rows))

    def step() -> None:
        proposals = [Proposal(r, positions[r], t) for r, t in zip(rows, tokens)]
        committed, _ = spec.step(proposals, states, [-1] * len(rows))
        for r, c in zip(rows, committed):
            positions[r] += len(c)

    return step


def stage_eagle(b: Bench) -> None:
    bs_max, ctx_max = max(b.args.batch_sizes), max(b.args.contexts)
    # a step commits up to steps + 1 tokens: room for the warm-up and the timed steps
    room = (b.args.repeat + 2) * (b.args.spec_steps + 1)
    for variant, sets in b.args.variant:
        if b.run.time_left() < 30:
            return
        with switched(sets):
            spec, rows = _eagle(b, bs_max, ctx_max + room, graphs=True)
            for context in b.args.contexts:
                for bs in b.args.batch_sizes:
                    if b.run.time_left() < 20:
                        return
                    ms = timed(_eagle_steps(spec, rows[:bs], context), repeat=b.args.repeat)
                    if variant == "base":
                        b.measured[("eagle", bs, context)] = ms
                    b.run.record(
                        stage="eagle_step",
                        spec_steps=b.args.spec_steps,
                        batch=bs,
                        context=context,
                        ms=ms,
                        variant=variant,
                    )
            del spec
            _empty_cache()


def stage_greedy_tiny(b: Bench) -> None:
    device = b.device
    _, model, _ = make_model("tiny", device)
    got = {}
    for name, torch_only in (("fast", False), ("torch", True)):
        with on_path(torch_only):
            runner, rows = engine(model, device, 2, 128)
            batch = prompts(2, 37, model.config.vocab_size, seed=7)
            out = runner.forward([StepInput(r, 0, ids) for r, ids in zip(rows, batch)])
            tokens = [out.logits.argmax(-1).tolist()]
            for step in range(16):
                items = [StepInput(r, 37 + step, [t]) for r, t in zip(rows, tokens[-1])]
                tokens.append(runner.forward(items).logits.argmax(-1).tolist())
        got[name] = tokens
    b.run.record(stage="greedy_tiny_fp32", equal=got["fast"] == got["torch"], tokens=got["fast"])


def stage_profile(b: Bench) -> None:
    from torch.profiler import ProfilerActivity, profile

    n = max(b.args.prefill_tokens)
    runner, rows = engine(b.model, b.device, 1, n + 64)
    low, high = own_tokens(b.config.vocab_size)
    ids = prompts(1, n, high, low=low)[0]
    prefill(runner, rows[0], ids)
    _sync()
    tables = {}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        prefill(runner, rows[0], ids)
        _sync()
    tables[f"prefill_{n}"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(5):
            runner.forward([StepInput(rows[0], n + i, [low + 1])])
        _sync()
    tables["decode_bs1_eager_x5"] = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=15
    )
    b.run.record(stage="profile", **tables)


def _workloads(b: Bench):
    """(name, batch, context, warm-up + measured function) of the steps the layers and
    collectives stages look at, all eager: decode at batch 1, EAGLE's step at batch 1 (with a
    draft) and the largest prefill, each at the first context."""
    context, n = b.args.contexts[0], max(b.args.prefill_tokens)
    runner, rows = engine(b.model, b.device, 1, max(context, n) + 64)
    yield "decode", 1, context, _decode_steps(runner, rows, context)
    low, high = own_tokens(b.config.vocab_size)
    ids = prompts(1, n, high, low=low)[0]
    yield "prefill", 1, n, lambda: prefill(runner, rows[0], ids)
    if b.draft is not None:
        spec, rows = _eagle(b, 1, context + 64, graphs=False)
        yield "eagle", 1, context, _eagle_steps(spec, rows, context)


def stage_layers(b: Bench) -> None:
    from torch.profiler import profile, record_function

    for name, bs, context, fn in _workloads(b):
        for variant, sets in b.args.variant:
            if b.run.time_left() < 20:
                return
            with switched(sets):
                fn()  # warm-up: kernels compiled, caches touched
                _sync()
                repeat = 1 if name == "prefill" else min(3, b.args.repeat)
                modules = [b.model] if b.draft is None else [b.model, b.draft]
                with layer_kinds(*modules), profile(activities=profiler_activities(b.cuda)) as prof:
                    for _ in range(repeat):
                        with record_function("step"):
                            fn()
                        _sync()
            ms, launches = split_by_kind(prof, "step", b.cuda)
            ms = {k: round(v / repeat, 3) for k, v in ms.items()}
            launches = {k: v / repeat for k, v in launches.items()}
            b.run.record(
                stage="layer_kinds",
                step=name,
                batch=bs,
                context=context,
                eager=True,
                variant=variant,
                ms=ms,
                kernels=launches,
            )


def stage_collectives(b: Bench) -> None:
    ps, args = state(), b.args
    for name, bs, context, fn in _workloads(b):
        fn()
        with count_collectives() as tally:
            fn()
        _sync()
        projected = allreduce_ms(tally, ps.world, args.bus_gbps, args.collective_us)
        row = {
            "stage": "collectives",
            "step": name,
            "batch": bs,
            "context": context,
            "world": ps.world,
            "counts": {k: {"calls": c, "bytes": n} for k, (c, n) in tally.items()},
            "bus_gbps": args.bus_gbps,
            "collective_us": args.collective_us,
            "projected_collectives_ms": round(projected, 4),
            "projected_collectives_ms_at_us": {
                us: round(allreduce_ms(tally, ps.world, args.bus_gbps, us), 4) for us in (5, 20)
            },
        }
        measured = b.measured.get((name, bs, context))
        if measured is not None:  # the step measured with graphs (or the prefill) + collectives
            row["measured_compute_ms"] = measured
            row["projected_step_ms"] = round(measured + projected, 4)
            if name == "eagle":
                row["projected_tpot_ms_accept2"] = round((measured + projected) / 2, 4)
        b.run.record(**row)


def stage_floor(b: Bench) -> None:
    for (kind, bs, context), ms in list(b.measured.items()):
        if kind not in ("decode", "eagle"):
            continue
        tokens_per_row = b.args.spec_steps + 1 if kind == "eagle" else 1
        modules = [b.model, b.draft] if kind == "eagle" else [b.model]
        floor = hbm_floor(
            b.config, modules, bs, context, tokens_per_row, b.args.hbm_tbps, state().tp_size
        )
        b.run.record(
            stage="hbm_floor",
            step=kind,
            batch=bs,
            context=context,
            hbm_tbps=b.args.hbm_tbps,
            measured_ms=ms,
            ratio=round(ms / floor["floor_ms"], 2),
            **{k: round(v, 4) if k == "floor_ms" else int(v) for k, v in floor.items()},
        )


def _empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _since(started: float) -> float:
    return round(time.monotonic() - started, 2)


STAGES = {
    "logits": stage_logits,
    "prefill": stage_prefill,
    "decode": stage_decode,
    "eagle": stage_eagle,
    "greedy": stage_greedy_tiny,
    "profile": stage_profile,
    "layers": stage_layers,
    "collectives": stage_collectives,
    "floor": stage_floor,
}
DEFAULT = ("logits", "prefill", "decode", "greedy", "profile")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=240)
    ap.add_argument("--preset", default="bench", help="the model (without --model-path)")
    ap.add_argument("--model-path", help="a config.json directory (e.g. tiny_model --preset real)")
    ap.add_argument("--simulate-rank", type=int, help="run only this rank of the world")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--ep-size", type=int, default=1)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--fp8", action="store_true", help="also the model in block FP8 (W8A8)")
    ap.add_argument(
        "--fp8-linears",
        choices=POLICIES,
        default="timed",
        help="which projections of an FP8 model run FP8, as the server's flag",
    )
    ap.add_argument(
        "--stages",
        default=",".join(DEFAULT),
        help=f"comma-separated, run in the order given, from {','.join(STAGES)} "
        f"(default {','.join(DEFAULT)})",
    )
    ap.add_argument("--batch-sizes", type=_ints, default=[1, 32, 128])
    ap.add_argument("--contexts", type=_ints, default=[4096], help="decode/eagle contexts")
    ap.add_argument("--context-fill", choices=["prefill", "mapped"], default="prefill")
    ap.add_argument("--prefill-tokens", type=_ints, default=[512, 2048, 8192])
    ap.add_argument(
        "--no-torch-path",
        action="store_true",
        help="skip the torch path (the logits stage's fast-vs-torch and prefill's torch_ms)",
    )
    ap.add_argument(
        "--variant",
        type=parse_variant,
        action="append",
        default=[],
        help="NAME=MODULE.ATTR=VALUE[;...]: also time the stages with these switches (repeatable)",
    )
    ap.add_argument("--spec-steps", type=int, default=1, help="EAGLE draft steps")
    ap.add_argument("--repeat", type=int, default=20, help="timed decode/EAGLE steps (median)")
    ap.add_argument(
        "--trace-steps",
        type=int,
        default=0,
        help="mapped decode: profile this many replayed steps per batch at the first context "
        "(kernels per step, busy time, the graph's gaps)",
    )
    ap.add_argument(
        "--bus-gbps",
        type=float,
        default=450.0,
        help="collective bus bandwidth of the projection: NVLink 4's 450 GB/s per direction "
        "(docs/BENCHMARKS.md)",
    )
    ap.add_argument(
        "--collective-us",
        type=float,
        default=10.0,
        help="latency per collective call of the projection (an assumption; the JSON also "
        "gives 5 and 20)",
    )
    ap.add_argument("--hbm-tbps", type=float, default=4.23, help="HBM bandwidth of the floor")
    args = ap.parse_args(argv)
    if any(name == "base" for name, _ in args.variant):
        ap.error("--variant: 'base' is the tree's defaults, always run first")
    args.variant = [("base", {}), *args.variant]
    args.stages = args.stages.split(",")
    if unknown := set(args.stages) - set(STAGES):
        ap.error(f"unknown stages {sorted(unknown)}; choose from {','.join(STAGES)}")
    if args.simulate_rank is not None and args.model_path is None:
        ap.error("--simulate-rank needs --model-path (a config.json directory)")
    if "eagle" in args.stages and args.context_fill != "mapped":
        ap.error("the eagle stage runs on mapped contexts: add --context-fill mapped")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    b = build(args)
    b.run.record(stage="built", seconds_left=b.run.time_left(), rank=str(state()), fp8=args.fp8)
    try:
        for name in args.stages:
            if b.run.time_left() < 15:
                break
            if name == "profile" and not b.cuda:
                continue
            try:
                run_stage(b, name)
            except Exception as e:  # one failing stage must not lose the others' numbers
                b.run.record(stage="error", at=name, error=f"{type(e).__name__}: {e}"[:2000])
                _empty_cache()
    finally:
        destroy_parallel()


if __name__ == "__main__":
    main()

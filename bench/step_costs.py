"""What one rank's step costs, beside what it measures (bench/fast_path.py):

- layer_kinds: profiler labels per layer kind (KDA, DSA, MoE, dense MLP, mHC, lm_head) around
  the modules' calls, so a profile splits a step's device time by kind ("rest" is the step
  minus the labelled parts: norms, embedding, residual glue, the sampler's inputs);
- hbm_floor: the bytes a decode step must move through HBM on this rank (the weights it reads,
  the KDA states it reads and writes, the latents and pooled index keys its attention reads) and
  the time that takes at a given bandwidth;
- allreduce_ms: the time of the collectives a step issues (serving/distributed.count_collectives)
  on a ring of `world` GPUs at a given bus bandwidth and per-call latency.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch import nn

from serving.config import ModelConfig
from serving.layers.mhc import HyperConnection
from serving.layers.mlp import DenseMLP, MoE
from serving.memory.pool import kda_state_bytes
from serving.models.dsa import DSAttention
from serving.models.kda import KDAttention

KINDS = ("KDA", "DSA", "MoE", "dense MLP", "mHC", "lm_head")


def labelled(label: str, fn):
    """fn under a profiler range named label."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)

    return call


@contextlib.contextmanager
def layer_kinds(*modules: nn.Module, wrap=labelled) -> Iterator[None]:
    """Label every KDA/DSA attention, MoE, dense MLP, mHC collapse/boundary/expand and the
    lm_head call of `modules` for the profiler while the block runs (eager forwards only: a
    CUDA graph replays its kernels without the labels). wrap(label, fn): what labels a call
    (bench.launch_count's counts launches by label instead)."""
    kinds = ((KDAttention, "KDA"), (DSAttention, "DSA"), (MoE, "MoE"), (DenseMLP, "dense MLP"))
    patched: list[tuple[object, str]] = []
    for module in modules:
        inside: list[str] = []  # labelled modules so far; their children stay unlabelled
        for name, m in module.named_modules():  # parents before children
            if any(name.startswith(prefix + ".") for prefix in inside):
                continue  # e.g. MoE's shared expert, a DenseMLP: counted as MoE, once
            label = next((k for cls, k in kinds if isinstance(m, cls)), None)
            if name == "lm_head":
                label = "lm_head"
            if label is not None:
                inside.append(name)
                m.forward = wrap(label, m.forward)
                patched.append((m, "forward"))
            elif isinstance(m, HyperConnection):
                for attr in ("collapse", "boundary"):
                    setattr(m, attr, wrap("mHC", getattr(m, attr)))
                    patched.append((m, attr))
    expand = HyperConnection.__dict__["expand"]
    HyperConnection.expand = staticmethod(wrap("mHC", expand.__func__))
    try:
        yield
    finally:
        HyperConnection.expand = expand
        for m, attr in patched:
            delattr(m, attr)  # back to the class's method


def profiler_activities(cuda: bool) -> list:
    """What split_by_kind's profile must record. The CPU activity always: the labels are
    CPU-side ranges, and on CUDA a kernel is charged to the range that launched it. A
    CUDA-only profile (run 5's layers stage) records no CPU ranges at all, so every kind read
    0.0 ms."""
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]


def split_by_kind(prof, step_label: str, cuda: bool) -> tuple[dict[str, float], dict[str, int]]:
    """(ms per kind, kernels per kind) in `prof` (a finished torch.profiler.profile over
    profiler_activities(cuda) whose steps ran under record_function(step_label) inside
    layer_kinds), each with "rest" and "step" (the total), summed over the profiled steps. On
    CUDA from the Chrome trace (kernel_time_by_range: each kernel charged through its launch's
    correlation id); on the CPU from the labels' CPU time, and no kernel counts (empty). Raises
    when the step label is missing or holds no time: a profile without the CPU activity, or a
    replayed CUDA graph."""
    if cuda:
        import tempfile
        from pathlib import Path

        from serving.tools.trace_summary import load

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            totals, kernels, seen = kernel_time_by_range(load(path), KINDS, step_label)
    else:
        kernels = {}
        from torch.autograd import DeviceType

        totals, seen = dict.fromkeys((*KINDS, step_label), 0.0), 0
        for e in prof.events():
            if e.name in totals and e.device_type == DeviceType.CPU:
                seen += e.name == step_label
                totals[e.name] += e.cpu_time_total
    if not seen or totals[step_label] <= 0:
        raise ValueError(
            f"no {'device' if cuda else 'CPU'} time under {step_label!r} ({seen} ranges): "
            "profile with profiler_activities(cuda), eager forwards"
        )
    out = {kind: totals[kind] / 1000 for kind in KINDS}
    out["rest"] = totals[step_label] / 1000 - sum(out.values())
    out["step"] = totals[step_label] / 1000
    launches = {}
    if kernels:
        launches = {kind: kernels[kind] for kind in KINDS}
        launches["rest"] = kernels[step_label] - sum(launches.values())
        launches["step"] = kernels[step_label]
    return out, launches


def launch_map(trace: dict) -> tuple[list[dict], list[dict], list, dict]:
    """A Chrome trace's complete events, its host events, each host event's enclosing one
    (an index, or None) and the host event that launched each correlation id (an index)."""
    from serving.tools.trace_summary import HOST_CATS, nest

    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    host = [e for e in events if e.get("cat") in HOST_CATS]
    parent, _ = nest(host)
    launch_at = {
        e["args"]["correlation"]: i
        for i, e in enumerate(host)
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    return events, host, parent, launch_at


def kernel_time_by_range(
    trace: dict, labels: tuple[str, ...], step_label: str
) -> tuple[dict[str, float], dict[str, int], int]:
    """Device time (us) of the kernels, copies and memsets launched inside each `labels` range
    (charged to the innermost one around the launch) and inside `step_label` ranges, the number
    of kernels (copies and memsets not counted) charged the same way, from a Chrome trace; and
    the number of step ranges. A device event is matched to the runtime or
    driver call that launched it by its correlation id, then that call's enclosing ranges on
    its thread. Session 8's split read the profiler's per-op device totals instead, and its
    kinds summed to half the step with mHC (all Triton, launched through the driver API's
    cuLaunchKernelEx) at zero; the suspicion is that those totals miss driver-API launches.
    This attribution does not depend on them."""
    from serving.tools.trace_summary import GPU_CATS, HOST_CATS

    events, host, parent, launch_at = launch_map(trace)
    totals = dict.fromkeys((*labels, step_label), 0.0)
    kernels = dict.fromkeys((*labels, step_label), 0)
    for e in events:
        if e.get("cat") not in GPU_CATS:
            continue
        i = launch_at.get(e.get("args", {}).get("correlation"))
        kind = None
        while i is not None:
            name = host[i].get("name")
            if kind is None and name in labels:
                kind = name
            if name == step_label:
                is_kernel = e.get("cat") == "kernel"
                totals[step_label] += float(e["dur"])
                kernels[step_label] += is_kernel
                if kind is not None:
                    totals[kind] += float(e["dur"])
                    kernels[kind] += is_kernel
                break
            i = parent[i]
    steps = sum(e.get("name") == step_label and e.get("cat") in HOST_CATS for e in events)
    return totals, kernels, steps


def _graph_step_events(trace: dict, step_label: str) -> list[list[dict]]:
    """The device events of each `step_label` range of a trace of replayed CUDA graphs, in
    time order (a graph's kernels carry its cudaGraphLaunch's correlation id)."""
    from serving.tools.trace_summary import GPU_CATS

    events, host, parent, launch_at = launch_map(trace)
    per_step: dict[int, list[dict]] = {}
    for e in events:
        if e.get("cat") not in GPU_CATS:
            continue
        i = launch_at.get(e.get("args", {}).get("correlation"))
        while i is not None and host[i].get("name") != step_label:
            i = parent[i]
        if i is not None:
            per_step.setdefault(i, []).append(e)
    return [per_step[i] for i in sorted(per_step, key=lambda i: host[i]["ts"])]


def graph_steps(trace: dict, step_label: str) -> list[dict[str, float]]:
    """Per `step_label` range of a trace of replayed CUDA graphs: the kernels its launches ran,
    their busy time (the union of their intervals), their span (first start to last end) and the
    gap (span less busy: the device idle between a step's dependent kernels, launch latency that
    a graph does not hide), in us. Copies and memsets are left out of the count but kept in busy
    and span."""
    from serving.tools.trace_summary import covered, union

    rows = []
    for step in _graph_step_events(trace, step_label):
        spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in step]
        busy = covered(union(spans))
        span = max(end for _, end in spans) - min(start for start, _ in spans)
        kernels = sum(e.get("cat") == "kernel" for e in step)
        rows.append({"kernels": kernels, "busy_us": busy, "span_us": span, "gap_us": span - busy})
    return rows


def graph_kernels(trace: dict, step_label: str, top: int = 30) -> list[dict]:
    """The `top` kernel names of replayed `step_label` ranges by device time: calls and us a step
    (means over the steps), longest first. Under PDL a kernel's time includes its wait for the
    one before (it starts early): trace with PDSERVE_PDL=0 for each kernel's own time."""
    from serving.tools.trace_summary import short

    steps = _graph_step_events(trace, step_label)
    calls: dict[str, int] = defaultdict(int)
    us: dict[str, float] = defaultdict(float)
    for step in steps:
        for e in step:
            if e.get("cat") == "kernel":
                name = short(e["name"])
                calls[name] += 1
                us[name] += float(e["dur"])
    n = max(1, len(steps))
    ranked = sorted(us, key=lambda name: -us[name])[:top]
    return [
        {"name": name, "calls": calls[name] / n, "us": round(us[name] / n, 2)} for name in ranked
    ]


def _routed(name: str) -> bool:
    """The routed experts' weights (and, in block FP8, their scales)."""
    return name.endswith((".mlp.w13", ".mlp.w2", ".mlp.w13_scale_inv", ".mlp.w2_scale_inv"))


def hbm_floor(
    config: ModelConfig,
    modules: list[nn.Module],
    batch: int,
    context: int,
    tokens_per_row: int = 1,
    bandwidth_tbps: float = 4.23,
    tp_size: int = 1,
) -> dict[str, float]:
    """Bytes one decode step of `batch` rows at `context` tokens must move on this rank, and
    the ms at `bandwidth_tbps`. Weights: every parameter but the routed experts and the
    embedding table, the embedding rows of the step's tokens, and per MoE layer the local
    experts the step's tokens are expected to pick (top-k of n_routed, uniformly: a local expert
    is hit with probability 1 - (1 - k/E)^tokens). KDA: every row's states read and written.
    DSA, per token: its top-k selected latents and every pooled index key of its row.
    `modules`: this rank's target (and draft, whose DSA layer and MoE count the same way), built
    at `tp_size` (its KDA states hold linear_num_heads / tp_size heads)."""
    tokens = batch * tokens_per_row
    p_hit = 1 - (1 - config.num_experts_per_tok / config.n_routed_experts) ** tokens
    weights = experts = 0.0
    for module in modules:
        moes = {n: m for n, m in module.named_modules() if isinstance(m, MoE)}
        for name, p in module.named_parameters():
            nbytes = p.numel() * p.element_size()
            if name == "embed_tokens":
                weights += tokens * p.shape[1] * p.element_size()
            elif not _routed(name):
                weights += nbytes
        for m in moes.values():
            local = m.w13.shape[0]
            per_expert = (m.w13[0].numel() + m.w2[0].numel()) * m.w13.element_size()
            if m.w13_scale_inv is not None:
                per_expert += (m.w13_scale_inv[0].numel() + m.w2_scale_inv[0].numel()) * 4
            experts += local * p_hit * per_expert
    elem = next(modules[0].parameters()).element_size()
    dsa_layers = len(config.dsa_layers) + (len(modules) > 1)
    indexers = len(config.indexer_layers) + (len(modules) > 1)
    latents = tokens * dsa_layers * min(context, config.index_topk) * config.kv_lora_rank * elem
    keys = batch * indexers * math.ceil(context / config.index_kpool) * config.index_head_dim
    keys *= elem
    local = dataclasses.replace(config, linear_num_heads=config.linear_num_heads // tp_size)
    kda = 2 * batch * kda_state_bytes(local, elem)
    total = weights + experts + latents + keys + kda
    return {
        "weights_bytes": weights,
        "experts_bytes": experts,
        "kda_state_bytes": kda,
        "latent_bytes": latents,
        "index_key_bytes": keys,
        "total_bytes": total,
        "floor_ms": total / (bandwidth_tbps * 1e12) * 1e3,
    }


def allreduce_ms(
    tally: dict[str, list[int]], world: int, bus_gbps: float, latency_us: float
) -> float:
    """Time of `tally`'s collectives on `world` GPUs: per call latency_us plus a ring's
    2 (N-1)/N of the bytes (all-reduce) or (N-1) times the local part (all-gather) at
    bus_gbps GB/s."""
    ms = 0.0
    for kind, (calls, nbytes) in tally.items():
        moved = 2 * (world - 1) / world * nbytes if kind == "all_reduce" else (world - 1) * nbytes
        ms += calls * latency_us / 1e3 + moved / (bus_gbps * 1e9) * 1e3
    return ms

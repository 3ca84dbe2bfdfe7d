"""KDA prefill at rank 0 of TP8 (issue 44 point 5): one KDA layer of GLM-5.3-Flash over one
8,192-token request, where its time goes, and fla-core's chunk kernel beside fla's own figure.

    python3 -m bench.prefill_kda [--out F.json] [--tokens 8192] [--budget-s 45]

The layer is the real module (serving/models/kda.py) with random weights, bf16, at rank 0 of
TP8's shapes (bench.decode_mhc_kda.rank0_kda_layer: tiny_model's "real" preset, the config
bench.fast_path --simulate-rank reads; hidden 4096, 8 local heads x 128, conv kernel 4, its
input projections stacked as serving stacks them), o_proj without its all-reduce. Stages, each
written to --out as it ends; a stage is skipped once --budget-s has passed (fla autotunes its
kernels at every new head count on a fresh machine, tens of seconds each):
1. layer: the forward (CUDA events, median of REPS after warm-up), and the same forward as it
   ran before issue 44 point 5 ("before": torch.cat of q|k|v, the conv, contiguous copies of
   q and k and our l2norm of them, a copy of v, the forget gate and the gated norm as float32
   torch ops);
2. pieces: kernel time per piece of the forward, median over PROFILED forwards (torch.profiler,
   each kernel charged to the innermost labelled call that launched it,
   bench.step_costs.kernel_time_by_range): in_proj (q, k, v, f_a, g_a, b: one GEMM), the f_b
   and g_b GEMMs, the conv + SiLU with q's and k's l2norm (one kernel, and the conv state's),
   fla's chunk_kda_fwd (its gate + cumsum, intra-chunk, state pass and output kernels), the
   rest of the recurrence (the state rows gathered and written back, beta's copy), the gated
   RMSNorm, o_proj, and "rest" (beta's sigmoid, what no label covers); TFLOP/s for the GEMMs
   and fla's kernel; and fla's kernels one by one (which of them the 8 heads leave
   latency-bound: the state pass, chunk_gated_delta_rule_fwd_h, walks the 128 chunks in order);
3. fla: fla's chunk kernel alone (triton.testing.do_bench medians), as serving calls it
   (fla_ours: kernels.triton.kda.kda_extend, one request, varlen, state rows in and out, q and
   k l2-normed already, the bounded gate in fla's kernel) at our shape T8192 H8 D128 and at
   H96, and fla's
   public chunk_kda the way fla's own benchmark calls it (flash-linear-attention
   benchmarks/ops/registry.py, op chunk_kda: q, k, v ~ randn bf16, g = logsigmoid(randn) bf16,
   beta = sigmoid(randn) bf16, use_qk_l2norm_in_kernel, safe_gate, lower_bound -5; forward only
   here, no grad) at fla's shape configs B1 T8192 H96 D128 (fla_h96) and B2 T16384 H16 D128
   (fla_h16) and at ours (fla_rank_shape).

fla publishes no chunk_kda figure of its own (its README's table stops at chunk_gdn: GB200,
B1 T8192 H96 D128 fwd 1.265 ms). The nearest published figures of fla's Triton chunk_kda at
its benchmark shapes: PaddlePaddle/flash-attention PR 133 (its port of fla's kernels run by
fla's benchmarks/ops/run.py, H800): fwd B1 T8192 H96 D128 3.268 ms, B2 T16384 H16 D128 2.299 ms;
FlagGems-vllm PR 21: chunk_kda Triton [8192, 96, 128] 3.50 ms (GPU not named). Our own H200
figure at 64 heads (TP1), T 8192: 2.23 ms (docs/notebook/2026-11-29_2026-12-03.md).

FLOPs of the chunk kernel: the chunked algorithm's matmuls per 64-token chunk and head,
2 C^2 (3 Dk + 2 Dv) (A_kk, A_qk, w, u, the output's intra-chunk term) + 6 C Dk Dv (the state
pass's v_new and state update, the output's inter-chunk term), the triangular solve left out.
Bytes: q, k, v and g in bf16, beta, o in bf16, initial and final states in float32 (what it
must move at least). At 8 heads the state pass runs 8 x Dv/BV programs down 128 chunks in
order: the kernel is latency-bound, far from either ceiling, which is what these rows show.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch

from bench.step_costs import labelled, launch_map

REPS = 10  # layer forwards timed with CUDA events, after WARMUP
WARMUP = 2
PROFILED = 3  # forwards profiled for the pieces
FLA_CHUNK = 64
PIECES = (
    "in_proj",
    "f_b/g_b GEMMs",
    "conv + SiLU + l2norm",
    "fla chunk_kda_fwd",
    "recurrence rest",
    "gated RMSNorm",
    "o_proj",
)


class Stages:
    """Rows of each stage, written to --out (one JSON document) as each stage ends; stages
    started after the budget are recorded as skipped."""

    def __init__(self, out: Path | None, budget_s: float) -> None:
        self.out, self.started, self.budget_s = out, time.monotonic(), budget_s
        self.doc: dict = {"device": torch.cuda.get_device_name(), "skipped": []}

    def run(self, name: str, fn) -> None:
        if time.monotonic() - self.started > self.budget_s:
            self.doc["skipped"].append(name)
            print(f"skipped {name}: past --budget-s", flush=True)
        else:
            begun = time.monotonic()
            try:
                self.doc[name] = fn()
                print(json.dumps({name: self.doc[name]}), flush=True)
            except Exception as e:  # one stage's failure leaves the others' rows
                traceback.print_exc()
                self.doc.setdefault("failed", {})[name] = repr(e)
            self.doc.setdefault("stage_s", {})[name] = round(time.monotonic() - begun, 1)
        if self.out is not None:
            self.out.write_text(json.dumps(self.doc, indent=1) + "\n")


def event_ms(fn) -> float:
    """Median ms of fn() over REPS runs after WARMUP, each between two CUDA events."""
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def chunk_flops(tokens: int, heads: int, dk: int, dv: int) -> float:
    c = FLA_CHUNK
    chunks = -(-tokens // c)
    return chunks * heads * (2 * c * c * (3 * dk + 2 * dv) + 6 * c * dk * dv)


def chunk_bytes(tokens: int, heads: int, dk: int, dv: int, seqs: int) -> int:
    return tokens * heads * (2 * (3 * dk + dv) + 2 + 2 * dv) + 2 * seqs * heads * dk * dv * 4


def rates(ms: float, flops: float, nbytes: int) -> dict:
    return {
        "ms": round(ms, 4),
        "tflops": round(flops / ms / 1e9, 1),
        "gbps": round(nbytes / ms / 1e6),
    }


# ---------------------------------------------------------------------------------------------
# the layer
# ---------------------------------------------------------------------------------------------


class Setup:
    """Rank 0's KDA layer, one request of `tokens` in a prefill batch, its cache (device: the
    CPU only to smoke-test this file)."""

    def __init__(self, tokens: int, device: str = "cuda") -> None:
        from bench.decode_mhc_kda import rank0_kda_layer
        from serving.forward_batch import ForwardBatch
        from serving.memory.cache import KDALayerCache

        gen = torch.Generator(device=device).manual_seed(44)
        self.layer = rank0_kda_layer(False, gen, device)
        self.heads, self.dim = self.layer.heads, self.layer.dim
        self.tokens, self.hidden = tokens, self.layer.q_proj.weight.shape[1]
        rows, width = 4, 3 * self.heads * self.dim
        req_to_token = torch.zeros(rows, tokens, dtype=torch.int64, device=device)
        self.batch = ForwardBatch.build([0] * tokens, [1], [0], [tokens], req_to_token)
        conv = torch.randn(rows, width, 3, device=device, generator=gen).to(torch.bfloat16)
        state = torch.randn(rows, self.heads, self.dim, self.dim, device=device, generator=gen)
        self.cache = KDALayerCache(conv, state * 0.1)
        self.x = torch.randn(tokens, self.hidden, device=device, generator=gen).to(torch.bfloat16)

    def forward(self) -> torch.Tensor:
        return self.layer(self.x, self.batch, self.cache)

    def forward_before(self) -> torch.Tensor:
        """The extend forward as it ran before issue 44 point 5 (same kernels for the GEMMs,
        the conv and fla's chunk kernel)."""
        from kernels import kda as kda_ref
        from kernels.triton import kda as tkda

        layer, fb, cache = self.layer, self.batch, self.cache
        q, k, v, f_a, g_a, b = layer.in_proj(self.x)
        f, gate = layer.f_b_proj(f_a), layer.g_b_proj(g_a)
        w = layer.core_weights()
        mixed = torch.cat([q, k, v], dim=-1)
        mixed = tkda.causal_conv_extend(mixed, w.conv, cache.conv, fb.req_rows, fb.lens_cpu)
        q, k, v = (t.view(-1, self.heads, self.dim) for t in mixed.chunk(3, dim=-1))
        g = kda_ref.forget_gate(f, w.dt_bias, w.a_log, w.lower_bound, self.heads)
        beta = torch.sigmoid(b).float()
        o = tkda.kda_extend(
            q.contiguous(), k.contiguous(), v, g, beta, cache.state, fb.req_rows, fb.lens_cpu
        )
        return layer.o_proj(kda_ref.gated_norm(o, gate, w.o_norm, w.eps))

    def gemm_flops(self) -> dict[str, float]:
        t, width, rank = self.tokens, self.heads * self.dim, self.layer.f_a_proj.weight.shape[0]
        stacked = sum(self.layer.get_submodule(n).weight.shape[0] for n in self.layer.in_proj.names)
        return {
            "in_proj": 2 * t * self.hidden * stacked,
            "f_b/g_b GEMMs": 2 * 2 * t * rank * width,
            "o_proj": 2 * t * width * self.hidden,
            "fla chunk_kda_fwd": chunk_flops(t, self.heads, self.dim, self.dim),
        }


@contextlib.contextmanager
def labelled_pieces(layer):
    """Each piece of the layer's extend forward under its PIECES label while the block runs."""
    import fla.ops.kda.chunk_fwd as fla_chunk

    import kernels.triton.kda as tkda
    import serving.layers.attention.kda as attention

    patched = [
        (attention, "short_conv", "conv + SiLU + l2norm"),
        (attention, "delta_rule", "recurrence rest"),
        (fla_chunk, "chunk_kda_fwd", "fla chunk_kda_fwd"),
        (tkda, "gated_norm", "gated RMSNorm"),
        (layer.f_b_proj, "forward", "f_b/g_b GEMMs"),
        (layer.g_b_proj, "forward", "f_b/g_b GEMMs"),
        (layer.o_proj, "forward", "o_proj"),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patched]
    in_proj = layer.in_proj
    try:
        for owner, name, label in patched:
            setattr(owner, name, labelled(label, getattr(owner, name)))
        layer.in_proj = labelled("in_proj", in_proj)
        yield
    finally:
        layer.in_proj = in_proj
        for owner, name, fn in saved:
            if isinstance(owner, torch.nn.Module):
                delattr(owner, name)  # back to the class's forward
            else:
                setattr(owner, name, fn)


def stage_layer(s: Setup) -> dict:
    with torch.no_grad():
        after, before = event_ms(s.forward), event_ms(s.forward_before)
    return {"tokens": s.tokens, "heads": s.heads, "dim": s.dim, "ms": round(after, 4),
            "ms_before": round(before, 4)}  # fmt: skip


def stage_pieces(s: Setup) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from bench.step_costs import kernel_time_by_range
    from serving.tools.trace_summary import load

    with torch.no_grad(), labelled_pieces(s.layer):
        s.forward()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(PROFILED):
                with torch.profiler.record_function(f"kda_layer_{i}"):
                    s.forward()
                torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = load(path)
    runs = [kernel_time_by_range(trace, PIECES, f"kda_layer_{i}") for i in range(PROFILED)]
    per_run = [{**{p: t[p] for p in PIECES}, "step": t[f"kda_layer_{i}"]} for i, (t, _, _) in
               enumerate(runs)]  # fmt: skip
    kernels = runs[0][1]
    med = {k: statistics.median(r[k] for r in per_run) / 1000 for k in (*PIECES, "step")}
    med["rest"] = med["step"] - sum(med[p] for p in PIECES)
    flops = s.gemm_flops()
    rows = []
    for piece in (*PIECES, "rest"):
        row = {"piece": piece, "ms": round(med[piece], 4),
               "share": round(med[piece] / med["step"], 3),
               "kernels": kernels.get(piece)}  # fmt: skip
        if piece in flops and med[piece] > 0:
            row["tflops"] = round(flops[piece] / med[piece] / 1e9, 1)
        rows.append(row)
    kernels_step = kernels["kda_layer_0"]
    rows[-1]["kernels"] = kernels_step - sum(kernels[p] for p in PIECES)
    fla = kernels_under(trace, "fla chunk_kda_fwd", "kda_layer_0")
    return {"kernel_ms": round(med["step"], 4), "kernels": kernels_step, "rows": rows,
            "fla_kernels": fla}  # fmt: skip


def kernels_under(trace: dict, label: str, step_label: str) -> list[dict]:
    """The device kernels launched inside `label` within `step_label` (innermost labels as
    kernel_time_by_range charges them), by name in launch order: calls and us."""
    from serving.tools.trace_summary import GPU_CATS

    events, host, parent, launch_at = launch_map(trace)
    found: dict[str, dict] = {}
    for e in sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"]):
        i, inside, innermost = launch_at.get(e.get("args", {}).get("correlation")), False, None
        while i is not None:
            name = host[i].get("name")
            if innermost is None and name in PIECES:
                innermost = name
            inside |= name == step_label
            i = parent[i]
        if inside and innermost == label:
            row = found.setdefault(
                e["name"][:80], {"kernel": e["name"][:80], "calls": 0, "us": 0.0}
            )
            row["calls"] += 1
            row["us"] = round(row["us"] + float(e["dur"]), 1)
    return list(found.values())


# ---------------------------------------------------------------------------------------------
# fla's chunk kernel alone
# ---------------------------------------------------------------------------------------------


def chunk_call(tokens: int, heads: int, dim: int):
    """kda_extend as extend_core calls it (one request, varlen, state rows in and out, q and k
    l2-normed by the conv, the bounded gate in fla's kernel), on random inputs: a closure."""
    from kernels.kda import ForgetGate
    from kernels.triton import kda as tkda

    gen = torch.Generator(device="cuda").manual_seed(heads + 1)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", generator=gen).to(dtype)

    q, k, v, f = (randn(tokens, heads, dim) for _ in range(4))
    q, k = (t / t.float().norm(dim=-1, keepdim=True).to(t.dtype) for t in (q, k))
    beta = randn(tokens, heads, dtype=torch.float32).sigmoid()
    gate = ForgetGate(randn(heads * dim, dtype=torch.float32), randn(heads, dtype=torch.float32)
                      * 0.3, -5.0)  # fmt: skip
    state = randn(2, heads, dim, dim, dtype=torch.float32) * 0.1
    rows = torch.tensor([1], device="cuda")
    return lambda: tkda.kda_extend(
        q, k, v, f, beta, state, rows, [tokens], gate=gate, qk_normed=True
    )


def fla_ours(tokens: int, heads: int, dim: int) -> dict:
    """The chunk call (chunk_call) alone."""
    with torch.no_grad():
        ms = bench_ms(chunk_call(tokens, heads, dim))
    return {"shape": f"T{tokens} H{heads} D{dim} varlen, state in/out",
            **rates(ms, chunk_flops(tokens, heads, dim, dim),
                    chunk_bytes(tokens, heads, dim, dim, 1))}  # fmt: skip


def fla_public(batch: int, tokens: int, heads: int, dim: int) -> dict:
    """fla's chunk_kda with fla's benchmark inputs and flags (benchmarks/ops/registry.py)."""
    import torch.nn.functional as F
    from fla.ops.kda import chunk_kda

    gen = torch.Generator(device="cuda").manual_seed(heads)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16)

    q, k, v = (randn(batch, tokens, heads, dim) for _ in range(3))
    g = F.logsigmoid(randn(batch, tokens, heads, dim))
    beta = randn(batch, tokens, heads).sigmoid()
    flags = dict(use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=-5)
    with torch.no_grad():
        ms = bench_ms(lambda: chunk_kda(q, k, v, g, beta, **flags))
    t = batch * tokens
    return {"shape": f"B{batch} T{tokens} H{heads} D{dim}",
            **rates(ms, chunk_flops(tokens, heads, dim, dim) * batch,
                    chunk_bytes(t, heads, dim, dim, 0))}  # fmt: skip


# ---------------------------------------------------------------------------------------------


def table(doc: dict) -> str:
    lines = []
    if "layer" in doc:
        lay = doc["layer"]
        lines.append(f"KDA layer, rank 0 of TP8 ({lay['heads']} heads x {lay['dim']}), "
                     f"T {lay['tokens']}, bf16, {doc['device']}: {lay['ms']:.3f} ms "
                     f"(before: {lay['ms_before']:.3f} ms)")  # fmt: skip
    if "pieces" in doc:
        p = doc["pieces"]
        lines += ["", f"kernel time {p['kernel_ms']:.3f} ms, {p['kernels']} kernels", ""]
        lines += ["| piece | ms | share | kernels | TFLOP/s |", "|---|---|---|---|---|"]
        for r in p["rows"]:
            lines.append(f"| {r['piece']} | {r['ms']:.4f} | {100 * r['share']:.1f}% | "
                         f"{r['kernels']} | {r.get('tflops', '')} |")  # fmt: skip
        lines += ["", "| inside fla chunk_kda_fwd (one forward) | calls | us |", "|---|---|---|"]
        lines += [f"| {k['kernel']} | {k['calls']} | {k['us']} |" for k in p["fla_kernels"]]
    names = ("fla_ours", "fla_rank_shape", "fla_ours_h96", "fla_h96", "fla_h16")
    fla = [(k, doc[k]) for k in names if k in doc]
    if fla:
        lines += ["", "| fla chunk kernel | shape | ms | TFLOP/s | GB/s |", "|---|---|---|---|---|"]
        for name, r in fla:
            lines.append(f"| {name} | {r['shape']} | {r['ms']:.4f} | {r['tflops']} | {r['gbps']} |")
    if doc["skipped"]:
        lines += ["", f"skipped (budget): {', '.join(doc['skipped'])}"]
    for name, err in doc.get("failed", {}).items():
        lines += ["", f"FAILED {name}: {err}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--budget-s", type=float, default=45.0,
                    help="no stage starts after this many seconds")  # fmt: skip
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.prefill_kda needs a CUDA device")
    stages = Stages(args.out, args.budget_s)
    setup = Setup(args.tokens)
    stages.run("layer", lambda: stage_layer(setup))
    stages.run("pieces", lambda: stage_pieces(setup))
    stages.run("fla_ours", lambda: fla_ours(args.tokens, setup.heads, setup.dim))
    stages.run("fla_h96", lambda: fla_public(1, 8192, 96, 128))
    stages.run("fla_ours_h96", lambda: fla_ours(8192, 96, 128))
    stages.run("fla_rank_shape", lambda: fla_public(1, args.tokens, setup.heads, setup.dim))
    stages.run("fla_h16", lambda: fla_public(2, 16384, 16, 128))
    print(table(stages.doc), flush=True)


if __name__ == "__main__":
    main()

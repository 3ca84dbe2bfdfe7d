"""GPU benchmark of the Triton MoE, block-FP8 and fla-core KDA kernels against references.

    python -m bench.kernels_moe_kda [--out results.json] [--quick] [--no-ref]
        [--only moe|kda|fp8]

Fused MoE (kernels.triton.moe.experts, bf16) at the real GLM-5.3-Flash shapes (hidden 4096,
288 experts top-8, moe_intermediate 2048) and the bench preset's (2048, 64 top-4, 768), T in
1, 32, 128, 8192: ms, bytes of expert weights read (distinct experts selected x bytes per
expert), GB/s against the 4.23 TB/s copy bandwidth, TFLOP/s (2 * T * k * 3 * I * Hd), beside
kernels.moe.experts (sorted loop, host syncs) and, for T <= 128, kernels.moe.experts_dense.
KDA (64 heads x 128, bf16 q/k/v, float32 g/beta/state): chunked prefill of one 8,192-token
request and fused recurrent decode at batch 1, 32, 128 (bytes: state read + written, plus
q/k/v/g/beta/o), and the causal conv, beside kernels.kda; the conv also as rank 0 of TP8 runs it
(conv_qkv_extend of 8 heads on the stacked projection's output).

Block FP8 (--only fp8): the W8A8 linear (kernels/triton/fp8.py) at every quantized projection's
real shape (TP1) for 8,192 tokens, TFLOP/s beside bf16 F.linear (cuBLAS) in the same run, with
both GEMM backends side by side (triton_ms: the Triton GEMM with the quantization fused;
scaled_mm_ms: quantize_act + torch._scaled_mm, cuBLASLt block scales; `backend` is the one
block_fp8_linear picks: the skinny GEMM up to 64 tokens) and each GEMM alone on pre-quantized
activations; the same at 1 / 32 / 128 tokens as GB/s of weights read, timed as device time
under CUDA graphs (the decode path; bench/decode_gemm.py has the rank-0 shapes).
The FP8 fused MoE (experts_fp8) at the real and bench shapes for 1 / 32 / 128 / 8,192 tokens:
GB/s of FP8 expert weights read (distinct experts x (3 I Hd bytes + scales)) against the
4.23 TB/s copy ceiling, TFLOP/s, beside the bf16 fused MoE on the same routing.

Prints a markdown table; --out writes the rows as JSON. Times are medians of
triton.testing.do_bench after its warm-up; the torch references that take seconds are timed
over fewer runs with CUDA events.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable

import torch

COPY_BW = 4.23e12  # bytes/s, H200 device-to-device copy measured on the lent machine
BF16_PEAK = 790e12  # FLOP/s, measured dense bf16 matmul

MOE_SHAPES = {
    # name: (hidden, experts, moe_intermediate, top_k)
    "real": (4096, 288, 2048, 8),
    "bench": (2048, 64, 768, 4),
}
KDA_HEADS, KDA_DIM, CONV_K = 64, 128, 4
DEVICE = "cuda"


def _time(fn: Callable[..., object], *args, slow: bool = False, **kwargs) -> float:
    """Median ms of fn(*args, **kwargs). Slow functions (the torch references at large
    shapes): 1 warm-up, 3 runs."""
    import triton.testing

    fn = functools.partial(fn, *args, **kwargs)
    if not slow:
        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[1]


def _with_history(fn, *args):
    """Call fn with a fresh history list (the verify path); the list is dropped at once."""
    return fn(*args, [])


def _row(kernel, shape, batch, ms, ref_ms, nbytes=None, flops=None, ref_name="torch", **extra):
    row = {
        "kernel": kernel,
        "shape": shape,
        "batch": batch,
        "ms": round(ms, 4),
        "ref": ref_name,
        "ref_ms": None if ref_ms is None else round(ref_ms, 3),
        "speedup": None if ref_ms is None else round(ref_ms / ms, 1),
        "bytes": nbytes,
        "GB/s": None if nbytes is None else round(nbytes / ms / 1e6, 1),
        "%copy_bw": None if nbytes is None else round(100 * nbytes / (ms * 1e-3) / COPY_BW, 1),
        "TFLOP/s": None if flops is None else round(flops / ms / 1e9, 1),
        "%bf16_peak": None if flops is None else round(100 * flops / (ms * 1e-3) / BF16_PEAK, 1),
    }
    row.update(extra)
    return row


def bench_moe(tokens_list, with_ref: bool) -> list[dict]:
    from kernels import moe as moe_ref
    from kernels.triton import moe as tmoe

    rows = []
    dev, dtype = "cuda", torch.bfloat16
    for name, (hidden, experts, inter, top_k) in MOE_SHAPES.items():
        gen = torch.Generator(device=dev).manual_seed(0)
        w13 = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=dtype, generator=gen)
        w13 *= hidden**-0.5
        w2 = torch.randn(experts, hidden, inter, device=dev, dtype=dtype, generator=gen)
        w2 *= inter**-0.5
        per_expert = 3 * inter * hidden * w13.element_size()
        for tokens in tokens_list:
            x = torch.randn(tokens, hidden, device=dev, dtype=dtype, generator=gen)
            scores = torch.rand(tokens, experts, device=dev, generator=gen)
            weights, ids = scores.topk(top_k, dim=-1)
            weights = weights / weights.sum(-1, keepdim=True)
            distinct = int(ids.unique().numel())
            nbytes = distinct * per_expert + 2 * tokens * hidden * x.element_size()
            flops = 2 * tokens * top_k * 3 * inter * hidden
            ms = _time(tmoe.experts, x, w13, w2, weights, ids, 10.0)
            ref_ms = None
            if with_ref:
                args = (x, w13, w2, weights, ids, 10.0)
                ref_ms = _time(moe_ref.experts, *args, slow=tokens > 128)
            extra = {
                "distinct_experts": distinct,
                "block_m": tmoe.moe_config(tokens * top_k, experts, hidden, inter, dtype).block_m,
            }
            if with_ref and tokens <= 128:
                extra["dense_ref_ms"] = round(
                    _time(moe_ref.experts_dense, x, w13, w2, weights, ids, 10.0), 3
                )
            rows.append(
                _row("moe.experts", name, tokens, ms, ref_ms, nbytes, flops, "experts", **extra)
            )
            print(_fmt(rows[-1]), flush=True)
        del w13, w2
        torch.cuda.empty_cache()
    return rows


def _kda_inputs(tokens, num_rows, dev, gen):
    heads, dim = KDA_HEADS, KDA_DIM
    q, k, v = (
        torch.randn(tokens, heads, dim, device=dev, generator=gen).bfloat16() for _ in range(3)
    )
    g = -5.0 * torch.sigmoid(torch.randn(tokens, heads, dim, device=dev, generator=gen) - 2)
    beta = torch.sigmoid(torch.randn(tokens, heads, device=dev, generator=gen))
    state = torch.randn(num_rows, heads, dim, dim, device=dev, generator=gen) * 0.1
    return q, k, v, g, beta, state


def bench_kda(prefill_tokens: int, decode_batches, with_ref: bool) -> list[dict]:
    from kernels import kda as kda_ref
    from kernels.triton import kda as tkda

    rows = []
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    heads, dim = KDA_HEADS, KDA_DIM
    chans = 3 * heads * dim

    # chunked prefill, one request
    q, k, v, g, beta, state = _kda_inputs(prefill_tokens, 8, dev, gen)
    sel = torch.tensor([3], device=dev)
    lens = [prefill_tokens]
    for safe_gate in (False, True):
        ms = _time(tkda.kda_extend, q, k, v, g, beta, state, sel, lens, safe_gate=safe_gate)
        ref_ms = None
        if with_ref and not safe_gate:
            ref_ms = _time(kda_ref.kda_extend, q, k, v, g, beta, state, sel, lens, slow=True)
        rows.append(
            _row(
                f"kda_extend (chunk{', safe_gate' if safe_gate else ''})",
                f"{heads}x{dim}",
                prefill_tokens,
                ms,
                ref_ms,
                tokens_per_s=round(prefill_tokens / ms * 1e3),
            )
        )
        print(_fmt(rows[-1]), flush=True)

    x = torch.randn(prefill_tokens, chans, device=dev, generator=gen).bfloat16()
    weight = torch.randn(chans, CONV_K, device=dev, generator=gen)
    conv_state = torch.randn(8, chans, CONV_K - 1, device=dev, generator=gen).bfloat16()
    ms = _time(tkda.causal_conv_extend, x, weight, conv_state, sel, lens)
    ref_ms = None
    if with_ref:
        ref_ms = _time(kda_ref.causal_conv_extend, x, weight, conv_state, sel, lens)
    nbytes = 2 * x.numel() * x.element_size()
    rows.append(_row("causal_conv_extend", f"C={chans}", prefill_tokens, ms, ref_ms, nbytes))
    print(_fmt(rows[-1]), flush=True)
    # rank 0 of TP8: conv_qkv_extend on the stacked projection's output (q | k | v of 8 heads,
    # then f_a, g_a and b: rows of 3,336 columns, an odd multiple of 8)
    rank_heads = heads // 8
    rank_chans = 3 * rank_heads * dim
    stacked = torch.randn(prefill_tokens, rank_chans + 2 * dim + rank_heads, device=dev)
    x_rank = stacked.bfloat16()[:, :rank_chans]
    w_rank, state_rank = weight[:rank_chans].contiguous(), conv_state[:, :rank_chans].contiguous()
    ms = _time(tkda.conv_qkv_extend, x_rank, w_rank, state_rank, sel, lens, rank_heads)
    ref_ms = None
    if with_ref:
        ref_ms = _time(kda_ref.conv_qkv_extend, x_rank, w_rank, state_rank, sel, lens, rank_heads)
    nbytes = 2 * x_rank.numel() * x_rank.element_size()
    shape = f"C={rank_chans}, rows {stacked.shape[1]} apart"
    rows.append(_row("conv_qkv_extend (rank 0)", shape, prefill_tokens, ms, ref_ms, nbytes))
    print(_fmt(rows[-1]), flush=True)
    del q, k, v, g, beta, state, x, stacked, x_rank
    torch.cuda.empty_cache()

    for batch in decode_batches:
        num_rows = 2 * batch + 8
        q, k, v, g, beta, state = _kda_inputs(batch, num_rows, dev, gen)
        sel = torch.randperm(num_rows, device=dev, generator=gen)[:batch]
        state_bytes = 2 * batch * heads * dim * dim * 4
        io_bytes = sum(t.numel() * t.element_size() for t in (q, k, v, g, beta, v))
        ms = _time(tkda.kda_decode, q, k, v, g, beta, state, sel)
        ref_ms = None
        if with_ref:
            ref_ms = _time(kda_ref.kda_decode, q, k, v, g, beta, state, sel)
        rows.append(
            _row(
                "kda_decode (fused recurrent)",
                f"{heads}x{dim}",
                batch,
                ms,
                ref_ms,
                state_bytes + io_bytes,
            )
        )
        print(_fmt(rows[-1]), flush=True)
        qs, ks, vs, gs, bs, _ = _kda_inputs(batch * 2, num_rows, dev, gen)
        ms = _time(_with_history, tkda.kda_uniform, qs, ks, vs, gs, bs, state, sel, 2)
        ref_ms = None
        if with_ref:
            ref_ms = _time(_with_history, kda_ref.kda_uniform, qs, ks, vs, gs, bs, state, sel, 2)
        rows.append(_row("kda_uniform L=2 + history (verify)", f"{heads}x{dim}", batch, ms, ref_ms))
        print(_fmt(rows[-1]), flush=True)

        x = torch.randn(batch, chans, device=dev, generator=gen).bfloat16()
        conv_state = torch.randn(num_rows, chans, CONV_K - 1, device=dev, generator=gen)
        conv_state = conv_state.bfloat16()
        ms = _time(tkda.causal_conv_decode, x, weight, conv_state, sel)
        ref_ms = None
        if with_ref:
            ref_ms = _time(kda_ref.causal_conv_decode, x, weight, conv_state, sel)
        nbytes = 2 * x.numel() * 2 + 2 * batch * chans * (CONV_K - 1) * 2
        rows.append(_row("causal_conv_decode", f"C={chans}", batch, ms, ref_ms, nbytes))
        print(_fmt(rows[-1]), flush=True)
    return rows


# GLM-5.3-Flash's quantized projections at TP1, (out, in): what the FP8 linear runs
REAL_FP8_LINEARS = {
    "kda q/k/v": (8192, 4096),
    "kda f_a/g_a": (128, 4096),
    "kda f_b/g_b": (8192, 128),
    "kda b": (64, 4096),
    "kda o": (4096, 8192),
    "mla q_a": (1536, 4096),
    "mla q_b": (16384, 1536),
    "mla kv_a": (512, 4096),
    "mla o": (4096, 16384),
    "indexer wq_b": (4096, 1536),
    "indexer wk": (128, 4096),
    "dense gate/up": (12288, 4096),
    "dense down": (4096, 12288),
    "shared expert gate/up": (2048, 4096),
    "shared expert down": (4096, 2048),
}


def _copies(nbytes: int) -> int:
    """Weight copies that together exceed the H200's 50 MiB L2 twice (at most 32)."""
    return max(2, min(32, -(-(100 << 20) // nbytes)))


def bench_fp8_linear(prefill: int, decode_tokens) -> list[dict]:
    """Per real shape and token count: block_fp8_linear (its chosen backend) beside each backend
    alone (triton: the Triton GEMM, quantization fused; scaled_mm: quantize_act +
    torch._scaled_mm, where the shape passed its probe) and bf16 F.linear. Prefill: eager
    do_bench (and each GEMM alone on pre-quantized activations); decode token counts: device
    time under CUDA graphs over weight copies (what decode steps see)."""
    import torch.nn.functional as F

    from kernels import fp8 as fp8_ref
    from kernels.triton import fp8 as tfp8

    rows = []
    dev = DEVICE
    gen = torch.Generator(device=dev).manual_seed(0)
    for name, (n, k) in REAL_FP8_LINEARS.items():
        w = torch.randn(n, k, device=dev, generator=gen) * k**-0.5
        w8, scale = fp8_ref.quantize_weight(w)
        w16 = w.bfloat16()
        del w
        use_mm = tfp8.scaled_mm_usable(n, k, torch.bfloat16, dev)
        fns = {
            "chosen": tfp8.block_fp8_linear,
            "triton": tfp8.block_fp8_linear_triton,
            "scaled_mm": tfp8.block_fp8_linear_scaled_mm if use_mm else None,
        }
        copies = _copies(n * k)
        fp8_ops = [(w8.clone(), scale.clone()) for _ in range(copies)]
        bf16_ops = [w16.clone() for _ in range(_copies(2 * n * k))]
        for tokens in (prefill, *decode_tokens):
            x = torch.randn(tokens, k, device=dev, generator=gen).bfloat16()
            flops = 2 * tokens * n * k
            times = {}
            for key, fn in fns.items():
                if fn is None:
                    continue
                if tokens == prefill:
                    times[key] = _time(fn, x, w8, scale)
                else:
                    times[key] = (
                        tfp8.graph_time_us(lambda op, fn=fn, x=x: fn(x, *op), fp8_ops) / 1e3
                    )
            if tokens == prefill:
                bf16_ms = _time(F.linear, x, w16)
            else:
                bf16_ms = tfp8.graph_time_us(lambda op, x=x: F.linear(x, op), bf16_ops) / 1e3
            ms = times["chosen"]
            extra = {
                "backend": tfp8.linear_gemm(tokens, n, k, torch.bfloat16, dev),
                "timing": "eager" if tokens == prefill else "graph",
                "triton_ms": round(times["triton"], 4),
                "scaled_mm_ms": round(times["scaled_mm"], 4) if "scaled_mm" in times else None,
                "bf16_ms": round(bf16_ms, 4),
                "vs_bf16": round(bf16_ms / ms, 2),
                "bf16_TFLOP/s": round(flops / bf16_ms / 1e9, 1),
            }
            if tokens == prefill:
                x8, xs = tfp8.quantize_act(x)
                gemm_ms = _time(tfp8.fp8_gemm, x8, xs, w8, scale, x.dtype)
                extra["triton_gemm_only_TFLOP/s"] = round(flops / gemm_ms / 1e9, 1)
                if use_mm:
                    x8, xs = tfp8.quantize_act(x, group_major=True)
                    gemm_ms = _time(tfp8.scaled_mm_gemm, x8, xs, w8, scale, x.dtype)
                    extra["scaled_mm_gemm_only_TFLOP/s"] = round(flops / gemm_ms / 1e9, 1)
            nbytes = n * k + scale.numel() * 4 + tokens * (k + n) * 2
            rows.append(
                _row(f"fp8 linear {name}", f"{n}x{k}", tokens, ms, None, nbytes, flops, **extra)
            )
            print(_fmt(rows[-1]), flush=True)
        del fp8_ops, bf16_ops
    return rows


def _fp8_experts(hidden, experts, inter, dev, gen):
    """Random block-FP8 w13 (gate and up quantized apart), w2 and scales, expert by expert."""
    from kernels import fp8 as fp8_ref

    nb, hb = fp8_ref.blocks(inter), fp8_ref.blocks(hidden)
    w13 = torch.empty(experts, 2 * inter, hidden, device=dev, dtype=fp8_ref.FP8)
    w2 = torch.empty(experts, hidden, inter, device=dev, dtype=fp8_ref.FP8)
    s13 = torch.empty(experts, 2 * nb, hb, device=dev)
    s2 = torch.empty(experts, hb, nb, device=dev)
    for e in range(experts):
        for half in (0, 1):
            w = torch.randn(inter, hidden, device=dev, generator=gen) * hidden**-0.5
            rows, blocks = (
                slice(half * inter, (half + 1) * inter),
                slice(half * nb, (half + 1) * nb),
            )
            w13[e, rows], s13[e, blocks] = fp8_ref.quantize_weight(w)
        w = torch.randn(hidden, inter, device=dev, generator=gen) * inter**-0.5
        w2[e], s2[e] = fp8_ref.quantize_weight(w)
    return w13, w2, s13, s2


def bench_moe_fp8(tokens_list) -> list[dict]:
    from kernels.triton import moe as tmoe
    from kernels.triton.fp8 import graph_time_us

    rows = []
    dev = DEVICE
    for name, (hidden, experts, inter, top_k) in MOE_SHAPES.items():
        gen = torch.Generator(device=dev).manual_seed(0)
        w13, w2, s13, s2 = _fp8_experts(hidden, experts, inter, dev, gen)
        w13_16 = torch.randn(experts, 2 * inter, hidden, device=dev, generator=gen).bfloat16()
        w2_16 = torch.randn(experts, hidden, inter, device=dev, generator=gen).bfloat16()
        per_expert = 3 * inter * hidden + (s13[0].numel() + s2[0].numel()) * 4
        for tokens in tokens_list:
            x = torch.randn(tokens, hidden, device=dev, generator=gen).bfloat16()
            scores = torch.rand(tokens, experts, device=dev, generator=gen)
            weights, ids = scores.topk(top_k, dim=-1)
            weights = weights / weights.sum(-1, keepdim=True)
            distinct = int(ids.unique().numel())
            nbytes = distinct * per_expert + 2 * tokens * hidden * x.element_size()
            flops = 2 * tokens * top_k * 3 * inter * hidden
            fp8_args = (x, w13, w2, s13, s2, weights, ids, 10.0)
            bf16_args = (x, w13_16, w2_16, weights, ids, 10.0)
            if tokens <= 128:  # decode: device time under a CUDA graph, as the decode graphs run
                ms = graph_time_us(lambda a: tmoe.experts_fp8(*a), [fp8_args]) / 1e3
                bf16_ms = graph_time_us(lambda a: tmoe.experts(*a), [bf16_args]) / 1e3
            else:
                ms = _time(tmoe.experts_fp8, *fp8_args)
                bf16_ms = _time(tmoe.experts, *bf16_args)
            cfg = tmoe.moe_config(tokens * top_k, experts, hidden, inter, w13.dtype)
            extra = {"distinct_experts": distinct, "block_m": cfg.block_m}
            extra["timing"] = "graph" if tokens <= 128 else "eager"
            extra.update(bf16_ms=round(bf16_ms, 4), vs_bf16=round(bf16_ms / ms, 2))
            rows.append(_row("moe.experts_fp8", name, tokens, ms, None, nbytes, flops, **extra))
            print(_fmt(rows[-1]), flush=True)
        del w13, w2, s13, s2, w13_16, w2_16
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


COLUMNS = ["kernel", "shape", "batch", "ms", "ref_ms", "speedup", "GB/s", "%copy_bw", "TFLOP/s"]
COLUMNS += ["bf16_ms", "vs_bf16", "backend", "timing", "triton_ms", "scaled_mm_ms"]


def _fmt(row: dict) -> str:
    return "| " + " | ".join("" if row.get(c) is None else str(row[c]) for c in COLUMNS) + " |"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--quick", action="store_true", help="T in 1, 32 and a 1,024-token prefill")
    ap.add_argument("--no-ref", action="store_true", help="skip the torch references")
    ap.add_argument("--only", choices=["moe", "kda", "fp8"], help="one family only")
    args = ap.parse_args(argv)
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    torch.backends.cuda.matmul.allow_tf32 = False
    tokens = [1, 32] if args.quick else [1, 32, 128, 8192]
    prefill = 1024 if args.quick else 8192
    batches = [1, 32] if args.quick else [1, 32, 128]
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}"
    )
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    rows: list[dict] = []
    with torch.inference_mode():
        if args.only in (None, "moe"):
            rows += bench_moe(tokens, not args.no_ref)
        if args.only in (None, "kda"):
            rows += bench_kda(prefill, batches, not args.no_ref)
        if args.only in (None, "fp8"):
            rows += bench_fp8_linear(prefill, [1, 32] if args.quick else [1, 32, 128])
            rows += bench_moe_fp8(tokens)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(), "copy_bw": COPY_BW, "rows": rows},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()

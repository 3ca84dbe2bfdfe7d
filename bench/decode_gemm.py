"""Decode-sized linears of rank 0 of GLM-5.3-Flash at TP8/EP8 (issue 43): before and after the
skinny GEMM (kernels/triton/skinny_gemm.py), bf16 and block FP8, at 1, 2, 8 and 32 tokens.

    python -m bench.decode_gemm            # the table, one JSON line per row (< 60 s on an H200)
    python -m bench.decode_gemm --sweep    # the skinny GEMM's tilings per row, for skinny_config

A row: {"name", "batch", "dtype", "us_old", "us_new", "floor_us", "launches_old",
"launches_new", ...}, microseconds per call (launches_old null: cuBLAS's own choice, one GEMM or
a split-K GEMM and its reduction).
- dtype bf16: us_old cuBLAS (F.linear, what a bf16 projection runs unless serving.layers.linear's
  SKINNY_DENSE_MAX_TOKENS says otherwise), us_new the skinny GEMM (one row: its GEMV form,
  "form": "gemv", with us_dot the tl.dot form beside it; 2-8 rows: us_gemv, the GEMV form at
  those rows, which GEMV_MAX_ROWS keeps off by default);
- dtype fp8: us_old the FP8 path before the skinny GEMM (block_fp8_linear's old backends:
  torch._scaled_mm with its activation quantization where the shape's probe passes, else the
  Triton GEMM with the quantization fused), us_new quantize_act then the skinny GEMM (two
  launches: block_fp8_linear up to kernels/triton/fp8.py's SKINNY_MAX_TOKENS rows), us_bf16_old
  the bf16 row's
  cuBLAS (what the start-up timing kept these shapes on; the DSA layer in FP8 runs "dsa in_proj"
  and "dsa in_proj rest" against the bf16 layer's one GEMM);
- floor_us: the weight's bytes (FP8: with its scales) at 4.23 TB/s, the H200's measured copy
  bandwidth; new_over_floor = us_new / floor_us.
Shapes: the projections as a rank-0 layer runs them (RANK0_LINEARS): stacked input projections
as one GEMM (FP8 stacks padded to 16 rows; the DSA layer's bf16 kpool gate and weights_proj stay
apart from its FP8 stack, a second GEMM), both indexer head counts (4 local heads, as today, or
all 32).

Timing: the calls captured in one CUDA graph over weight copies (each with its own input) that
add up to more than twice the L2, so every call reads its weight from HBM as a decode step's
successive layers do; the median of REPLAYS replays, per call.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

DEVICE = "cuda"
HBM_BYTES_PER_US = 4.23e6  # 4.23 TB/s
TOKENS = (1, 2, 8, 32)  # 2: EAGLE's verify at batch 1
REPLAYS = 20
MAX_COPIES = 256
# --sweep: skinny_config's (target_programs, partial_bytes)
SWEEP = ((132, 1), (264, 1), (528, 1), (264, 4), (528, 4), (792, 4))
# --sweep, one bf16 row: gemv_config's (target_programs, block_n, block_k)
GEMV_SWEEP = ((264, 16, 256), (396, 16, 256), (528, 16, 256), (792, 16, 256), (396, 8, 256),
              (396, 32, 256), (396, 16, 128), (396, 16, 512), (396, 8, 512))  # fmt: skip

# name: (N in bf16, N in block FP8 or None: bf16 only, K), at rank 0 of TP8/EP8
RANK0_LINEARS = {
    # q, k, v 1024 each, f_a and g_a 128, b 8; FP8: padded to 3344 rows
    "kda in_proj": (3 * 1024 + 128 + 128 + 8, 3344, 4096),
    "kda o_proj": (4096, 4096, 1024),
    "kda f_b/g_b": (1024, 1024, 128),
    # q_a 1536, kv_a 512, indexer wk 128, kpool gate 128, weights_proj 4 (or 32); FP8: q_a, kv_a
    # and wk (the gate and weights_proj are bf16 in the checkpoint: "dsa in_proj rest")
    "dsa in_proj, 4 index heads": (1536 + 512 + 128 + 128 + 4, 2176, 4096),
    "dsa in_proj, 32 index heads": (1536 + 512 + 128 + 128 + 32, 2176, 4096),
    "dsa in_proj rest, 4 index heads": (128 + 4, None, 4096),
    "dsa in_proj rest, 32 index heads": (128 + 32, None, 4096),
    "mla q_b": (2048, 2048, 1536),
    "indexer wq_b, 4 heads": (512, 512, 1536),
    "indexer wq_b, 32 heads": (4096, 4096, 1536),
    "dsa o_proj": (4096, 4096, 2048),
    "dense gate_up": (2 * 1536, 2 * 1536, 4096),
    "dense down": (4096, 4096, 1536),
    "shared expert gate_up": (2 * 256, 2 * 256, 4096),
    "shared expert down": (4096, 4096, 256),
    "lm_head": (19360, None, 4096),
}


def graph_us(fn, operands: list) -> float:
    """Median device microseconds per fn(*op), one CUDA graph calling it once per operand set."""
    from kernels.triton.fp8 import graph_time_us

    return graph_time_us(lambda op: fn(*op), operands, REPLAYS)


def _copies(weight_bytes: int) -> int:
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(2, min(MAX_COPIES, -(-5 * l2 // (2 * weight_bytes))))


def _weight(n: int, k: int, gen) -> torch.Tensor:
    return torch.randn(n, k, device=DEVICE, generator=gen) * k**-0.5


def _inputs(m: int, k: int, copies: int, gen) -> list[torch.Tensor]:
    return [
        torch.randn(m, k, device=DEVICE, generator=gen, dtype=torch.bfloat16) for _ in range(copies)
    ]


def rows_for(name: str, gen) -> list[dict]:
    from kernels.fp8 import quantize_weight
    from kernels.triton import fp8 as tfp8
    from kernels.triton.skinny_gemm import (
        GEMV_MAX_ROWS,
        GEMV_ROWS_LIMIT,
        gemv_config,
        skinny_config,
        skinny_linear,
    )

    n16, n8, k = RANK0_LINEARS[name]
    out = []
    w16 = _weight(n16, k, gen).bfloat16()
    dense = [w16.clone() for _ in range(_copies(w16.numel() * 2))]
    del w16
    if n8 is not None:
        w8, scale = quantize_weight(_weight(n8, k, gen))
        fp8_bytes = w8.numel() + scale.numel() * 4
        fp8 = [(w8.clone(), scale.clone()) for _ in range(_copies(fp8_bytes))]
        del w8, scale
        scaled_mm = tfp8.scaled_mm_usable(n8, k, torch.bfloat16, DEVICE)
        old_fp8 = tfp8.block_fp8_linear_scaled_mm if scaled_mm else tfp8.block_fp8_linear_triton
    for m in TOKENS:
        xs = _inputs(m, k, len(dense), gen)
        cublas = graph_us(F.linear, list(zip(xs, dense)))
        new = graph_us(skinny_linear, list(zip(xs, dense)))
        floor = n16 * k * 2 / HBM_BYTES_PER_US
        row = _row(name, m, "bf16", (n16, k), cublas, new, floor, None, 1)
        if m <= GEMV_MAX_ROWS:  # us_new is the GEMV form; the tl.dot form beside it
            cfg = skinny_config(m, n16, k, 2)
            dot = lambda x, w, cfg=cfg: skinny_linear(x, w, config=cfg)  # noqa: E731
            row["form"] = "gemv"
            row["us_dot"] = round(graph_us(dot, list(zip(xs, dense))), 2)
        elif m <= GEMV_ROWS_LIMIT:  # the GEMV form beside (GEMV_MAX_ROWS keeps it off here)
            cfg = gemv_config(n16, k, rows=m)
            gemv = lambda x, w, cfg=cfg: skinny_linear(x, w, config=cfg)  # noqa: E731
            row["us_gemv"] = round(graph_us(gemv, list(zip(xs, dense))), 2)
        out.append(row)
        if n8 is None:
            continue
        xs = _inputs(m, k, len(fp8), gen)
        ops = [(x, *op) for x, op in zip(xs, fp8)]
        old = graph_us(old_fp8, ops)
        skinny = lambda x, w8, s: skinny_linear(x, w8, s, x_fp8=tfp8.quantize_act(x))  # noqa: E731
        new = graph_us(skinny, ops)
        floor = fp8_bytes / HBM_BYTES_PER_US
        launches_old = (3 if m % tfp8.SCALED_MM_ROWS else 2) if scaled_mm else 1
        row = _row(name, m, "fp8", (n8, k), old, new, floor, launches_old, 2)
        row["old_gemm"] = "scaled_mm" if scaled_mm else "triton"
        row["us_bf16_old"] = round(cublas, 2)
        row["new_vs_bf16_old"] = round(cublas / new, 2)
        out.append(row)
    return out


def _row(name, m, dtype, shape, old, new, floor, launches_old, launches_new) -> dict:
    return {
        "name": name,
        "batch": m,
        "dtype": dtype,
        "shape": list(shape),
        "us_old": round(old, 2),
        "us_new": round(new, 2),
        "floor_us": round(floor, 2),
        "old_over_floor": round(old / floor, 2),
        "new_over_floor": round(new / floor, 2),
        "launches_old": launches_old,
        "launches_new": launches_new,
    }


def sweep_for(name: str, gen) -> list[dict]:
    """The skinny GEMM at each SWEEP tiling (skinny_config's target_programs and partial_bytes),
    per count and dtype: the fastest and every distinct tiling's time (N tile, splits x steps),
    for tuning skinny_config; for one bf16 row the GEMV form's GEMV_SWEEP tilings too ("gemv"
    keys, with the K step), for gemv_config."""
    from kernels.fp8 import quantize_weight
    from kernels.triton.fp8 import quantize_act
    from kernels.triton.skinny_gemm import gemv_config, skinny_config, skinny_linear

    n16, n8, k = RANK0_LINEARS[name]
    out = []
    for dtype, n in (("bf16", n16), ("fp8", n8)):
        if n is None:
            continue
        w = _weight(n, k, gen)
        w_bytes = 2 if dtype == "bf16" else 1
        op = (w.bfloat16(),) if dtype == "bf16" else quantize_weight(w)
        ops = [tuple(t.clone() for t in op) for _ in range(_copies(n * k * w_bytes))]
        del w, op
        for m in TOKENS:
            xs = _inputs(m, k, len(ops), gen)
            times = {}
            configs = [
                (f"n{c.block_n} s{c.splits}x{c.steps}", c)
                for c in (skinny_config(m, n, k, w_bytes, t, b) for t, b in SWEEP)
            ]
            if dtype == "bf16" and m == 1:
                configs += [
                    (f"gemv n{c.block_n} k{c.block_k} s{c.splits}x{c.steps}", c)
                    for c in (gemv_config(n, k, *g) for g in GEMV_SWEEP)
                ]
            for key, cfg in configs:
                if key in times:
                    continue
                # FP8 with its quantize_act launch, as block_fp8_linear runs it
                fn = lambda x, *o, cfg=cfg: skinny_linear(  # noqa: E731
                    x, *o, config=cfg, x_fp8=quantize_act(x) if len(o) == 2 else None
                )
                times[key] = round(graph_us(fn, [(x, *o) for x, o in zip(xs, ops)]), 2)
            best = min(times, key=times.get)
            floor = n * k * w_bytes / HBM_BYTES_PER_US
            out.append(
                {"name": name, "batch": m, "dtype": dtype, "best": best, "us": times,
                 "floor_us": round(floor, 2)}
            )  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="time skinny_config's tilings")
    parser.add_argument("--only", nargs="*", help="RANK0_LINEARS names (default: all)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench.decode_gemm needs a CUDA device")
    started = time.monotonic()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for name in args.only or RANK0_LINEARS:
        for row in (sweep_for if args.sweep else rows_for)(name, gen):
            print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    print(json.dumps({"seconds": round(time.monotonic() - started, 1)}), flush=True)


if __name__ == "__main__":
    main()

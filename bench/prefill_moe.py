"""GPU benchmark of one prefill chunk's routed experts at rank 0 of TP8/EP8 of GLM-5.3-Flash.

    python -m bench.prefill_moe [--out results.json] [--configs]

Rank shape: Hd 4096, moe_intermediate 2048, 288 experts top-8 of which this rank holds 36
(ids 0..35). Routing as the layer's: top-8 of random scores over all 288, weights renormalised
over the 8, ids of other ranks' experts set to 36 (skipped). For 2,048 / 8,192 / 16,384 tokens
(about T local pairs: 8 x 36 / 288 per token), each row is one whole routed-experts call (sort /
align, gather, both GEMMs, SwiGLU, combine), timed as the median of triton.testing.do_bench
after its warm-up, and its useful TFLOP/s: local pairs x 6 x Hd x I (gate+up 2 Hd 2I, down
2 I Hd) over the time. floor_ms: the experts' weight bytes at the 4.23 TB/s copy bandwidth.

Rows (`path`):
- triton bf16: kernels.triton.moe.experts, today's path (its prefill MoEConfig);
- grouped bf16: kernels.triton.moe_grouped.experts_grouped (torch._grouped_mm), and its steps
  alone (`grouped: sort` ... `grouped: combine`; `sum of steps` beside the whole call);
- triton fp8: kernels.triton.moe.experts_fp8 (128 x 128 block scales), today's FP8 path;
- fp8 grouped: kernels.triton.moe_fp8_grouped.experts_fp8_grouped (persistent TMA grouped
  GEMMs, the same numerics), its default config, and its steps alone (`fp8 grouped: layout` ...
  `fp8 grouped: combine`; the GEMMs' own TFLOP/s count the padded rows they compute too);
- fp8 rowwise grouped GEMMs only: torch._scaled_grouped_mm's two GEMMs on pre-quantized inputs
  with row-wise scales (per token row, per output channel): NOT the checkpoint's block-128
  numerics (torch has no grouped GEMM with 128 x 128 weight blocks on sm90), an upper bound of
  what a library grouped FP8 path could reach; no sort, gather, quantization or combine
  (`, fast_accum`: the same with use_fast_accum=True).
--configs: the fused Triton MoE's MoEConfig tiles at 8,192 tokens, bf16 and FP8 alternated,
then listed best first per dtype (a config that fails to compile or exceeds shared memory
prints its error); no config starts after SWEEP_SECONDS. Then fp8 grouped's GroupedFP8Config
tiles at 8,192 tokens, best first; none starts after FP8_GROUPED_SWEEP_SECONDS.

Prints a markdown table; --out writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import time
from unittest import mock

import torch

HIDDEN, INTER, EXPERTS, TOP_K, LOCAL = 4096, 2048, 288, 8, 36
LIMIT = 7.0
TOKENS = (2048, 8192, 16384)
SWEEP_TOKENS = 8192
SWEEP_SECONDS = 35.0  # new configs start until then; the last one may run a few s past
COPY_BW = 4.23e12  # bytes/s, H200 device-to-device copy measured on the lent machine

# (block_m, gu_block_n, gu_block_k, down_block_n, down_block_k, num_warps, num_stages); the
# first of each list is today's prefill config. Most plausible first: the sweep is time-boxed.
BF16_CONFIGS = [
    (128, 64, 32, 128, 64, 8, 4),
    (128, 64, 32, 128, 64, 8, 3),
    (128, 64, 32, 128, 64, 8, 5),
    (128, 64, 64, 128, 64, 8, 3),
    (128, 64, 32, 256, 64, 8, 3),
    (128, 64, 32, 256, 32, 8, 4),
    (128, 64, 64, 128, 128, 8, 3),
    (128, 128, 32, 128, 64, 8, 3),
    (128, 64, 32, 128, 64, 4, 4),
    (64, 64, 64, 128, 64, 8, 4),
    (64, 128, 64, 256, 64, 8, 3),
    (64, 64, 32, 128, 64, 4, 5),
    (64, 128, 32, 128, 128, 4, 4),
    (128, 32, 64, 128, 64, 4, 4),
]
# FP8: each K step is one 128-column scale group or half of one
FP8_CONFIGS = [
    (128, 64, 128, 128, 128, 8, 3),
    (128, 64, 128, 128, 128, 8, 4),
    (128, 128, 128, 128, 128, 8, 3),
    (128, 64, 128, 256, 128, 8, 3),
    (128, 64, 64, 128, 64, 8, 4),
    (128, 64, 128, 128, 128, 4, 3),
    (64, 64, 128, 128, 128, 8, 4),
    (64, 128, 128, 256, 128, 8, 3),
    (64, 64, 128, 128, 128, 4, 5),
]


# GroupedFP8Config fields: (block_m, gu_warps, gu_stages, down_block_n, down_warps, down_stages,
# group_m, flatten); the first is fp8_grouped_config's prefill default. ptxas for sm_90a at
# each: kernels/triton/moe_fp8_grouped.py, fp8_grouped_config. Most plausible first (the sweep
# is time-boxed).
FP8_GROUPED_CONFIGS = [
    (128, 8, 3, 128, 8, 4, 8, False),
    (64, 8, 4, 128, 8, 4, 8, False),
    (128, 16, 3, 128, 8, 4, 8, False),
    (128, 8, 4, 128, 8, 4, 8, False),
    (128, 8, 3, 128, 8, 4, 4, False),
    (128, 8, 3, 128, 8, 4, 16, False),
    (128, 8, 3, 64, 4, 4, 8, False),
    (128, 8, 3, 128, 8, 4, 8, True),
]
FP8_GROUPED_SWEEP_SECONDS = 30.0


def _ms(fn, rep: int = 200) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def _routing(tokens: int, gen: torch.Generator):
    scores = torch.rand(tokens, EXPERTS, device="cuda", generator=gen)
    weights, ids = scores.topk(TOP_K, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids.clamp(max=LOCAL)


def _experts_bf16(gen):
    w13 = torch.randn(LOCAL, 2 * INTER, HIDDEN, device="cuda", generator=gen) * HIDDEN**-0.5
    w2 = torch.randn(LOCAL, HIDDEN, INTER, device="cuda", generator=gen) * INTER**-0.5
    return w13.bfloat16(), w2.bfloat16()


def _experts_fp8(w13: torch.Tensor, w2: torch.Tensor):
    """Block-FP8 twins of the bf16 experts (gate and up quantized apart, as the checkpoint)."""
    from kernels import fp8

    nb, hb = fp8.blocks(INTER), fp8.blocks(HIDDEN)
    w13_8 = torch.empty(w13.shape, device="cuda", dtype=fp8.FP8)
    w2_8 = torch.empty(w2.shape, device="cuda", dtype=fp8.FP8)
    s13 = torch.empty(LOCAL, 2 * nb, hb, device="cuda")
    s2 = torch.empty(LOCAL, hb, nb, device="cuda")
    for e in range(LOCAL):
        for half in (0, 1):
            rows, blocks = (
                slice(half * INTER, (half + 1) * INTER),
                slice(half * nb, (half + 1) * nb),
            )
            w13_8[e, rows], s13[e, blocks] = fp8.quantize_weight(w13[e, rows].float())
        w2_8[e], s2[e] = fp8.quantize_weight(w2[e].float())
    return w13_8, w2_8, s13, s2


def _row(path, tokens, local_pairs, ms, weight_bytes, **extra) -> dict:
    flops = local_pairs * 6 * HIDDEN * INTER
    floor = weight_bytes / COPY_BW * 1e3
    row = {
        "path": path,
        "tokens": tokens,
        "local_pairs": local_pairs,
        "ms": round(ms, 4),
        "tflops": round(flops / ms / 1e9, 1),
        "floor_ms": round(floor, 4),
        "%floor": round(100 * floor / ms, 1),
    }
    row.update(extra)
    print(_fmt(row), flush=True)
    return row


def bench_paths(w13, w2, fp8_weights, tokens: int, gen) -> list[dict]:
    from kernels.triton import moe as tmoe
    from kernels.triton import moe_grouped as grouped

    x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).bfloat16()
    weights, ids = _routing(tokens, gen)
    local_pairs = int((ids < LOCAL).sum())
    bf16_bytes = LOCAL * 3 * HIDDEN * INTER * 2
    rows = []
    args = (x, w13, w2, weights, ids, LIMIT)
    rows.append(
        _row("triton bf16", tokens, local_pairs, _ms(lambda: tmoe.experts(*args)), bf16_bytes)
    )
    total = _ms(lambda: grouped.experts_grouped(*args))
    rows.append(_row("grouped bf16", tokens, local_pairs, total, bf16_bytes))

    step_ms, offs = _grouped_steps(x, w13, w2, weights, ids)
    for name, ms in step_ms.items():
        print(f"|   grouped: {name} | {tokens} | | {ms:.4f} | | | |", flush=True)
    gemm_ms = step_ms["gate_up"] + step_ms["down"]
    rows[-1].update({f"{k}_ms": round(v, 4) for k, v in step_ms.items()})
    rows[-1]["sum_of_steps_ms"] = round(sum(step_ms.values()), 4)
    rows[-1]["gemms_only_tflops"] = round(local_pairs * 6 * HIDDEN * INTER / gemm_ms / 1e9, 1)
    print(
        f"|   grouped: sum of steps {sum(step_ms.values()):.4f} ms, GEMMs alone "
        f"{rows[-1]['gemms_only_tflops']} TFLOP/s | | | | | | |",
        flush=True,
    )

    w13_8, w2_8, s13, s2 = fp8_weights
    fp8_bytes = bf16_bytes // 2 + (s13.numel() + s2.numel()) * 4
    fp8_args = (x, w13_8, w2_8, s13, s2, weights, ids, LIMIT)
    ms = _ms(lambda: tmoe.experts_fp8(*fp8_args))
    rows.append(_row("triton fp8", tokens, local_pairs, ms, fp8_bytes))
    rows += _fp8_grouped(x, fp8_weights, weights, ids, tokens, local_pairs, fp8_bytes)
    rows += _fp8_rowwise_gemms(w13_8, w2_8, offs, tokens, local_pairs, fp8_bytes)
    return rows


def _grouped_steps(x, w13, w2, weights, ids):
    """Each step of experts_grouped alone, on the previous steps' outputs: (ms by step, offs)."""
    from kernels.triton import moe_grouped as grouped

    token_of_row, row_of_pair, offs = grouped.sort_pairs(ids, LOCAL)
    xs = grouped.gather_rows(x, token_of_row, offs)
    w13t, w2t = w13.transpose(1, 2), w2.transpose(1, 2)
    gate_up = torch._grouped_mm(xs, w13t, offs=offs)
    h = grouped.swiglu_rows(gate_up, offs, LIMIT)
    y = torch._grouped_mm(h, w2t, offs=offs)
    steps = {
        "sort": lambda: grouped.sort_pairs(ids, LOCAL),
        "gather": lambda: grouped.gather_rows(x, token_of_row, offs),
        "gate_up": lambda: torch._grouped_mm(xs, w13t, offs=offs),
        "act": lambda: grouped.swiglu_rows(gate_up, offs, LIMIT),
        "down": lambda: torch._grouped_mm(h, w2t, offs=offs),
        "combine": lambda: grouped.combine(y, row_of_pair, weights, offs, x.dtype),
    }
    return {name: _ms(fn, rep=100) for name, fn in steps.items()}, offs


def _fp8_grouped(x, fp8_weights, weights, ids, tokens, local_pairs, fp8_bytes) -> list[dict]:
    """experts_fp8_grouped whole, then each step alone on the previous steps' outputs."""
    from kernels.triton import moe_fp8_grouped as g
    from kernels.triton.moe_grouped import combine

    w13_8, w2_8, s13, s2 = fp8_weights
    ms = _ms(lambda: g.experts_fp8_grouped(x, w13_8, w2_8, s13, s2, weights, ids, LIMIT))
    row = _row("fp8 grouped", tokens, local_pairs, ms, fp8_bytes)
    cfg = g.fp8_grouped_config(ids.numel(), LOCAL)
    token_of_row, weight_of_row, row_of_pair, expert_of_tile, total = g.pad_sort(
        ids, weights, LOCAL, cfg.block_m
    )
    xq, xs = g.gather_quant(x, token_of_row, total)
    hq, hs = g.gate_up(xq, xs, w13_8, s13, expert_of_tile, total, LIMIT, x.dtype, cfg)
    y = g.down(hq, hs, w2_8, s2, weight_of_row, expert_of_tile, total, x.dtype, cfg)
    steps = {
        "layout": lambda: g.pad_sort(ids, weights, LOCAL, cfg.block_m),
        "gather_quant": lambda: g.gather_quant(x, token_of_row, total),
        "gate_up": lambda: g.gate_up(
            xq, xs, w13_8, s13, expert_of_tile, total, LIMIT, x.dtype, cfg
        ),
        "down": lambda: g.down(
            hq, hs, w2_8, s2, weight_of_row, expert_of_tile, total, x.dtype, cfg
        ),
        "combine": lambda: combine(y, row_of_pair, None, total, x.dtype, top_k=TOP_K),
    }
    step_ms = {name: _ms(fn, rep=100) for name, fn in steps.items()}
    padded = int(total.item())  # outside the timed calls: a sync is harmless here
    for name, t in step_ms.items():
        print(f"|   fp8 grouped: {name} | {tokens} | | {t:.4f} | | | |", flush=True)
    gate_up_tf = padded * 4 * HIDDEN * INTER / step_ms["gate_up"] / 1e9
    down_tf = padded * 2 * HIDDEN * INTER / step_ms["down"] / 1e9
    row.update({f"{k}_ms": round(v, 4) for k, v in step_ms.items()})
    row.update(
        padded_rows=padded,
        sum_of_steps_ms=round(sum(step_ms.values()), 4),
        gate_up_padded_tflops=round(gate_up_tf, 1),
        down_padded_tflops=round(down_tf, 1),
        config=list(dataclasses.astuple(cfg)),
    )
    print(
        f"|   fp8 grouped: sum of steps {sum(step_ms.values()):.4f} ms; {padded} padded rows; "
        f"gate_up {gate_up_tf:.0f}, down {down_tf:.0f} TFLOP/s on them | | | | | | |",
        flush=True,
    )
    return [row]


def sweep_fp8_grouped(fp8_weights, gen) -> list[dict]:
    """experts_fp8_grouped at each FP8_GROUPED_CONFIGS entry, 8,192 tokens, best first."""
    from kernels.triton import moe_fp8_grouped as g

    x = torch.randn(SWEEP_TOKENS, HIDDEN, device="cuda", generator=gen).bfloat16()
    weights, ids = _routing(SWEEP_TOKENS, gen)
    local_pairs = int((ids < LOCAL).sum())
    w13_8, w2_8, s13, s2 = fp8_weights
    fp8_bytes = LOCAL * 3 * HIDDEN * INTER + (s13.numel() + s2.numel()) * 4
    start = time.monotonic()
    rows = []
    for i, fields in enumerate(FP8_GROUPED_CONFIGS):
        if time.monotonic() - start > FP8_GROUPED_SWEEP_SECONDS:
            left = len(FP8_GROUPED_CONFIGS) - i
            print(f"| fp8 grouped sweep cut at {FP8_GROUPED_SWEEP_SECONDS:.0f} s: {left} not run |")
            break
        cfg = g.GroupedFP8Config(*fields)
        try:
            ms = _ms(
                lambda cfg=cfg: g.experts_fp8_grouped(
                    x, w13_8, w2_8, s13, s2, weights, ids, LIMIT, config=cfg
                ),
                rep=60,
            )
        except Exception as e:  # noqa: BLE001 - out of shared memory, compile errors
            print(f"| sweep fp8 grouped {fields}: {type(e).__name__}: {str(e)[:160]} |")
            continue
        rows.append(
            _row("sweep fp8 grouped", SWEEP_TOKENS, local_pairs, ms, fp8_bytes, config=fields)
        )
    rows.sort(key=lambda r: r["ms"])
    print("\n## fp8 grouped sweep, best first (config: GroupedFP8Config fields)")
    for r in rows:
        print(_fmt(r) + f" {list(r['config'])}")
    return rows


def _fp8_rowwise_gemms(w13_8, w2_8, offs, tokens, local_pairs, fp8_bytes) -> list[dict]:
    """torch._scaled_grouped_mm's two GEMMs with row-wise scales on random e4m3 inputs (the
    rows past offs[-1] are not read), without and with use_fast_accum (fp32 accumulation
    promoted less often). Errors are printed, not raised: it is an upper bound."""
    n = tokens * TOP_K
    rows = []
    for fast in (False, True):
        try:
            ms = _rowwise_ms(w13_8, w2_8, offs, n, fast)
        except Exception as e:  # noqa: BLE001 - report what torch refused, keep benchmarking
            print(f"|   fp8 rowwise grouped: {type(e).__name__}: {str(e)[:200]} |", flush=True)
            return rows
        path = "fp8 rowwise grouped GEMMs only" + (", fast_accum" if fast else "")
        rows.append(_row(path, tokens, local_pairs, ms, fp8_bytes))
    return rows


def _rowwise_ms(w13_8, w2_8, offs, n: int, fast: bool) -> float:
    """ms of both GEMMs on random e4m3 rows with random row-wise scales."""
    a = torch.randn(n, HIDDEN, device="cuda").to(torch.float8_e4m3fn)
    h = torch.randn(n, INTER, device="cuda").to(torch.float8_e4m3fn)
    sa, sh = torch.rand(n, device="cuda") + 0.5, torch.rand(n, device="cuda") + 0.5
    s13 = torch.rand(LOCAL, 2 * INTER, device="cuda") + 0.5
    s2 = torch.rand(LOCAL, HIDDEN, device="cuda") + 0.5
    w13t, w2t = w13_8.transpose(1, 2), w2_8.transpose(1, 2)

    def gemms():
        kw = dict(offs=offs, out_dtype=torch.bfloat16, use_fast_accum=fast)
        torch._scaled_grouped_mm(a, w13t, sa, s13, **kw)
        torch._scaled_grouped_mm(h, w2t, sh, s2, **kw)

    return _ms(gemms)


@contextlib.contextmanager
def _moe_config(cfg):
    """The fused MoE with one MoEConfig whatever the batch (its heuristic replaced)."""
    from kernels.triton import moe as tmoe

    with mock.patch.object(tmoe, "moe_config", lambda *_: tmoe.MoEConfig(*cfg)):
        yield


def sweep_configs(w13, w2, fp8_weights, gen) -> list[dict]:
    from kernels.triton import moe as tmoe

    x = torch.randn(SWEEP_TOKENS, HIDDEN, device="cuda", generator=gen).bfloat16()
    weights, ids = _routing(SWEEP_TOKENS, gen)
    local_pairs = int((ids < LOCAL).sum())
    w13_8, w2_8, s13, s2 = fp8_weights
    bf16_bytes = LOCAL * 3 * HIDDEN * INTER * 2
    fp8_bytes = bf16_bytes // 2 + (s13.numel() + s2.numel()) * 4
    bf16 = [("sweep bf16", cfg, bf16_bytes) for cfg in BF16_CONFIGS]
    fp8 = [("sweep fp8", cfg, fp8_bytes) for cfg in FP8_CONFIGS]
    # alternated, so that a cut leaves both dtypes their most plausible configs
    cases = [c for pair in itertools.zip_longest(bf16, fp8) for c in pair if c is not None]
    start = time.monotonic()
    rows = []
    for i, (path, cfg, nbytes) in enumerate(cases):
        if time.monotonic() - start > SWEEP_SECONDS:
            print(f"| sweep cut at {SWEEP_SECONDS:.0f} s: {len(cases) - i} configs not run |")
            break
        if path == "sweep bf16":
            fn = lambda: tmoe.experts(x, w13, w2, weights, ids, LIMIT)  # noqa: E731
        else:
            fn = lambda: tmoe.experts_fp8(x, w13_8, w2_8, s13, s2, weights, ids, LIMIT)  # noqa: E731
        try:
            with _moe_config(cfg):
                ms = _ms(fn, rep=60)
        except Exception as e:  # noqa: BLE001 - out of shared memory, compile errors
            print(f"| {path} {cfg}: {type(e).__name__}: {str(e)[:160]} |", flush=True)
            continue
        rows.append(_row(path, SWEEP_TOKENS, local_pairs, ms, nbytes, config=list(cfg)))
    rows.sort(key=lambda r: (r["path"], r["ms"]))
    print("\n## sweep, best first (config: block_m, gu_n, gu_k, down_n, down_k, warps, stages)")
    for r in rows:
        print(_fmt(r) + f" {r['config']}")
    return rows


COLUMNS = ["path", "tokens", "local_pairs", "ms", "tflops", "floor_ms", "%floor"]


def _fmt(row: dict) -> str:
    return "| " + " | ".join("" if row.get(c) is None else str(row[c]) for c in COLUMNS) + " |"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument(
        "--configs", action="store_true", help="sweep the fused and fp8 grouped MoEs' tiles at 8k"
    )
    args = ap.parse_args(argv)
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}; rank 0 of EP8: {LOCAL} of {EXPERTS} experts, "
        f"top-{TOP_K}, Hd {HIDDEN}, I {INTER}"
    )
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows: list[dict] = []
    with torch.inference_mode():
        w13, w2 = _experts_bf16(gen)
        fp8_weights = _experts_fp8(w13, w2)
        for tokens in TOKENS:
            rows += bench_paths(w13, w2, fp8_weights, tokens, gen)
            torch.cuda.empty_cache()
        if args.configs:
            rows += sweep_configs(w13, w2, fp8_weights, gen)
            rows += sweep_fp8_grouped(fp8_weights, gen)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

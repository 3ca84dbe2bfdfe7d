"""Decode microbenchmarks of issue 43's points 4 and 5 at rank 0 of TP8 on one GPU:

    python -m bench.decode_mhc_kda [--batches 1,8,32] [--only mhc|kda] [--pre-sweep]

- mhc_boundary (bf16; the mixing is float32 whatever the weights): the old boundary, mhc_post
  then mhc_pre (three launches), against mhc_boundary (one launch up to BOUNDARY_MAX_TOKENS;
  past it, mhc_post then mhc_pre), hc 4 x Hd 4096, fn [24, 16384]; us_new_sinkhorn_1: the same
  with 1 Sinkhorn iteration (of 20). Past BOUNDARY_MAX_TOKENS (prefill sizes: --batches
  1024,8192) also each kernel's device time in one eager call ("mhc_kernels_eager"; with PDL a
  kernel's time includes its wait for the one before).
- --pre-sweep (prefill sizes, e.g. --batches 8192): mhc_pre alone (the collapse: its partial
  and finish kernels) under each PRE_SINKHORN_TOKENS, then each PRE_PARTIAL (with
  PRE_PARTIAL_PRESPLIT), then each PRE_FINISH of kernels/triton/mhc.py
  (the others at their defaults), "mhc_pre_config" rows: us (graph), the two kernels' eager us, and
  the largest difference from the default's outputs (max_diff; the default's row 0).
- kda_layer (bf16, and fp8: every projection of the layer held in block FP8, as
  --fp8-linears all holds them): the old decode step (in_proj: one GEMM in bf16, six W8A8
  GEMMs in FP8; f_b_proj, g_b_proj, the fused core as it was before f_b/g_b moved in, o_proj)
  against KDAttention.forward (in_proj: one GEMM, FP8 too; the fused core with f_b/g_b inside,
  its heads' state columns split over programs, o_proj), 8 local heads x 128, without o_proj's
  all-reduce; us_new_one_program_per_head: the same with kernels.triton.kda.DV_SPLITS_MAX 1.

Each path is captured in one CUDA graph that calls it once per copy of its weights and inputs,
the copies adding up to twice the L2 cache (each call reads its weights from HBM, as successive
layers do); us_* is the median over REPLAYS replays, per call. floor_us: the bytes a call must
move through HBM (weights, the streams or the KDA states read and written) at HBM_BW.
launches_new: kernels one call of the new path launches (a profiled eager call). One JSON line
per row: {"name", "batch", "dtype", "us_old", "us_new", "floor_us", "launches_new", ...}.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import triton
import triton.language as tl

HBM_BW = 4.23e12  # bytes/s: the H200's measured copy bandwidth (docs/BENCHMARKS.md)
REPLAYS = 30
HC, HD = 4, 4096  # mHC streams, hidden size
HEADS, DIM = 8, 128  # KDA heads of rank 0 of TP8, head size


def graph_us(fn, copies: list) -> float:
    """Median device microseconds per fn(copy), every copy's call captured in one graph."""
    from kernels.triton.fp8 import graph_time_us

    with torch.no_grad():
        return graph_time_us(fn, copies, REPLAYS)


def kernel_times(fn, copy) -> list[tuple[str, float]]:
    """(name, device us) of each kernel one eager fn(copy) launches, in launch order."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.no_grad():
        fn(copy)
        torch.cuda.synchronize()
    kinds = ("memcpy", "memset")
    return [
        (e.name, e.device_time)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
        and not any(k in e.name.lower() for k in kinds)
    ]


def launches(fn, copy) -> int:
    """Kernels one eager fn(copy) launches."""
    return len(kernel_times(fn, copy))


def n_copies(nbytes: int) -> int:
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(2, math.ceil(2 * l2 / nbytes))


def row(name, batch, dtype, us_old, us_new, floor_bytes, launches_new, **more_us) -> None:
    print(
        json.dumps(
            dict(
                name=name,
                batch=batch,
                dtype=dtype,
                us_old=round(us_old, 2),
                us_new=round(us_new, 2),
                floor_us=round(floor_bytes / HBM_BW * 1e6, 2),
                launches_new=launches_new,
                **{k: round(v, 2) for k, v in more_us.items()},
            )
        ),
        flush=True,
    )


# ---------------------------------------------------------------------------------------------
# mHC: one boundary (the expansion of a sublayer's output, the next collapse + RMSNorm)
# ---------------------------------------------------------------------------------------------


MIX = (2 + HC) * HC
MIXING = (20, 1e-6, 1e-5)  # Sinkhorn iterations, the mixing's eps, the RMS factor's eps


def mhc_inputs(batch: int, gen: torch.Generator) -> dict:
    """One boundary's random inputs on the GPU: the sublayer output, the streams, the previous
    collapse's post and comb, the next collapse's fn/base/scale, its RMSNorm weight (bf16) and
    the fused boundary's counters."""
    from kernels.triton.mhc import BOUNDARY_MAX_TOKENS

    dev, dt = "cuda", torch.bfloat16

    def rand(*shape, scale=1.0, dtype=torch.float32):
        return (torch.randn(*shape, device=dev, generator=gen) * scale).to(dtype)

    return dict(
        out=rand(batch, HD, dtype=dt),
        streams=rand(batch, HC, HD, scale=3.0, dtype=dt),
        post=torch.rand(batch, HC, device=dev, generator=gen) * 2,
        comb=torch.rand(batch, HC, HC, device=dev, generator=gen) * 0.5,
        fn=rand(MIX, HC * HD, scale=(HC * HD) ** -0.5),
        base=rand(MIX, scale=0.5),
        scale=torch.rand(3, device=dev, generator=gen) + 0.5,
        weight=(torch.rand(HD, device=dev, generator=gen) + 0.5).to(dt),
        counter=torch.zeros(BOUNDARY_MAX_TOKENS, dtype=torch.int32, device=dev),
    )


def bench_mhc(batch: int) -> None:
    from kernels.triton.mhc import BOUNDARY_MAX_TOKENS, mhc_boundary, mhc_post, mhc_pre

    gen = torch.Generator(device="cuda").manual_seed(batch)

    fn_bytes = MIX * HC * HD * 4
    act_bytes = batch * HD * 2 * (2 * HC + 2)  # streams in and out, the output, the next input
    copies = [mhc_inputs(batch, gen) for _ in range(n_copies(fn_bytes + act_bytes))]

    def old(c):
        new = mhc_post(c["out"], c["streams"], c["post"], c["comb"])
        return mhc_pre(new, c["fn"], c["base"], c["scale"], *MIXING, c["weight"], 1e-5)

    def new(c, iters=MIXING[0]):
        args = (c["out"], c["streams"], c["post"], c["comb"], c["fn"], c["base"], c["scale"])
        return mhc_boundary(*args, iters, *MIXING[1:], c["weight"], 1e-5, c["counter"])

    us_old, us_new = graph_us(old, copies), graph_us(new, copies)
    # a diagnostic: one Sinkhorn iteration in place of 20 prices the serial mixing the finishing
    # program does per token
    more = {"us_new_sinkhorn_1": graph_us(lambda c: new(c, 1), copies)}
    floor = fn_bytes + act_bytes
    row("mhc_boundary", batch, "bf16", us_old, us_new, floor, launches(new, copies[0]), **more)
    if batch > BOUNDARY_MAX_TOKENS:  # post, then the pre's two kernels: where the time goes
        us = [(k, round(t, 2)) for k, t in kernel_times(new, copies[0])]
        print(json.dumps(dict(name="mhc_kernels_eager", batch=batch, us=us)))


# (tokens, K step, warps, fn split once) per partial program; (tokens, channels, warps) per finish;
# the defaults before session 26 first: ((64, 64, 4), per tile), (1, 1024, 4)
PRE_PARTIALS = (
    ((64, 64, 4), False), ((64, 128, 4), False), ((64, 64, 8), False), ((128, 64, 8), False),
    ((32, 64, 4), False), ((128, 64, 8), True), ((64, 128, 4), True),
)  # fmt: skip
PRE_FINISHES = ((1, 1024, 4), (4, 4096, 8), (8, 4096, 8), (16, 4096, 8), (8, 1024, 4))
# tokens per Sinkhorn program of the finish (0: in every program), each forced (whatever the
# tokens and partial rows: PRE_SINKHORN_ONE_TOKEN_MAX 0, PRE_SINKHORN_MAX_ROWS lifted)
PRE_SINKHORNS = (0, 1, 16, 32, 64)


def sweep_pre(batch: int) -> None:
    from kernels.triton import mhc

    gen = torch.Generator(device="cuda").manual_seed(batch)
    act_bytes = batch * HD * 2 * (HC + 1)  # the streams read, the normed collapse written
    copies = [mhc_inputs(batch, gen) for _ in range(n_copies(MIX * HC * HD * 4 + act_bytes))]

    def pre(c):
        args = (c["fn"], c["base"], c["scale"], *MIXING, c["weight"], 1e-5)
        return mhc.mhc_pre(c["streams"], *args)

    sinkhorn0 = (mhc.PRE_SINKHORN_TOKENS, mhc.PRE_SINKHORN_MAX_ROWS, mhc.PRE_SINKHORN_ONE_TOKEN_MAX)
    default = ((mhc.PRE_PARTIAL, mhc.PRE_PARTIAL_PRESPLIT), mhc.PRE_FINISH, sinkhorn0)
    partial0, finish0, _ = default
    configs = [default] + [(partial0, finish0, (s, 1 << 30, 0)) for s in PRE_SINKHORNS]
    configs += [(p, finish0, sinkhorn0) for p in PRE_PARTIALS if p != partial0]
    configs += [(partial0, f, sinkhorn0) for f in PRE_FINISHES if f != finish0]
    ref = None
    try:
        for config in configs:
            partial, finish, sinkhorn = config
            (mhc.PRE_PARTIAL, mhc.PRE_PARTIAL_PRESPLIT), mhc.PRE_FINISH = partial, finish
            mhc.PRE_SINKHORN_TOKENS, mhc.PRE_SINKHORN_MAX_ROWS, mhc.PRE_SINKHORN_ONE_TOKEN_MAX = (
                sinkhorn
            )
            got = pre(copies[0])
            ref = got if ref is None else ref
            diff = max((g.float() - r.float()).abs().max().item() for g, r in zip(got, ref))
            us = graph_us(pre, copies)
            kernels = [round(t, 2) for _, t in kernel_times(pre, copies[0])]
            floor = act_bytes / HBM_BW * 1e6
            line = dict(name="mhc_pre_config", batch=batch, partial=partial, finish=finish)
            line.update(sinkhorn_tokens=sinkhorn[0], sinkhorn_max_rows=sinkhorn[1])
            line.update(sinkhorn_one_token_max=sinkhorn[2])
            line.update(us=round(us, 2), kernels_eager_us=kernels, max_diff=diff)
            print(json.dumps(dict(line, floor_us=round(floor, 2))), flush=True)
    finally:
        (mhc.PRE_PARTIAL, mhc.PRE_PARTIAL_PRESPLIT), mhc.PRE_FINISH, sinkhorn = default
        mhc.PRE_SINKHORN_TOKENS, mhc.PRE_SINKHORN_MAX_ROWS, mhc.PRE_SINKHORN_ONE_TOKEN_MAX = (
            sinkhorn
        )


# ---------------------------------------------------------------------------------------------
# KDA: one layer's decode step
# ---------------------------------------------------------------------------------------------


@triton.jit
def _conv_silu_step(x, w_ptr, slots, ch, mask, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The old core's conv step: one channel block's causal conv + SiLU for one new input x
    (float32 holding the input dtype's values) and the block's conv state `slots` [BLOCK_D,
    K-1] (oldest first), shifted by one in place. Returns the output in float32, unrounded."""
    j = tl.arange(0, BLOCK_K)
    jm = mask[:, None] & (j < K - 1)[None, :]
    ptrs = slots + j[None, :]
    old = tl.load(ptrs, mask=jm, other=0.0).to(tl.float32)
    w_old = tl.load(w_ptr + ch[:, None] * K + j[None, :], mask=jm, other=0.0)
    acc = tl.sum(old * w_old, 1) + x * tl.load(w_ptr + ch * K + (K - 1), mask=mask, other=0.0)
    later = tl.load(ptrs + 1, mask=jm & (j < K - 2)[None, :], other=0.0).to(tl.float32)
    new = tl.where((j == K - 2)[None, :], x[:, None], later)
    tl.debug_barrier()  # every old slot is read before any is overwritten
    tl.store(ptrs, new.to(slots.dtype.element_ty), mask=jm)
    return acc * tl.sigmoid(acc)


@triton.jit
def _old_core_kernel(
    q_ptr, k_ptr, v_ptr, stride_x, f_ptr, gate_ptr, stride_fg, b_ptr, stride_b, w_ptr,
    dt_bias_ptr, a_log_ptr, o_norm_ptr, conv_ptr, stride_cr, stride_cc, state_ptr, stride_sr,
    rows_ptr, out_ptr, scale, lower_bound, eps,
    H: tl.constexpr, D: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The fused decode core as it was before f_b_proj and g_b_proj moved in (commit c64aef6's
    kernels/triton/kda.py, one token per request, bounded gate): f and gate read as computed by
    their Linears. The benchmark's "old"."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(rows_ptr + i).to(tl.int64)
    d = tl.arange(0, D)
    ch = h * D + d
    dm = d < D
    conv = conv_ptr + row * stride_cr
    rate = tl.exp(tl.load(a_log_ptr + h))
    s_ptrs = state_ptr + row * stride_sr + h * D * D + d[:, None] * D + d[None, :]
    s = tl.load(s_ptrs)
    x = i.to(tl.int64) * stride_x + ch
    xq = tl.load(q_ptr + x)
    q = _conv_silu_step(xq.to(tl.float32), w_ptr, conv + ch[:, None] * stride_cc, ch, dm, K,
                        BLOCK_K).to(xq.dtype).to(tl.float32)  # fmt: skip
    k = _conv_silu_step(tl.load(k_ptr + x).to(tl.float32), w_ptr,
                        conv + (H * D + ch)[:, None] * stride_cc, H * D + ch, dm, K,
                        BLOCK_K).to(xq.dtype).to(tl.float32)  # fmt: skip
    v = _conv_silu_step(tl.load(v_ptr + x).to(tl.float32), w_ptr,
                        conv + (2 * H * D + ch)[:, None] * stride_cc, 2 * H * D + ch, dm, K,
                        BLOCK_K).to(xq.dtype).to(tl.float32)  # fmt: skip
    q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
    fg = i.to(tl.int64) * stride_fg + ch
    f = tl.load(f_ptr + fg).to(tl.float32) + tl.load(dt_bias_ptr + ch)
    g = lower_bound * tl.sigmoid(rate * f)
    b_raw = tl.load(b_ptr + i.to(tl.int64) * stride_b + h)
    beta = tl.sigmoid(b_raw.to(tl.float32)).to(b_raw.dtype).to(tl.float32)
    s = s * tl.exp(g)[:, None]
    delta = (v - tl.sum(s * k[:, None], 0)) * beta
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], 0).to(out_ptr.dtype.element_ty).to(tl.float32)
    o = o * tl.rsqrt(tl.sum(o * o, 0) / D + eps) * tl.load(o_norm_ptr + d)
    o = o * tl.sigmoid(tl.load(gate_ptr + fg).to(tl.float32))
    tl.store(out_ptr + i.to(tl.int64) * (H * D) + ch, o.to(out_ptr.dtype.element_ty))
    tl.store(s_ptrs, s)


def _old_core(q, k, v, f, b, gate, w, conv_state, state, rows):
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    _old_core_kernel[(rows.shape[0], HEADS)](
        q, k, v, q.stride(0), f, gate, f.stride(0), b, b.stride(0), w.conv, w.dt_bias, w.a_log,
        w.o_norm, conv_state, conv_state.stride(0), conv_state.stride(1), state, state.stride(0),
        rows, out, DIM**-0.5, w.lower_bound, w.eps, H=HEADS, D=DIM, K=w.conv.shape[1],
        BLOCK_K=triton.next_power_of_2(w.conv.shape[1] - 1), num_warps=8,
    )  # fmt: skip
    return out


def rank0_kda_layer(fp8: bool, gen: torch.Generator, device: str = "cuda"):
    """Rank 0 of TP8's KDA layer (real shapes) with random weights on the GPU; fp8: every
    projection held in block FP8."""
    from kernels.fp8 import quantize_weight
    from serving.config import ModelConfig
    from serving.distributed import ParallelState, set_state, state
    from serving.layers.linear import Linear
    from serving.models.kda import KDAttention
    from serving.tools.tiny_model import build_config

    raw = build_config("real", {"<|endoftext|>": 0, "<|user|>": 1, "<|observation|>": 2})
    config = ModelConfig.from_dict(raw)
    before = state()
    set_state(ParallelState(0, 8, 8))
    try:
        with torch.device("meta"):
            layer = KDAttention(config, torch.bfloat16)
        linears = [m for m in layer.modules() if isinstance(m, Linear)]
        if fp8:
            for m in linears:
                m.hold_fp8()
        layer.to_empty(device=device)
    finally:
        set_state(before)
    assert layer.heads == HEADS and layer.dim == DIM
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("weight_scale_inv"):
                continue
            std = {"A_log": 0.3, "dt_bias": 1.0, "o_norm": 0.05}.get(name, p.shape[-1] ** -0.5)
            value = torch.randn(p.shape, device=device, generator=gen) * std
            if name == "o_norm":
                value += 1
            if p.dtype == torch.float8_e4m3fn:
                owner = layer.get_submodule(name.rpartition(".")[0])
                w8, scale = quantize_weight(value)
                p.copy_(w8)
                owner.weight_scale_inv.copy_(scale)
            else:
                p.copy_(value)
    layer.o_proj.reduce = False  # the bench times one rank's work: no all-reduce
    layer.in_proj.stack()
    return layer


def bench_kda(batch: int, fp8: bool) -> None:
    from serving.forward_batch import ForwardBatch
    from serving.memory.cache import KDALayerCache

    gen = torch.Generator(device="cuda").manual_seed(batch)
    probe = rank0_kda_layer(fp8, gen)
    weight_bytes = sum(p.numel() * p.element_size() for p in probe.parameters())
    rows = 2 * batch
    state_bytes = batch * HEADS * DIM * DIM * 4 * 2  # read and written
    copies = []
    for i in range(n_copies(weight_bytes + state_bytes)):
        layer = probe if i == 0 else rank0_kda_layer(fp8, gen)
        conv = torch.randn(rows, 3 * HEADS * DIM, 3, device="cuda", generator=gen)
        state = torch.randn(rows, HEADS, DIM, DIM, device="cuda", generator=gen) * 0.1
        req_rows = list(range(1, batch + 1))
        req_to_token = torch.zeros(rows, 8, dtype=torch.int64, device="cuda")
        fb = ForwardBatch.build([0] * batch, req_rows, [3] * batch, [1] * batch, req_to_token)
        x = torch.randn(batch, 4096, device="cuda", generator=gen).to(torch.bfloat16)
        cache = KDALayerCache(conv.to(torch.bfloat16), state)
        copies.append((layer, x, fb, cache))

    def old(c):  # before: FP8 projections never stacked (one W8A8 GEMM each)
        layer, x, fb, cache = c
        if fp8:
            q, k, v, f_a, g_a, b = (getattr(layer, n)(x) for n in layer.in_proj.names)
        else:
            q, k, v, f_a, g_a, b = layer.in_proj(x)
        f, gate = layer.f_b_proj(f_a), layer.g_b_proj(g_a)
        w = layer.core_weights()
        core = _old_core(q, k, v, f, b, gate, w, cache.conv, cache.state, fb.req_rows)
        return layer.o_proj(core)

    def new(c):
        layer, x, fb, cache = c
        return layer(x, fb, cache)

    from bench.fast_path import switched

    us_old, us_new = graph_us(old, copies), graph_us(new, copies)
    with switched({"kernels.triton.kda.DV_SPLITS_MAX": 1}):  # one program per (request, head)
        us_one = graph_us(new, copies)
    dtype, floor = "fp8" if fp8 else "bf16", weight_bytes + state_bytes
    row("kda_layer", batch, dtype, us_old, us_new, floor, launches(new, copies[0]),
        us_new_one_program_per_head=us_one)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--only", choices=("mhc", "kda"))
    parser.add_argument("--pre-sweep", action="store_true", help="mhc_pre's blocks (docstring)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.decode_mhc_kda needs a CUDA device")
    batches = [int(b) for b in args.batches.split(",")]
    for batch in batches:
        if args.pre_sweep:
            sweep_pre(batch)
            continue
        if args.only in (None, "mhc"):
            bench_mhc(batch)
        if args.only in (None, "kda"):
            for fp8 in (False, True):
                bench_kda(batch, fp8)


if __name__ == "__main__":
    main()

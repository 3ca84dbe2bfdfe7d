"""Linears of a few token rows (decode, EAGLE verify): y[M, N] = x[M, K] W[N, K]^T, M <= 64.

At these sizes a linear is a read of its weight, and the weight read is what the kernel is shaped
for: narrow N tiles and split K, so a few hundred programs stream the weight at once (a program
streams only ~30-60 GB/s). Before it, 1536 x 4096 at 32 tokens took 16.2 us in block FP8
(torch._scaled_mm, tiled for large M: 10x the FP8 weight's HBM floor) and 8.9 us in bf16
(cuBLAS: 3x its floor). Two weight formats, one kernel:
- dense (bf16/fp16; x in the weight's dtype): tl.dot into fp32;
- block FP8 (e4m3 W with float32 scales per 128 x 128 block): the W8A8 of
  kernels.fp8.block_fp8_linear on x quantized by the caller (x_fp8: quantize_act's e4m3 and
  token-major scales, one launch before; quantizing x's tile in every program's K loop instead
  took 1.1-2x as long: kernels/triton/fp8.py's SKINNY_MAX_TOKENS): each K step is one 128-wide
  group, the e4m3 dot promoted into the fp32 accumulator as dot * x_scale[m] * w_scale[n // 128].
Twins: torch.nn.functional.linear and kernels.fp8.block_fp8_linear (same results up to fp32
summation order and, for bf16 outputs, one output rounding).

Up to GEMV_MAX_ROWS dense rows (batch-1 decode, EAGLE's draft; EAGLE's 2-token verify and small
batches where the switch allows) run the GEMV form (gemv_rows): no tl.dot and no 16-row padding;
each program holds a [BLOCK_N, BLOCK_K] tile of W, K contiguous (16-byte loads along each weight
row), and multiplies it by each of x's rows on the CUDA cores in float32. Its tiling
(gemv_config) is its own: 256-wide K steps, 16-row N tiles (the tl.dot form's tiles are sized
for a 16-row dot), rows in a power-of-two block (1, 2, 4, 8: CUDA graphs' batch buckets).

Split K, deterministically: program (n tile, split) sums its share of K, writes the fp32 partial
and counts itself in its tile's counter (an int32 atomic, acquire-release); the program that
counts last sums the tile's partials in split order (the same sum whichever program is last),
writes y and resets the counter, so the next launch (and a CUDA graph's next replay) starts from
zero. Counters: one int32 per N tile in a workspace per (device, weight shape, tiling), shared
by the calls of one shape. Hazard: calls of one shape on two streams at once would share
counters; pdserve runs its forwards on one stream, where launches run one after another.

skinny_config (host ints only) picks the tiling; nothing depends on device values, so the
kernel is capturable in CUDA graphs. M, N, K are run-time arguments: one compiled kernel per
tile configuration and dtype, not per shape.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.fp8 import BLOCK, FP8
from kernels.triton.pdl import LAUNCH, grid_dependency

# the most token rows the kernel takes (its tilings are sized for up to this many); which calls
# run it is kernels/triton/fp8.py's SKINNY_MAX_TOKENS (block FP8 only: cuBLAS beat it in bf16)
MAX_TOKENS = 64
# programs skinny_config aims at: two per SM of an H200 (132 SMs), each with its loads in flight
TARGET_PROGRAMS = 264
# split-K partials (fp32, each written once and read once) stay below the weight's own bytes
PARTIAL_BYTES_PER_WEIGHT_BYTE = 1
DENSE_DTYPES = (torch.bfloat16, torch.float16)
# the narrowest N tile: the e4m3 dot tiles kernels/triton/fp8.py's GEMM runs on the H200 (16-row
# tiles would double the programs only of weights under 2 MB, whose time is launch latency)
MIN_BLOCK_N = 32


# dense rows up to which skinny_linear runs the GEMV form (0: the tl.dot form at every count; at
# most GEMV_ROWS_LIMIT). 2 since 2026-12-06: rank 0 cut to 28 layers, H100, medians of three
# interleaved: EAGLE's step at batch 1 (its 2-token verify) 4.934 -> 4.786 ms, decode at batch 2
# 3.566 -> 3.414 (per shape at 2 rows the GEMV form wins on short K and loses on lm_head, MLA
# q_b, DSA o_proj and dense down: the step nets the difference)
GEMV_MAX_ROWS = 2
GEMV_ROWS_LIMIT = 8
# the GEMV form's tiling: BLOCK_N rows of W by BLOCK_K columns a step (16 x 256 bf16: 8 KB, one
# 16-byte load per thread and row for 4 warps), GEMV_PROGRAMS programs aimed at (three per SM of
# an H200); bench/decode_gemm.py --sweep times others
GEMV_BLOCK_N = 16
GEMV_BLOCK_K = 256
GEMV_PROGRAMS = 396
# weights of K <= GEMV_SHORT_K take GEMV_SHORT_BLOCK_N x GEMV_SHORT_BLOCK_K tiles instead: a
# short row in 1-4 steps, so each program's loads are in flight at once (H200, bench.decode_gemm
# --sweep, us at one row: KDA o_proj 4096 x 1024 3.81 against 5.00, DSA o_proj 6.09 against
# 7.31, dense down 4.88 against 6.08; at K 4096 the dense gate_up 12.26 against 9.57 and the
# lm_head 42.61 against 40.02 lose). The rank-0 step at batch 1: 4.675 / 4.589 ms against
# 4.686 / 4.691 (graphs captured twice each, one process)
GEMV_SHORT_K = 2048
GEMV_SHORT_BLOCK_N = 8
GEMV_SHORT_BLOCK_K = 512


class SkinnyConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    splits: int  # K splits per N tile
    steps: int  # BLOCK_K steps per split (the last split may have fewer)
    num_warps: int
    num_stages: int
    gemv: bool = False  # the GEMV form (block_m rows, a power of two)


def skinny_config(
    m: int,
    n: int,
    k: int,
    w_bytes: int,
    target_programs: int = TARGET_PROGRAMS,
    partial_bytes: int = PARTIAL_BYTES_PER_WEIGHT_BYTE,
) -> SkinnyConfig:
    """The tiling for M = m rows against an [n, k] weight of w_bytes per element (host ints).

    BLOCK_K is one 128-wide scale group (what the FP8 quantization needs) or, for k < 128, all
    of k; tl.dot takes M >= 16 rows (padded), e4m3 K >= 32. N tiles start at 64 rows and narrow
    (to MIN_BLOCK_N) until the programs, N tiles x K splits, can reach target_programs; K splits
    then fill up to it, as far as the partials' bytes allow (2 * splits * BLOCK_M * n * 4 <=
    partial_bytes times the weight's); bench/decode_gemm.py --sweep times other target_programs
    and partial_bytes. Everything follows from BLOCK_M, not m: every m of one BLOCK_M gets the
    same tiling, so a row's bits do not depend on how many rows share the call (an eager decode
    of 11 requests equals its CUDA graph padded to 16: tests/test_gpu.py)."""
    block_m = max(16, triton.next_power_of_2(m))
    block_k = max(32, min(BLOCK, triton.next_power_of_2(k)))
    steps = triton.cdiv(k, block_k)
    max_splits = max(1, min(steps, partial_bytes * k * w_bytes // (8 * block_m)))
    block_n = 64
    while block_n > MIN_BLOCK_N and triton.cdiv(n, block_n) * max_splits < target_programs:
        block_n //= 2
    splits = min(max_splits, triton.cdiv(target_programs, triton.cdiv(n, block_n)))
    per = max(1, steps // splits)  # the splits' steps rounded down: at least `splits` of them
    while triton.cdiv(steps, per) > max_splits:
        per += 1
    return SkinnyConfig(block_m, block_n, block_k, triton.cdiv(steps, per), per, 4, 3)


def gemv_config(
    n: int,
    k: int,
    target_programs: int = GEMV_PROGRAMS,
    block_n: int | None = None,
    block_k: int | None = None,
    rows: int = 1,
) -> SkinnyConfig:
    """The GEMV form's tiling for `rows` rows against an [n, k] dense weight (host ints): the
    rows in a block of next_power_of_2(rows), N tiles of block_n rows, K steps of block_k (all
    of k below it; both by default GEMV_BLOCK_N x GEMV_BLOCK_K, or the GEMV_SHORT_ tiles for
    k <= GEMV_SHORT_K), split K until the programs reach target_programs."""
    assert 1 <= rows <= GEMV_ROWS_LIMIT, rows
    short = k <= GEMV_SHORT_K
    block_n = block_n or (GEMV_SHORT_BLOCK_N if short else GEMV_BLOCK_N)
    block_k = block_k or (GEMV_SHORT_BLOCK_K if short else GEMV_BLOCK_K)
    block_k = max(32, min(block_k, triton.next_power_of_2(k)))
    steps = triton.cdiv(k, block_k)
    splits = max(1, min(steps, triton.cdiv(target_programs, triton.cdiv(n, block_n))))
    per = triton.cdiv(steps, splits)
    block_m = triton.next_power_of_2(rows)
    return SkinnyConfig(block_m, block_n, block_k, triton.cdiv(steps, per), per, 4, 4, True)


@triton.jit
def _first_tile(ptrs, kk, k_lo, k_hi, EVEN: tl.constexpr):
    """Step k_lo's tile, in flight before gemv_rows' loop (unmasked where EVEN)."""
    if EVEN:
        first = tl.load(ptrs + k_lo)
    else:
        first = tl.load(ptrs + k_lo, mask=(k_lo + kk < k_hi)[None, :], other=0.0)
    return first


@triton.jit
def gemv_rows(
    a_ptr,  # [M, K] token rows, row stride stride_a, unit column stride
    stride_a,
    M,
    w_ptr,  # [N_ROWS, K] dense
    w2_ptr,  # PAIR: a second weight of w's shape (a MoE expert's up beside its gate)
    n0,
    kk,
    k_lo,
    k_hi,
    N_ROWS,
    K,
    EVEN: tl.constexpr,  # every step whole: no K masks
    WAIT_AFTER_FIRST: tl.constexpr,  # the PDL wait after the first weight tile's load
    PAIR: tl.constexpr,
    BLOCK_R: tl.constexpr,  # token rows computed (rows past M read row M - 1, never stored)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The GEMV form (a few token rows, no tl.dot): sum over k_lo <= k < k_hi of a[r, k] *
    w[n, k] for rows n0 .. n0 + BLOCK_N (those past N_ROWS read row N_ROWS - 1 and are never
    stored), float32 [BLOCK_R, BLOCK_N], and with PAIR the same of w2 (else the second result
    is the first). [BLOCK_N, BLOCK_K] weight tiles along K (16-byte loads along each row), each
    loaded one step ahead of its use (loop-carried) and multiplied by every token row on the
    CUDA cores: the weight is read once for all rows; with PAIR both weights' tiles are in flight
    at once (a program's time at these sizes is its chain of dependent loads, not its bytes).
    One row sums the products elementwise and reduces over K once at the end; more rows reduce
    each row's products every step (BLOCK_R accumulators of a whole tile would not fit the
    registers), so a row's bits depend on BLOCK_R: callers pick BLOCK_R from a row count's
    power-of-two bucket, as CUDA graphs pad batches (1, 2, 4, 8), never from the rows alone.
    WAIT_AFTER_FIRST: the first tiles are loaded before the PDL wait (the weight is no kernel's
    output: kernels/triton/pdl.py), so their bytes arrive while the previous kernel's last
    programs run (H200: 5.19 ms a rank-0 step at batch 1 against 5.30 loading it after the
    wait); the caller must not have waited. k_lo < k_hi: the first tile is loaded before the
    loop (unmasked where EVEN)."""
    n = n0 + tl.arange(0, BLOCK_N)
    offs = tl.minimum(n, N_ROWS - 1)[:, None] * K + kk[None, :]
    w_next = _first_tile(w_ptr + offs, kk, k_lo, k_hi, EVEN)
    if PAIR:
        w2_next = _first_tile(w2_ptr + offs, kk, k_lo, k_hi, EVEN)
    if WAIT_AFTER_FIRST:
        grid_dependency()
    r_idx = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    if BLOCK_R == 1:
        prods = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        prods2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k1 = k0 + BLOCK_K  # the step whose tiles this one loads
        next_mask = (k1 + kk < k_hi)[None, :]
        w = w_next.to(tl.float32)
        w_next = tl.load(w_ptr + offs + k1, mask=next_mask, other=0.0)
        if PAIR:
            w2 = w2_next.to(tl.float32)
            w2_next = tl.load(w2_ptr + offs + k1, mask=next_mask, other=0.0)
        if BLOCK_R == 1:
            if EVEN:
                a = tl.load(a_ptr + k0 + kk).to(tl.float32)
            else:
                a = tl.load(a_ptr + k0 + kk, mask=k0 + kk < k_hi, other=0.0).to(tl.float32)
            prods += w * a[None, :]
            if PAIR:
                prods2 += w2 * a[None, :]
        else:
            for r in tl.static_range(BLOCK_R):
                a_row = a_ptr + tl.minimum(r, M - 1) * stride_a + k0 + kk
                if EVEN:
                    a = tl.load(a_row).to(tl.float32)
                else:
                    a = tl.load(a_row, mask=k0 + kk < k_hi, other=0.0).to(tl.float32)
                here = r_idx[:, None] == r
                acc += tl.where(here, tl.sum(w * a[None, :], axis=1)[None, :], 0.0)
                if PAIR:
                    acc2 += tl.where(here, tl.sum(w2 * a[None, :], axis=1)[None, :], 0.0)
    if BLOCK_R == 1:
        acc += tl.sum(prods, axis=1)[None, :]
        if PAIR:
            acc2 += tl.sum(prods2, axis=1)[None, :]
    if not PAIR:
        acc2 = acc
    return acc, acc2


# M, N, strides and split counts vary by call; specializing on them (== 1, divisible by 16)
# would compile a kernel per shape and token count for nothing: the loads run along K
@triton.jit(do_not_specialize=["M", "N", "KB", "stride_xm", "splits", "steps"])
def _skinny_kernel(
    x_ptr,  # [M, K], row stride stride_xm, unit column stride; FP8_W: e4m3, x quantized
    xs_ptr,  # FP8_W: [M, KB] float32, x's scales (token-major, contiguous); else unused
    w_ptr,  # [N, K]: dense, or e4m3 (FP8)
    ws_ptr,  # [ceil(N/128), KB] float32 block scales (FP8; else unused)
    y_ptr,  # [M, N] in x's dtype
    add_ptr,  # [M, N] contiguous, added to the product (HAS_ADD; else unused)
    part_ptr,  # [splits, M, N] float32 partials (SPLIT_K)
    count_ptr,  # [ceil(N/BLOCK_N)] int32, zero between launches (SPLIT_K)
    M,
    N,
    K,
    KB,
    stride_xm,
    splits,
    steps,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # FP8: GROUP, or all of K below it
    FP8_W: tl.constexpr,
    GEMV: tl.constexpr,  # a few dense rows, no tl.dot (the module doc)
    HAS_ADD: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_n = pid // splits
    pid_k = pid % splits
    m = tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    # rows past M and past N read row M-1 / N-1 (never stored): the loads need no row masks
    m_safe = tl.minimum(m, M - 1)
    n_safe = tl.minimum(n, N - 1)
    k_begin = pid_k * steps * BLOCK_K
    k_end = tl.minimum(K, k_begin + steps * BLOCK_K)
    if not GEMV:
        grid_dependency()  # before any load of a kernel's output: kernels/triton/pdl.py
    if GEMV:  # BLOCK_M rows, those past M reading row M - 1
        acc, _ = gemv_rows(x_ptr, stride_xm, M, w_ptr, w_ptr, pid_n * BLOCK_N, kk, k_begin, k_end,
                           N, K, EVEN_K, True, False, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
    else:
        x_ptrs = x_ptr + m_safe[:, None] * stride_xm + kk[None, :]
        w_ptrs = w_ptr + n_safe[None, :] * K + kk[:, None]
        ws_ptrs = ws_ptr + (n_safe // GROUP) * KB
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            if EVEN_K:
                x = tl.load(x_ptrs + k0)
                w = tl.load(w_ptrs + k0)
            else:
                k_mask = (k0 + kk) < K
                x = tl.load(x_ptrs + k0, mask=k_mask[None, :], other=0.0)
                w = tl.load(w_ptrs + k0, mask=k_mask[:, None], other=0.0)
            if FP8_W:
                x_scale = tl.load(xs_ptr + m_safe * KB + k0 // GROUP)
                w_scale = tl.load(ws_ptrs + k0 // GROUP)
                acc += tl.dot(x, w) * x_scale[:, None] * w_scale[None, :]
            else:
                acc += tl.dot(x, w)
    y_ptrs = y_ptr + m[:, None] * N + n[None, :]
    y_mask = (m[:, None] < M) & (n[None, :] < N)
    if SPLIT_K:
        tile = m[:, None] * N + n[None, :]
        tl.store(part_ptr + pid_k * M * N + tile, acc, mask=y_mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        count = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if count == splits - 1:  # the tile's last program: every partial is written
            tl.debug_barrier()
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(0, splits):  # split order: deterministic
                # .cg: from L2, where the other programs' stores are, never a stale L1 line
                part = tl.load(part_ptr + s * M * N + tile, mask=y_mask, cache_modifier=".cg")
                total += part
            if HAS_ADD:  # addmm's C: added in float32, one rounding
                total += tl.load(add_ptr + tile, mask=y_mask, other=0.0).to(tl.float32)
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_mask)
            tl.atomic_xchg(count_ptr + pid_n, 0)  # the next launch starts from zero
    else:
        if HAS_ADD:
            acc += tl.load(add_ptr + m[:, None] * N + n[None, :], mask=y_mask, other=0.0).to(
                tl.float32
            )
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)


# (device, N, K, BLOCK_N) -> the N tiles' counters (see the module doc)
_COUNTERS: dict[tuple, torch.Tensor] = {}


def _counters(device: torch.device, n: int, k: int, block_n: int) -> torch.Tensor:
    key = (device, n, k, block_n)
    counters = _COUNTERS.get(key)
    if counters is None:
        counters = _COUNTERS[key] = torch.zeros(
            triton.cdiv(n, block_n), device=device, dtype=torch.int32
        )
    return counters


def skinny_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    add: torch.Tensor | None = None,
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """y = x W^T (+ add) for x [M, K] (M <= MAX_TOKENS; a row stride is fine, e.g. a column slice
    of a stacked projection's output), W [N, K]: dense in x's dtype (scale None), or e4m3 with
    block scales [ceil(N/128), ceil(K/128)] float32 (W8A8, as kernels.fp8.block_fp8_linear),
    then x_fp8 is x quantized, kernels.fp8.quantize_act(x) (e4m3 [M, K], token-major scales
    [M, ceil(K/128)]), which the kernel reads; x gives only the shape and the output's dtype.
    add: [M, N], summed with the product in float32 before the one rounding (torch.addmm's C).
    Returns [M, N] in x's dtype. config: gemv_config's for up to GEMV_MAX_ROWS dense rows, else
    skinny_config's (another: bench/decode_gemm.py's --sweep)."""
    (m, k), n = x.shape, w.shape[0]
    assert m <= MAX_TOKENS and w.shape[1] == k, (x.shape, w.shape)
    assert max(n, m) * k < 2**31, "skinny GEMM offsets exceed int32"
    fp8 = scale is not None
    if fp8:
        assert w.dtype == FP8 and scale.shape == (triton.cdiv(n, BLOCK), triton.cdiv(k, BLOCK))
        scale = scale.contiguous()
    else:
        assert w.dtype in DENSE_DTYPES and x.dtype == w.dtype, (x.dtype, w.dtype)
    assert (x_fp8 is not None) == fp8, "block FP8 takes x quantized (x_fp8), dense takes none"
    if fp8:
        x8, x_scale = x_fp8
        assert x8.dtype == FP8 and x8.shape == x.shape and x8.is_contiguous(), x8.shape
        assert x_scale.shape == (m, scale.shape[1]) and x_scale.stride() == (scale.shape[1], 1)
    elif x.stride(-1) != 1:
        x = x.contiguous()
    w = w.contiguous()
    if add is not None:
        assert add.shape == (m, n), (add.shape, m, n)
        add = add.contiguous()
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    if config is None:
        gemv = not fp8 and m <= GEMV_MAX_ROWS
        config = gemv_config(n, k, rows=m) if gemv else skinny_config(m, n, k, w.element_size())
    cfg = config
    gemv = cfg.gemv
    assert not gemv or (m <= cfg.block_m and not fp8), ("the GEMV form: dense, block_m rows", cfg)
    assert not fp8 or cfg.block_k == BLOCK or cfg.block_k >= k, cfg  # a K step is one group
    split_k = cfg.splits > 1
    if split_k:
        partials = torch.empty(cfg.splits, m, n, device=x.device, dtype=torch.float32)
        counters = _counters(x.device, n, k, cfg.block_n)
    else:
        partials = counters = y  # unused
    grid = (triton.cdiv(n, cfg.block_n) * cfg.splits,)
    _skinny_kernel[grid](
        x8 if fp8 else x,
        x_scale if fp8 else w,
        w,
        scale if fp8 else w,
        y,
        y if add is None else add,
        partials,
        counters,
        m,
        n,
        k,
        triton.cdiv(k, BLOCK),
        k if fp8 else x.stride(0),
        cfg.splits,
        cfg.steps,
        GROUP=BLOCK,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        FP8_W=fp8,
        GEMV=gemv,
        HAS_ADD=add is not None,
        SPLIT_K=split_k,
        EVEN_K=k % cfg.block_k == 0,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **LAUNCH,
    )
    return y

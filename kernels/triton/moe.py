"""Fused MoE experts in Triton: same signature and results as kernels.moe.experts.

Three steps, no host sync anywhere (capturable in CUDA graphs at every T):

1. align: the T*k (token, slot) pairs are sorted by expert, and each expert's segment is padded
   to BLOCK_M, into fixed-size buffers sized from the upper bound
   T*k + min(E, T*k) * (BLOCK_M - 1). Small batches use one Triton program (one launch, which
   matters inside decode graphs); large ones use sync-free torch ops (sort, scatter_add,
   searchsorted). Blocks past the padded total see expert id E and exit at once.
2. gate/up: one program per (block of BLOCK_M sorted rows of one expert, BLOCK_N intermediate
   columns) computes x @ w13[e] gate and up halves with fp32 accumulators, applies
   silu(min(gate, limit)) * clamp(up, -limit, limit) in the epilogue and stores the
   intermediate in x's dtype.
3. down: intermediate @ w2[e]^T, times the pair's routing weight in the epilogue, stored at the
   pair's aligned row (contiguous rows: storing straight to pair order scattered the wgmma
   accumulator and spilled registers at 128-row tiles); a last small kernel gathers each
   token's k rows through row_of_pair and sums them in fp32, in a fixed order. No atomics:
   deterministic.

FP8 (experts_fp8): weights float8_e4m3fn with 128 x 128 block scales; x is quantized per token
group of 128 before gate/up and the intermediate per row group before down (kernels/triton/
fp8.py), both GEMMs run e4m3 dots and add dot * a_scale * w_scale per K step of at most one
group. The intermediate is stored in x's dtype and quantized by a separate pass (a 128-column
group spans several gate/up programs).

Each kernel begins with grid_dependency() and is launched with PDL (kernels/triton/pdl.py): a
decode batch past the small path's (kernels/triton/moe_small.py) runs the router's two kernels
and these four back to back, so each one's launch overlaps the tail of the one before.

Only the selected experts' weight tiles are read. float32 inputs use IEEE fp32 dots
(input_precision="ieee"); bf16/fp16 use tensor cores. Tile sizes come from fixed heuristics on
(T*k / E, shapes), so nothing is autotuned at run time (safe under graph capture).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.fp8 import BLOCK as GROUP
from kernels.triton.fp8 import quantize_act
from kernels.triton.pdl import LAUNCH, grid_dependency

# Pairs (T * top_k) up to this go through the one-program align kernel; above, torch ops.
ALIGN_KERNEL_MAX_PAIRS = 2048
# About two programs per SM on the H200 (132 SMs): the decode tile heuristic aims at this.
TARGET_PROGRAMS = 264


@dataclass(frozen=True)
class MoEConfig:
    block_m: int
    gu_block_n: int  # gate/up: columns of I per program (each of gate and up)
    gu_block_k: int
    down_block_n: int  # down: columns of Hd per program
    down_block_k: int
    num_warps: int
    num_stages: int


def moe_config(num_pairs: int, num_experts: int, hidden: int, inter: int, dtype) -> MoEConfig:
    """Tile sizes for the H200 from the mean number of pairs per expert (host ints only);
    dtype is the weights' (float8_e4m3fn: the FP8 kernels, whose K steps must divide 128)."""
    per_expert = num_pairs / max(num_experts, 1)
    fp32 = dtype == torch.float32
    fp8 = dtype == torch.float8_e4m3fn
    if per_expert <= 16:  # decode / verify: weight-bandwidth bound, smallest M tile
        cfg = MoEConfig(16, 64, 128, 64, 128, 4, 4)
    elif per_expert <= 32:
        cfg = MoEConfig(32, 64, 128, 64, 128, 4, 4)
    elif per_expert <= 96:
        cfg = MoEConfig(64, 64, 64, 128, 64, 8, 4)
    else:  # prefill
        cfg = MoEConfig(128, 64, 32, 128, 64, 8, 4)
    # (ptxas for sm_90 on these kernels: gate/up with two 128x64 accumulators spills at
    # BLOCK_K 64 but not 32; 64-row tiles spill at 4 warps but not at 8.)
    if fp32:  # 4-byte tiles: fewer stages and a smaller K step keep shared memory in bounds
        cfg = MoEConfig(
            cfg.block_m,
            cfg.gu_block_n,
            min(cfg.gu_block_k, 64),
            cfg.down_block_n,
            min(cfg.down_block_k, 64),
            cfg.num_warps,
            2,
        )
    if fp8:  # 1-byte tiles: each K step is one scale group (128), fewer stages at 128 rows
        stages = 3 if cfg.block_m == 128 else cfg.num_stages
        cfg = MoEConfig(
            cfg.block_m, cfg.gu_block_n, 128, cfg.down_block_n, 128, cfg.num_warps, stages
        )
    gu_n_max, dn_n_max = cfg.gu_block_n, cfg.down_block_n
    if cfg.block_m <= 32:
        # Few row blocks (decode): narrow the N tiles until the grid covers the SMs about
        # twice, else a handful of programs stream all the weights (bench preset, T=1: 4
        # experts x 768 / 64 = 48 programs on 132 SMs).
        blocks = min(num_experts, num_pairs)
        while gu_n_max > 16 and blocks * triton.cdiv(inter, gu_n_max) < TARGET_PROGRAMS:
            gu_n_max //= 2
        while dn_n_max > 16 and blocks * triton.cdiv(hidden, dn_n_max) < TARGET_PROGRAMS:
            dn_n_max //= 2
    # tiny models (tests, the tiny preset): never a tile much larger than the dimension
    gu_n = max(16, min(gu_n_max, triton.next_power_of_2(inter)))
    min_k = 32 if fp8 else 16  # e4m3 dots take K >= 32
    gu_k = max(min_k, min(cfg.gu_block_k, triton.next_power_of_2(hidden)))
    dn_n = max(16, min(dn_n_max, triton.next_power_of_2(hidden)))
    dn_k = max(min_k, min(cfg.down_block_k, triton.next_power_of_2(inter)))
    return MoEConfig(cfg.block_m, gu_n, gu_k, dn_n, dn_k, cfg.num_warps, cfg.num_stages)


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of the aligned row count: at most min(E, pairs) non-empty segments."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


# ---------------------------------------------------------------------------------------------
# 1. align
# ---------------------------------------------------------------------------------------------


@triton.jit
def _align_kernel(
    ids_ptr,
    num_pairs,
    num_blocks,
    sorted_ptr,  # [num_blocks * BLOCK_M] int32: pair id at each aligned row
    block_expert_ptr,  # [num_blocks] int32: expert of each block, E past the padded total
    seg_start_ptr,  # [E] int32: first aligned row of each expert's segment
    counts_ptr,  # [E] int32: pairs of each expert
    row_of_pair_ptr,  # [num_pairs] int32: aligned row of each pair, -1 for a skipped pair
    E: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    grid_dependency()
    e_offs = tl.arange(0, BLOCK_E)
    e_mask = e_offs < E
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for p0 in range(0, num_pairs, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        ex = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1).to(tl.int32)
        hit = (ex[:, None] == e_offs[None, :]) & e_mask[None, :]  # id E (skipped) hits no lane
        counts += tl.sum(hit.to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    seg_end = tl.cumsum(padded, axis=0)
    seg_start = seg_end - padded
    tl.store(seg_start_ptr + e_offs, seg_start, mask=e_mask)
    tl.store(counts_ptr + e_offs, counts, mask=e_mask)
    # stable rank of each pair inside its expert's segment
    seen = tl.zeros([BLOCK_E], dtype=tl.int32)
    for p0 in range(0, num_pairs, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        p_mask = p < num_pairs
        ex = tl.load(ids_ptr + p, mask=p_mask, other=-1).to(tl.int32)
        onehot = ((ex[:, None] == e_offs[None, :]) & e_mask[None, :]).to(tl.int32)
        before = tl.cumsum(onehot, axis=0) - 1 + seen[None, :] + seg_start[None, :]
        row = tl.sum(onehot * before, axis=1)
        kept = (ex >= 0) & (ex < E)
        tl.store(sorted_ptr + row, p, mask=p_mask & kept)
        tl.store(row_of_pair_ptr + p, tl.where(kept, row, -1), mask=p_mask)
        seen += tl.sum(onehot, axis=0)
    for b0 in range(0, num_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        done = (seg_end[None, :] <= (b * BLOCK_M)[:, None]) & e_mask[None, :]
        tl.store(block_expert_ptr + b, tl.sum(done.to(tl.int32), axis=1), mask=b < num_blocks)


def _align_torch(ids: torch.Tensor, num_experts: int, block_m: int, num_blocks: int):
    """Same buffers as _align_kernel from sync-free torch ops (large batches). Ids equal to
    E (skipped pairs) count under a last, E-th counter that gets no segment: they sort last,
    their sorted rows go to a dump slot past the buffer and their row_of_pair is -1."""
    flat = ids.reshape(-1).long().clamp(max=num_experts)  # past E: skipped, as E
    n = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts:].zero_()  # `padded[E] = 0` would copy the 0 from the host: a sync
    seg_end = padded.cumsum(0)
    seg_start = seg_end - padded
    first_pair = counts.cumsum(0) - counts
    sorted_e, order = torch.sort(flat, stable=True)
    rows = seg_start[sorted_e] + torch.arange(n, device=dev) - first_pair[sorted_e]
    kept = sorted_e < num_experts
    dump = num_blocks * block_m
    sorted_ids = torch.empty(dump + 1, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, torch.where(kept, rows, dump), order.to(torch.int32))
    row_of_pair = torch.empty(n, dtype=torch.int32, device=dev)
    row_of_pair.scatter_(0, order, torch.where(kept, rows, -1).to(torch.int32))
    starts = torch.arange(num_blocks, device=dev, dtype=torch.int64) * block_m
    block_expert = torch.searchsorted(seg_end[:num_experts], starts, right=True)
    return (
        sorted_ids[:dump],
        block_expert.to(torch.int32),
        seg_start[:num_experts].to(torch.int32),
        counts[:num_experts].to(torch.int32),
        row_of_pair,
    )


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int):
    """(sorted pair ids [rows], expert per block [rows / block_m], segment starts [E],
    counts [E], aligned row of each pair [T*k]); all int32, sizes from shapes only. Rows past
    an expert's count are padding. A pair whose id is E (another EP rank's expert) gets no row:
    its row_of_pair is -1; so does a pair whose id is past E (the align kernel and
    _align_torch both treat it as E)."""
    n = ids.numel()
    num_blocks = max_padded_rows(n, num_experts, block_m) // block_m
    if n > ALIGN_KERNEL_MAX_PAIRS:
        return _align_torch(ids, num_experts, block_m, num_blocks)
    dev = ids.device
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    seg_start = torch.empty(num_experts, dtype=torch.int32, device=dev)
    counts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    row_of_pair = torch.empty(n, dtype=torch.int32, device=dev)
    block_e = triton.next_power_of_2(num_experts)
    # One program does n x E compares twice; 16 warps on [tile_rows, E] tiles of ~16K lanes
    # keep that near 10 us at 2,048 pairs x 512 expert lanes (real model, T=256). Fewer pairs
    # and blocks than that take a tile no taller than they are, a warp per 1K lanes: a decode
    # batch of 8 on rank 0 (64 pairs, 36 experts) ran [256, 64] tiles on 16 warps, 9.2 us a
    # call on the H200, its scans over 4x the rows it has.
    tile_rows = max(16, min(256, 16384 // block_e, triton.next_power_of_2(max(n, num_blocks))))
    warps = max(4, min(16, tile_rows * block_e // 1024))
    _align_kernel[(1,)](
        ids.reshape(-1),
        n,
        num_blocks,
        sorted_ids,
        block_expert,
        seg_start,
        counts,
        row_of_pair,
        E=num_experts,
        BLOCK_E=block_e,
        BLOCK_P=tile_rows,
        BLOCK_B=tile_rows,
        BLOCK_M=block_m,
        num_warps=warps,
        **LAUNCH,
    )
    return sorted_ids, block_expert, seg_start, counts, row_of_pair


# ---------------------------------------------------------------------------------------------
# 2. gate/up + SwiGLU, 3. down * routing weight, combine
# ---------------------------------------------------------------------------------------------


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w13_ptr,
    inter_ptr,
    sorted_ptr,
    block_expert_ptr,
    seg_start_ptr,
    counts_ptr,
    xs_ptr,  # FP8: [T, KB] activation scales
    ws_ptr,  # FP8: [E, 2 * NB, KB] weight block scales (gate's NB rows, then up's)
    limit,
    E: tl.constexpr,
    HD: tl.constexpr,
    INTER: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    FP8: tl.constexpr,
    GROUP: tl.constexpr,
    KB: tl.constexpr,
    NB: tl.constexpr,
):
    grid_dependency()
    # n fastest: the programs of one row block run together and share its x rows in L2
    num_n = tl.cdiv(INTER, BLOCK_N)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    e = tl.load(block_expert_ptr + pid_m)
    if e >= E:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = (rows - tl.load(seg_start_ptr + e)) < tl.load(counts_ptr + e)
    pair = tl.load(sorted_ptr + rows, mask=valid, other=0)
    tok = tl.where(valid, pair // TOPK, 0)

    n_offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n_offs < INTER
    k_offs = tl.arange(0, BLOCK_K)
    # int32 tile offsets from scalar bases (the host checks every buffer fits int32; only the
    # expert's base offset needs int64): fewer registers than 64-bit pointer tiles
    a_offs = tok[:, None] * HD + k_offs[None, :]
    g_base = w13_ptr + e.to(tl.int64) * (2 * INTER * HD)
    u_base = g_base + INTER * HD
    w_offs = n_offs[None, :] * HD + k_offs[:, None]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if FP8:  # scale rows of this tile's columns; BLOCK_K divides GROUP, so one group per step
        xs_ptrs = xs_ptr + tok * KB
        gs_ptrs = ws_ptr + e.to(tl.int64) * (2 * NB * KB) + (n_offs // GROUP) * KB
        us_ptrs = gs_ptrs + NB * KB
    for k0 in range(0, HD, BLOCK_K):
        # Rows without a pair read token 0's row (tok is 0 there), harmlessly: no row mask.
        if EVEN_K and EVEN_N:
            a = tl.load(x_ptr + k0 + a_offs)
            wg = tl.load(g_base + k0 + w_offs)
            wu = tl.load(u_base + k0 + w_offs)
        else:
            k_mask = (k0 + k_offs) < HD
            w_mask = k_mask[:, None] & n_mask[None, :]
            a = tl.load(x_ptr + k0 + a_offs, mask=k_mask[None, :], other=0.0)
            wg = tl.load(g_base + k0 + w_offs, mask=w_mask, other=0.0)
            wu = tl.load(u_base + k0 + w_offs, mask=w_mask, other=0.0)
        if FP8:
            a_s = tl.load(xs_ptrs + k0 // GROUP)[:, None]
            acc_g += tl.dot(a, wg) * (a_s * tl.load(gs_ptrs + k0 // GROUP, mask=n_mask)[None, :])
            acc_u += tl.dot(a, wu) * (a_s * tl.load(us_ptrs + k0 // GROUP, mask=n_mask)[None, :])
        elif IEEE:
            acc_g = tl.dot(a, wg, acc_g, input_precision="ieee")
            acc_u = tl.dot(a, wu, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, wg, acc_g)
            acc_u = tl.dot(a, wu, acc_u)
    gate = tl.minimum(acc_g, limit)
    up = tl.minimum(tl.maximum(acc_u, -limit), limit)
    h = gate * tl.sigmoid(gate) * up
    out_ptrs = inter_ptr + rows[:, None] * INTER + n_offs[None, :]
    tl.store(out_ptrs, h.to(inter_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(
    inter_ptr,
    w2_ptr,
    out_ptr,  # [aligned rows, HD]: row = the pair's aligned row
    weight_ptr,  # [T*k] float32
    sorted_ptr,
    block_expert_ptr,
    seg_start_ptr,
    counts_ptr,
    hs_ptr,  # FP8: [aligned rows, KB] scales of the quantized intermediate
    ws_ptr,  # FP8: [E, ceil(HD / GROUP), KB] weight block scales
    E: tl.constexpr,
    HD: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    FP8: tl.constexpr,
    GROUP: tl.constexpr,
    KB: tl.constexpr,
):
    grid_dependency()
    num_n = tl.cdiv(HD, BLOCK_N)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    e = tl.load(block_expert_ptr + pid_m)
    if e >= E:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = (rows - tl.load(seg_start_ptr + e)) < tl.load(counts_ptr + e)
    pair = tl.load(sorted_ptr + rows, mask=valid, other=0)

    n_offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n_offs < HD
    k_offs = tl.arange(0, BLOCK_K)
    a_offs = rows[:, None] * INTER + k_offs[None, :]
    w_base = w2_ptr + e.to(tl.int64) * (HD * INTER)
    w_offs = n_offs[None, :] * INTER + k_offs[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if FP8:
        hs_ptrs = hs_ptr + rows * KB
        ws_ptrs = ws_ptr + e.to(tl.int64) * (tl.cdiv(HD, GROUP) * KB) + (n_offs // GROUP) * KB
    for k0 in range(0, INTER, BLOCK_K):
        # Padding rows of h hold garbage; each output row depends on its own row only, and
        # padding rows are never stored: no row mask.
        if EVEN_K and EVEN_N:
            a = tl.load(inter_ptr + k0 + a_offs)
            w = tl.load(w_base + k0 + w_offs)
        else:
            k_mask = (k0 + k_offs) < INTER
            a = tl.load(inter_ptr + k0 + a_offs, mask=k_mask[None, :], other=0.0)
            w = tl.load(w_base + k0 + w_offs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if FP8:
            a_s = tl.load(hs_ptrs + k0 // GROUP)[:, None]
            acc += tl.dot(a, w) * (a_s * tl.load(ws_ptrs + k0 // GROUP, mask=n_mask)[None, :])
        elif IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    acc = acc * tl.load(weight_ptr + pair, mask=valid, other=0.0)[:, None]
    # Stored at the aligned row (contiguous): scattering rows to pair order here makes the
    # accumulator spill at 128-row tiles; the combine kernel gathers through row_of_pair.
    out_ptrs = out_ptr + rows[:, None] * HD + n_offs[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _combine_kernel(
    y_ptr, row_of_pair_ptr, out_ptr, HD: tl.constexpr, TOPK: tl.constexpr, BLOCK: tl.constexpr
):
    """out[t] = sum_j y[row_of_pair[t*k + j]] in fp32, in a fixed order (deterministic);
    skipped pairs (row -1) add nothing."""
    grid_dependency()
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < HD
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        row = tl.load(row_of_pair_ptr + t * TOPK + j).to(tl.int64)  # -1: a skipped pair
        acc += tl.load(y_ptr + row * HD + offs, mask=mask & (row >= 0), other=0.0).to(tl.float32)
    tl.store(out_ptr + t * HD + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """x: [T, Hd]; w13: [E, 2I, Hd] (gate rows then up rows); w2: [E, Hd, I];
    weights [T, k] float32; ids [T, k] int64.

    Returns sum_k weights[t,k] * expert_{ids[t,k]}(x[t]), shape [T, Hd], in x's dtype.
    Ids equal to E add nothing and cost nothing, as in kernels.moe.experts: align gives them
    no row, so no GEMM program computes them (under EP8 that is 7/8 of the pairs; run 5 computed
    them as expert 0 with weight 0: 4.6 ms per MoE layer at an 8,192-token prefill).
    """
    return _fused(x, w13, w2, None, None, weights, ids, limit)


def experts_fp8(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """kernels.moe.experts_fp8 fused: block-FP8 weights (w13/w2 float8_e4m3fn with float32
    block scales), x quantized per token group before gate/up (kernels/triton/fp8.py) and the
    SwiGLU output, stored in x's dtype, quantized per row group before down. The same three
    steps as `experts`; the GEMMs run e4m3 dots with the scales applied per K step."""
    return _fused(x, w13, w2, w13_scale, w2_scale, weights, ids, limit)


def _fused(x, w13, w2, w13_scale, w2_scale, weights, ids, limit) -> torch.Tensor:
    fp8 = w13_scale is not None
    tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = ids.shape[1]
    out = torch.empty_like(x)
    if tokens == 0:
        return out
    x = x.contiguous()
    w13 = w13.contiguous()
    w2 = w2.contiguous()
    n = tokens * top_k
    cfg = moe_config(n, num_experts, hidden, inter, w13.dtype)
    sorted_ids, block_expert, seg_start, counts, row_of_pair = moe_align(
        ids.contiguous(), num_experts, cfg.block_m
    )
    num_blocks = block_expert.numel()
    ieee = x.dtype == torch.float32
    h = torch.empty(num_blocks * cfg.block_m, inter, device=x.device, dtype=x.dtype)
    # the kernels index tiles with int32 offsets (expert bases are int64)
    biggest = max(h.shape[0] * max(inter, hidden), tokens * hidden, 2 * inter * hidden)
    assert biggest < 2**31, "MoE buffers exceed int32 offsets"
    a, a_scale = quantize_act(x) if fp8 else (x, x)
    kb_hidden, nb_inter = triton.cdiv(hidden, GROUP), triton.cdiv(inter, GROUP)
    _gate_up_kernel[(num_blocks * triton.cdiv(inter, cfg.gu_block_n),)](
        a,
        w13,
        h,
        sorted_ids,
        block_expert,
        seg_start,
        counts,
        a_scale,
        w13_scale.contiguous() if fp8 else x,
        float(limit),
        E=num_experts,
        HD=hidden,
        INTER=inter,
        TOPK=top_k,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.gu_block_n,
        BLOCK_K=cfg.gu_block_k,
        IEEE=ieee and not fp8,
        EVEN_K=hidden % cfg.gu_block_k == 0,
        EVEN_N=inter % cfg.gu_block_n == 0,
        FP8=fp8,
        GROUP=GROUP,
        KB=kb_hidden,
        NB=nb_inter,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **LAUNCH,
    )
    # FP8: every aligned row is quantized, padding rows (garbage) included; each output row of
    # the down GEMM depends on its own row only, and padding rows are never stored
    h_in, h_scale = quantize_act(h) if fp8 else (h, h)
    y = torch.empty(h.shape[0], hidden, device=x.device, dtype=x.dtype)
    _down_kernel[(num_blocks * triton.cdiv(hidden, cfg.down_block_n),)](
        h_in,
        w2,
        y,
        weights.contiguous().float().reshape(-1),
        sorted_ids,
        block_expert,
        seg_start,
        counts,
        h_scale,
        w2_scale.contiguous() if fp8 else x,
        E=num_experts,
        HD=hidden,
        INTER=inter,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.down_block_n,
        BLOCK_K=cfg.down_block_k,
        IEEE=ieee and not fp8,
        EVEN_K=inter % cfg.down_block_k == 0,
        EVEN_N=hidden % cfg.down_block_n == 0,
        FP8=fp8,
        GROUP=GROUP,
        KB=nb_inter,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **LAUNCH,
    )
    block = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(tokens, triton.cdiv(hidden, block))](
        y, row_of_pair, out, HD=hidden, TOPK=top_k, BLOCK=block, num_warps=4, **LAUNCH
    )
    return out

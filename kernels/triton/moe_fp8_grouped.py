"""Block-FP8 routed experts as two persistent grouped GEMMs on TMA tiles: same signature and
results as kernels.moe.experts_fp8, for prefill-sized batches (serving/layers/mlp.py picks it by
FP8_GROUPED_MIN_PAIRS_PER_EXPERT).

Four steps, no host sync (capturable; every shape, grid and buffer size from host ints):

1. layout (pad_sort: two small Triton passes around a cumulative sum, no sort): the T*k (token,
   slot) pairs placed by expert, stable, ids equal to E (other EP ranks' experts) given no row,
   each expert's segment padded to BLOCK_M rows, so that every M tile belongs to one expert.
   Buffers are sized for the upper bound max_padded_rows(T*k, E, BLOCK_M) (kernels/triton/
   moe.py); the padded total lives on the device only (`total`, one int32) and every kernel
   reads it: tiles and rows at or past it are neither computed nor read. Padding rows have
   token -1 and routing weight 0.
   Then one pass gathers x's row of each padded row and quantizes it per 128-column group to
   e4m3 (kernels/triton/e4m3.py: the bits of kernels.fp8.quantize_act); padding rows are zeros.
2. gate/up: persistent (one program per SM, a grouped tile order so that the M tiles sharing a
   weight tile run together and meet it in L2), A and w13 read through host-side TMA
   descriptors, BLOCK_K = 128 = one scale group: each K step adds
   dot(a, w) * a_scale[row] * w_scale (the weight scale is one float per 128 x 128 block, so per
   tile and K step a scalar). A
   tile holds 128 gate and the 128 matching up columns (two dots, two accumulators), so its
   epilogue has whole 128-column groups of h: SwiGLU with the clamp, rounded to x's dtype (the
   reference's order), quantized and stored as e4m3 + scale. No separate quantization pass.
3. down: the same structure over h, BLOCK_N (<= 128) columns of Hd; the epilogue multiplies by
   the row's routing weight and stores x's dtype at the padded row.
4. combine: kernels/triton/moe_grouped.py's fixed-order combine (no atomics: deterministic),
   unweighted; a pair whose row is at or past `total` (id E) adds nothing.

Descriptors are host-side (triton.tools.tensor_descriptor.TensorDescriptor, kernel parameters
by value): no device-side descriptor scratch, so no triton.set_allocator, and a captured graph
replays the same encoded descriptors on the same buffers. TMA zero-fills reads past a
descriptor's shape (partial K groups) and clips stores past it. A tile that runs past an
expert's I or Hd rows reads the next rows of the flattened weight (up rows, the next expert):
those columns are masked to zero before h's quantization and clipped or never read downstream.

The scales of the activations are stored group-major ([groups, rows]): a K step reads BLOCK_M
contiguous floats.

Hazard (registers): a gate/up tile carries two fp32 accumulators, and `acc += dot * scale` a
third tile for the dot's result: at BLOCK_M 128 and 8 warps 3 x 64 registers per thread, which
spills a little (fp8_grouped_config's numbers). Accumulating in place instead (acc = dot(a, w,
acc * s_prev / s), the scale applied once at the end) was measured on the H200 and removed: the
e4m3 wgmma's reduced-precision accumulator then carries the whole K sum (1.2-1.5% relative
Frobenius error against the reference, over the bf16 bound of 1%), and no tile of it was faster.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.fp8 import BLOCK as GROUP
from kernels.fp8 import FP8
from kernels.triton.e4m3 import quant_rows
from kernels.triton.moe import max_padded_rows
from kernels.triton.moe_grouped import combine

# padded rows per item of the gather-quantize pass, and its programs per SM (4 warps each)
QUANT_ROWS = 32
QUANT_PROGRAMS_PER_SM = 8
# programs of the persistent GEMMs when not on a GPU (the interpreter): a few, so that the tests
# run programs through several tiles
INTERPRETER_PROGRAMS = 3
# rounding of h before its quantization: to x's dtype
_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass(frozen=True)
class GroupedFP8Config:
    block_m: int  # rows per tile: each expert's segment is padded to it
    gu_warps: int
    gu_stages: int
    down_block_n: int  # columns of Hd per down tile: 64 or 128 (one weight scale block)
    down_warps: int
    down_stages: int
    group_m: int  # M tiles per group of the tile order (L2 reuse of the weight tiles)
    flatten: bool = False  # tl.range(flatten=): one software pipeline across a program's tiles


def fp8_grouped_config(num_pairs: int, num_experts: int) -> GroupedFP8Config:
    """Tiles for the H200 from T*k / E (host ints only; under EP the local pairs are about 1/EP
    of that).

    Shared memory per pipeline stage: gate/up BLOCK_M x 128 of A + 2 x 128 x 128 of w13 (48 KiB
    at BLOCK_M 128), down BLOCK_M x 128 + BLOCK_N x 128 (32 KiB); the epilogue takes its own
    scratch beside the stages (227 KiB per SM). ptxas for sm_90a (Triton 3.6, compiled ahead of
    time at the rank shape; registers per thread, spill bytes, shared KiB):
    - gate/up, 128 rows, 8 warps, 3 stages: acc += dot * s 255 / 56 / 160 (the dot's fp32
      temporary beside both accumulators; 124 B before the K step's scalings came ahead of
      both dots; 148-216 B flattened); 16 warps 128 / 40; 64 rows at 8 warps 164 / 0 / 168.
    - down, 128 x 128, 8 warps, 4 stages: 156 / 0 / 160.
    None serializes its wgmmas (ptxas C7515). The H200's sweep (bench.prefill_moe --configs,
    8,192 tokens at rank 0, 2026-12-05): these tiles 0.738 ms, the best of 69 0.724 (group_m
    16), within the run's noise."""
    if num_pairs < 64 * max(num_experts, 1):  # small segments: 128-row tiles would be mostly pad
        return GroupedFP8Config(64, 8, 4, 128, 8, 4, 8)
    return GroupedFP8Config(128, 8, 3, 128, 8, 4, 8)


@cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs(device: torch.device, tiles_bound: int, per_sm: int = 1) -> int:
    sms = _num_sms(device.index or 0) if device.type == "cuda" else INTERPRETER_PROGRAMS
    return max(1, min(sms * per_sm, tiles_bound))


# ---------------------------------------------------------------------------------------------
# 1. layout
# ---------------------------------------------------------------------------------------------


@triton.jit
def _block_counts_kernel(
    ids_ptr,  # [n] int64 expert ids, E (or more) for other ranks' experts
    n,
    counts_ptr,  # [programs, E] int32: pairs of each expert in each program's block
    E: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    ex = tl.load(ids_ptr + p, mask=p < n, other=E).to(tl.int32)
    e_offs = tl.arange(0, BLOCK_E)
    hit = ex[:, None] == e_offs[None, :]  # ids >= E hit no lane below E
    counts = tl.sum(hit.to(tl.int32), axis=0)
    tl.store(counts_ptr + tl.program_id(0) * E + e_offs, counts, mask=e_offs < E)


@triton.jit
def _place_kernel(
    ids_ptr,
    weights_ptr,  # [n] float32
    n,
    prefix_ptr,  # [programs, E] int32: counts_ptr's inclusive cumulative sum over programs
    token_of_row_ptr,  # [R] int32, -1 beforehand
    weight_of_row_ptr,  # [R] float32, 0 beforehand
    row_of_pair_ptr,  # [n] int32
    expert_of_tile_ptr,  # [R / BLOCK_M] int32
    total_ptr,  # [1] int32
    R,
    E: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Each pair's padded row: its expert's segment start + the pairs of that expert in earlier
    blocks + its rank among them in this block (stable). Program 0 also writes each tile's
    expert and the total."""
    pid = tl.program_id(0)
    last = tl.num_programs(0) - 1
    e_offs = tl.arange(0, BLOCK_E)
    e_mask = e_offs < E
    counts = tl.load(prefix_ptr + last * E + e_offs, mask=e_mask, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    seg_end = tl.cumsum(padded, axis=0)
    seg_start = seg_end - padded
    earlier = tl.load(prefix_ptr + (pid - 1) * E + e_offs, mask=e_mask & (pid > 0), other=0)
    p = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    live = p < n
    ex = tl.load(ids_ptr + p, mask=live, other=E).to(tl.int32)
    onehot = (ex[:, None] == e_offs[None, :]).to(tl.int32)
    slot = tl.cumsum(onehot, axis=0) - 1 + (earlier + seg_start)[None, :]
    row = tl.sum(onehot * slot, axis=1)
    kept = live & (ex < E)
    tl.store(token_of_row_ptr + row, (p // TOPK).to(tl.int32), mask=kept)
    tl.store(weight_of_row_ptr + row, tl.load(weights_ptr + p, mask=kept, other=0.0), mask=kept)
    tl.store(row_of_pair_ptr + p, tl.where(kept, row, R), mask=live)
    if pid == 0:
        tl.store(total_ptr, tl.sum(padded, axis=0))
        bound = tl.where(e_mask, seg_end, 2147483647)
        for t0 in range(0, R // BLOCK_M, BLOCK_P):
            t = t0 + tl.arange(0, BLOCK_P)
            done = (bound[None, :] <= (t * BLOCK_M)[:, None]).to(tl.int32)
            tl.store(expert_of_tile_ptr + t, tl.sum(done, axis=1), mask=t < R // BLOCK_M)


def pad_sort(ids: torch.Tensor, weights: torch.Tensor, num_experts: int, block_m: int):
    """(token of each padded row [R] int32, -1 on padding; routing weight of each padded row [R]
    float32, 0 on padding; padded row of each pair [T*k] int32, R for id E; expert of each
    M tile [R / block_m] int32, E past the total; total [1] int32: padded rows in use).
    R = max_padded_rows(T*k, E, block_m). Sync-free, five launches (two of them fills): block
    counts, their cumulative sum over blocks (torch), one placing pass."""
    n = ids.numel()
    dev = ids.device
    rows_bound = max_padded_rows(n, num_experts, block_m)
    block_e = triton.next_power_of_2(num_experts)
    block_p = max(16, min(256, 16384 // block_e))  # [pairs, experts] tiles of <= 16K lanes
    programs = triton.cdiv(n, block_p)
    flat = ids.reshape(-1).contiguous()
    counts = torch.empty(programs, num_experts, dtype=torch.int32, device=dev)
    _block_counts_kernel[(programs,)](
        flat, n, counts, E=num_experts, BLOCK_E=block_e, BLOCK_P=block_p, num_warps=4
    )
    prefix = counts.cumsum(0, dtype=torch.int32)
    token_of_row = torch.full((rows_bound,), -1, dtype=torch.int32, device=dev)
    weight_of_row = torch.zeros(rows_bound, dtype=torch.float32, device=dev)
    row_of_pair = torch.empty(n, dtype=torch.int32, device=dev)
    expert_of_tile = torch.empty(rows_bound // block_m, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    _place_kernel[(programs,)](
        flat,
        weights.reshape(-1).float().contiguous(),
        n,
        prefix,
        token_of_row,
        weight_of_row,
        row_of_pair,
        expert_of_tile,
        total,
        rows_bound,
        E=num_experts,
        TOPK=ids.shape[1],
        BLOCK_E=block_e,
        BLOCK_P=block_p,
        BLOCK_M=block_m,
        num_warps=16,  # 32 lanes of each [pairs, experts] tile per thread (4 warps spilled)
    )
    return token_of_row, weight_of_row, row_of_pair, expert_of_tile, total


@triton.jit
def _gather_quant_kernel(
    x_ptr,  # [T, HD]
    token_of_row_ptr,  # [R] int32, -1 on padding
    total_ptr,
    q_ptr,  # [R, HD] e4m3
    s_ptr,  # [KB, R] float32: group-major
    R,
    num_progs,
    HD: tl.constexpr,
    KB: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Padded rows r < total: x's row of r's token (zeros on padding), quantized per group of
    128 columns. Persistent over (block of ROWS rows, group) items, blocks past the total never
    visited (the buffers' bound is about 8x the total under EP8: a program per block would
    mostly launch to exit)."""
    items = tl.cdiv(tl.load(total_ptr), ROWS) * KB
    for item in range(tl.program_id(0), items, num_progs):
        g = item % KB
        rows = (item // KB) * ROWS + tl.arange(0, ROWS)
        cols = g * 128 + tl.arange(0, 128)
        tok = tl.load(token_of_row_ptr + rows)
        mask = cols[None, :] < HD
        v = tl.load(
            x_ptr + tok.to(tl.int64)[:, None] * HD + cols[None, :],
            mask=(tok >= 0)[:, None] & mask,
            other=0.0,
        )
        q, scale = quant_rows(v.to(tl.float32))
        tl.store(
            q_ptr + rows.to(tl.int64)[:, None] * HD + cols[None, :],
            q.to(q_ptr.dtype.element_ty),
            mask=mask,
        )
        tl.store(s_ptr + g * R + rows, scale)


# ---------------------------------------------------------------------------------------------
# 2. gate/up + SwiGLU + quantization of h, 3. down * routing weight
# ---------------------------------------------------------------------------------------------


@triton.jit
def _tile(tile, m_tiles, N_TILES: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of a tile index: GROUP_M M tiles fastest, then N (grouped order)."""
    per_group = GROUP_M * N_TILES
    first_m = (tile // per_group) * GROUP_M
    size_m = tl.minimum(m_tiles - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % size_m
    pid_n = (tile % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def _gate_up_kernel(
    a_desc,  # [R, HD] e4m3, block [BLOCK_M, 128]
    w_desc,  # [E * 2 * INTER, HD] e4m3 (w13 flattened), block [128, 128]
    h_desc,  # [R, INTER] e4m3, block [BLOCK_M, 128]
    as_ptr,  # [KB, R] float32
    ws_ptr,  # [E, 2 * NB, KB] float32: gate's NB block rows, then up's
    hs_ptr,  # [NB, R] float32
    expert_of_tile_ptr,
    total_ptr,
    limit,
    R,
    HD: tl.constexpr,
    INTER: tl.constexpr,
    KB: tl.constexpr,
    NB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGS: tl.constexpr,
    FLATTEN: tl.constexpr,
    ROUND: tl.constexpr,  # h rounded to x's dtype first: 0 float32, 1 bf16, 2 fp16
):
    m_tiles = tl.load(total_ptr) // BLOCK_M
    lanes = tl.arange(0, BLOCK_M)
    cols0 = tl.arange(0, 128)
    for tile in tl.range(tl.program_id(0), m_tiles * NB, NUM_PROGS, flatten=FLATTEN):
        pid_m, pid_n = _tile(tile, m_tiles, NB, GROUP_M)
        e = tl.load(expert_of_tile_ptr + pid_m)
        off_m = pid_m * BLOCK_M
        rows = off_m + lanes
        gate_row = e * (2 * INTER) + pid_n * 128
        gs_ptr = ws_ptr + (e * (2 * NB) + pid_n) * KB
        us_ptr = gs_ptr + NB * KB
        acc_g = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
        for kb in range(KB):
            a = a_desc.load([off_m, kb * 128])
            a_s = tl.load(as_ptr + kb * R + rows)
            g_s = a_s * tl.load(gs_ptr + kb)
            u_s = a_s * tl.load(us_ptr + kb)
            wg = w_desc.load([gate_row, kb * 128])
            wu = w_desc.load([gate_row + INTER, kb * 128])
            acc_g += tl.dot(a, wg.T) * g_s[:, None]
            acc_u += tl.dot(a, wu.T) * u_s[:, None]
        gate = tl.minimum(acc_g, limit)
        up = tl.minimum(tl.maximum(acc_u, -limit), limit)
        h = gate * tl.sigmoid(gate) * up
        if ROUND == 1:
            h = h.to(tl.bfloat16).to(tl.float32)
        elif ROUND == 2:
            h = h.to(tl.float16).to(tl.float32)
        if INTER % 128 != 0:  # columns past I (the up rows read past gate's): out of the group
            h = tl.where((pid_n * 128 + cols0)[None, :] < INTER, h, 0.0)
        q, h_s = quant_rows(h)
        h_desc.store([off_m, pid_n * 128], q.to(h_desc.dtype))
        tl.store(hs_ptr + pid_n * R + rows, h_s)


@triton.jit
def _down_kernel(
    h_desc,  # [R, INTER] e4m3, block [BLOCK_M, 128]
    w_desc,  # [E * HD, INTER] e4m3 (w2 flattened), block [BLOCK_N, 128]
    y_desc,  # [R, HD] x's dtype, block [BLOCK_M, BLOCK_N]
    hs_ptr,  # [NB, R] float32
    ws_ptr,  # [E, HB, NB] float32
    weight_of_row_ptr,  # [R] float32, 0 on padding
    expert_of_tile_ptr,
    total_ptr,
    R,
    HD: tl.constexpr,
    NB: tl.constexpr,
    HB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGS: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    N_TILES: tl.constexpr = (HD + BLOCK_N - 1) // BLOCK_N
    m_tiles = tl.load(total_ptr) // BLOCK_M
    lanes = tl.arange(0, BLOCK_M)
    for tile in tl.range(tl.program_id(0), m_tiles * N_TILES, NUM_PROGS, flatten=FLATTEN):
        pid_m, pid_n = _tile(tile, m_tiles, N_TILES, GROUP_M)
        e = tl.load(expert_of_tile_ptr + pid_m)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        rows = off_m + lanes
        s_ptr = ws_ptr + (e * HB + off_n // 128) * NB  # BLOCK_N divides 128: one block row
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(NB):
            a = h_desc.load([off_m, kb * 128])
            w = w_desc.load([e * HD + off_n, kb * 128])
            scale = tl.load(hs_ptr + kb * R + rows) * tl.load(s_ptr + kb)
            acc += tl.dot(a, w.T) * scale[:, None]
        acc = acc * tl.load(weight_of_row_ptr + rows)[:, None]
        y_desc.store([off_m, off_n], acc.to(y_desc.dtype))


# ---------------------------------------------------------------------------------------------
# the call
# ---------------------------------------------------------------------------------------------


def gather_quant(x: torch.Tensor, token_of_row: torch.Tensor, total: torch.Tensor):
    """(e4m3 rows [R, Hd], their scales [ceil(Hd/128), R]): step 1's second half."""
    rows, hidden = token_of_row.numel(), x.shape[1]
    kb = triton.cdiv(hidden, GROUP)
    xq = torch.empty(rows, hidden, device=x.device, dtype=FP8)
    xs = torch.empty(kb, rows, device=x.device, dtype=torch.float32)
    programs = _programs(x.device, triton.cdiv(rows, QUANT_ROWS) * kb, QUANT_PROGRAMS_PER_SM)
    _gather_quant_kernel[(programs,)](
        x.contiguous(),
        token_of_row,
        total,
        xq,
        xs,
        rows,
        programs,
        HD=hidden,
        KB=kb,
        ROWS=QUANT_ROWS,
        num_warps=4,
    )
    return xq, xs


def gate_up(xq, xs, w13, w13_scale, expert_of_tile, total, limit, round_to, cfg):
    """(h e4m3 [R, I], its scales [ceil(I/128), R]): step 2; round_to: x's dtype."""
    rows, hidden = xq.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    kb, nb = triton.cdiv(hidden, GROUP), triton.cdiv(inter, GROUP)
    hq = torch.empty(rows, inter, device=xq.device, dtype=FP8)
    hs = torch.empty(nb, rows, device=xq.device, dtype=torch.float32)
    w13_flat = w13.contiguous().view(num_experts * two_inter, hidden)
    bm = cfg.block_m
    programs = _programs(xq.device, rows // bm * nb)
    _gate_up_kernel[(programs,)](
        TensorDescriptor.from_tensor(xq, [bm, GROUP]),
        TensorDescriptor.from_tensor(w13_flat, [GROUP, GROUP]),
        TensorDescriptor.from_tensor(hq, [bm, GROUP]),
        xs,
        w13_scale.contiguous(),
        hs,
        expert_of_tile,
        total,
        float(limit),
        rows,
        HD=hidden,
        INTER=inter,
        KB=kb,
        NB=nb,
        BLOCK_M=bm,
        GROUP_M=cfg.group_m,
        NUM_PROGS=programs,
        FLATTEN=cfg.flatten,
        ROUND=_ROUND[round_to],
        num_warps=cfg.gu_warps,
        num_stages=cfg.gu_stages,
    )
    return hq, hs


def down(hq, hs, w2, w2_scale, weight_of_row, expert_of_tile, total, out_dtype, cfg):
    """Weighted expert outputs [R, Hd] in out_dtype at the padded rows: step 3."""
    rows, inter = hq.shape
    num_experts, hidden, _ = w2.shape
    y = torch.empty(rows, hidden, device=hq.device, dtype=out_dtype)
    w2_flat = w2.contiguous().view(num_experts * hidden, inter)
    bm, block_n = cfg.block_m, cfg.down_block_n
    programs = _programs(hq.device, rows // bm * triton.cdiv(hidden, block_n))
    _down_kernel[(programs,)](
        TensorDescriptor.from_tensor(hq, [bm, GROUP]),
        TensorDescriptor.from_tensor(w2_flat, [block_n, GROUP]),
        TensorDescriptor.from_tensor(y, [bm, block_n]),
        hs,
        w2_scale.contiguous(),
        weight_of_row,
        expert_of_tile,
        total,
        rows,
        HD=hidden,
        NB=triton.cdiv(inter, GROUP),
        HB=triton.cdiv(hidden, GROUP),
        BLOCK_M=bm,
        BLOCK_N=block_n,
        GROUP_M=cfg.group_m,
        NUM_PROGS=programs,
        FLATTEN=cfg.flatten,
        num_warps=cfg.down_warps,
        num_stages=cfg.down_stages,
    )
    return y


def experts_fp8_grouped(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    limit: float,
    config: GroupedFP8Config | None = None,
) -> torch.Tensor:
    """kernels.moe.experts_fp8 as two grouped GEMMs (module docstring): x [T, Hd] (bf16, fp16 or
    float32); w13 [E, 2I, Hd], w2 [E, Hd, I] float8_e4m3fn with float32 128 x 128 block scales
    w13_scale [E, 2 ceil(I/128), ceil(Hd/128)], w2_scale [E, ceil(Hd/128), ceil(I/128)];
    weights [T, k] float32; ids [T, k], E for another rank's expert. Returns [T, Hd] in x's
    dtype. config: the tiles (None: fp8_grouped_config's rule).

    Hd and I must be multiples of 16 (TMA rows start 16-byte aligned). Scratch is sized for all
    T*k pairs plus padding (the rows are computed for the local pairs only): at 8,192 tokens,
    top-8, Hd 4096, I 2048, 70,144 rows: 0.29 GB of e4m3 x, 0.14 GB of e4m3 h, 0.57 GB of bf16
    expert outputs."""
    tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    if hidden % 16 or (two_inter // 2) % 16:
        raise ValueError(f"grouped FP8 experts need Hd, I multiples of 16: {tuple(w13.shape)}")
    if tokens == 0:
        return torch.empty_like(x)
    cfg = config or fp8_grouped_config(ids.numel(), num_experts)
    token_of_row, weight_of_row, row_of_pair, expert_of_tile, total = pad_sort(
        ids, weights, num_experts, cfg.block_m
    )
    xq, xs = gather_quant(x, token_of_row, total)
    hq, hs = gate_up(xq, xs, w13, w13_scale, expert_of_tile, total, limit, x.dtype, cfg)
    y = down(hq, hs, w2, w2_scale, weight_of_row, expert_of_tile, total, x.dtype, cfg)
    return combine(y, row_of_pair, None, total, x.dtype, top_k=ids.shape[1])

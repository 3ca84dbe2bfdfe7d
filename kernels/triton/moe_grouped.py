"""Routed experts through torch._grouped_mm (CUTLASS grouped GEMM): same signature and results
as kernels.moe.experts, for prefill-sized batches (serving/layers/mlp.py picks it by one rule).

Five steps, no host sync (capturable; every shape and grid from host ints):

1. sort: the T*k (token, slot) pairs by expert id, stable (torch.sort); ids equal to E (other
   EP ranks' experts) sort last. offs = cumulative pair counts of the E experts, int32; local
   pairs are the first offs[E-1] rows of the sorted order, the rest are never computed.
2. gather: x's row of each local pair, in sorted order, into [T*k, Hd] (rows past offs[E-1] are
   not written: a Triton kernel reads offs[E-1] and its programs past it exit).
3. gate/up: _grouped_mm(x_sorted, w13^T, offs) -> [T*k, 2I]; SwiGLU with the clamp
   (kernels.moe.swiglu) in a Triton pass over the local rows, fp32 math, stored in x's dtype.
4. down: _grouped_mm(h, w2^T, offs) -> [T*k, Hd].
5. combine: out[t] = sum_j weights[t, j] * y[row of pair (t, j)] in fp32 over j = 0..k-1 (a
   fixed order, no atomics: deterministic), skipped pairs adding nothing.

What torch._grouped_mm needs, read in PyTorch's source (aten/src/ATen/native/GroupedMMUtils.h,
cuda/GroupedBlas.cpp, cuda/GroupMM.cu, cuda/GroupMMCommon.cuh; 2025-26 main, the releases
since 2.8 agree on these points as far as read; tests/test_moe_grouped.py holds them on CUDA):
- the CUTLASS kernel (no host sync) only for bf16 A, B and output on sm90 / sm100; any other
  dtype on CUDA takes a fallback that copies offs to the host (a sync): bf16 only on CUDA.
- offs: 1-D int32, one cumulative end per group (group g = rows offs[g-1]..offs[g]), as many as
  B's groups (< 1024). In the 2-D A x 3-D B case the group row counts need no alignment and may
  be 0 (the delta > 0 assert is for the ragged-K case only); A's rows start at
  A + offs[g-1] * lda, so lda (Hd, I) times 2 bytes must be a multiple of 16 (the host checks
  Hd % 8 == 0 and I % 8 == 0), and data pointers 16-byte aligned (fresh allocations are).
- B may be the transposed view of our [E, N, K] weights (stride 1 on dim 1): the column-major
  B variant, no copy.
- the output is torch.empty_strided: rows past offs[-1] are never written (garbage, not zero).
  Nothing reads them here: steps 3-5 stop at offs[E-1].
- tile: CUTLASS 128x256x64 cooperative when rows / groups > 128 (ours: T*k / E, e.g. 1,820 at
  8,192 tokens on 36 experts), 64x128x128 ping-pong otherwise.
Block-FP8 weights have no grouped path here: torch._scaled_grouped_mm takes row-wise float32
scales (sm90) or MX e8m0 block scales (sm100, fbgemm), not 128x128 blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# rows of the sorted pairs per program of the gather and SwiGLU passes
ROWS = 8


@triton.jit
def _gather_kernel(
    x_ptr,
    token_of_row_ptr,
    offs_ptr,
    out_ptr,
    HD: tl.constexpr,
    E: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[r] = x[token_of_row[r]] for the local rows r < offs[E-1]; programs past it exit."""
    count = tl.load(offs_ptr + E - 1)
    r0 = tl.program_id(0) * ROWS
    if r0 >= count:
        return
    rows = r0 + tl.arange(0, ROWS)
    live = rows < count
    tok = tl.load(token_of_row_ptr + rows, mask=live, other=0).to(tl.int64)
    for c0 in range(0, HD, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = live[:, None] & (cols < HD)[None, :]
        v = tl.load(x_ptr + tok[:, None] * HD + cols[None, :], mask=mask)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * HD + cols[None, :], v, mask=mask)


@triton.jit
def _swiglu_kernel(
    gu_ptr,  # [rows, 2 * INTER]: gate columns, then up columns; row stride GU_STRIDE
    h_ptr,  # [rows, INTER]
    offs_ptr,
    limit,
    GU_STRIDE: tl.constexpr,
    INTER: tl.constexpr,
    E: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """kernels.moe.swiglu over the local rows, fp32 math; rows past offs[E-1] hold garbage
    (never written by the grouped GEMM) and are neither read nor written."""
    count = tl.load(offs_ptr + E - 1)
    r0 = tl.program_id(0) * ROWS
    if r0 >= count:
        return
    rows = r0 + tl.arange(0, ROWS)
    live = rows < count
    gu_rows = gu_ptr + rows[:, None].to(tl.int64) * GU_STRIDE
    h_rows = h_ptr + rows[:, None].to(tl.int64) * INTER
    for c0 in range(0, INTER, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = live[:, None] & (cols < INTER)[None, :]
        gate = tl.load(gu_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gu_rows + INTER + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        h = gate * tl.sigmoid(gate) * up
        tl.store(h_rows + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _combine_kernel(
    y_ptr,  # [rows, HD] expert outputs (already weighted unless WEIGHTED); row stride Y_STRIDE
    row_of_pair_ptr,  # [T * TOPK] int32: sorted row of each pair
    weight_ptr,  # [T * TOPK] float32; unread unless WEIGHTED
    offs_ptr,
    out_ptr,
    Y_STRIDE: tl.constexpr,
    HD: tl.constexpr,
    TOPK: tl.constexpr,
    E: tl.constexpr,
    BLOCK: tl.constexpr,
    WEIGHTED: tl.constexpr,
):
    """out[t] = sum_j weight[t*k+j] * y[row_of_pair[t*k+j]] in fp32 over j in order (without
    the weight when not WEIGHTED: y holds weighted rows); a pair whose row is at or past
    offs[E-1] (id E: another rank's expert) adds nothing."""
    count = tl.load(offs_ptr + E - 1)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < HD
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        row = tl.load(row_of_pair_ptr + t * TOPK + j)
        y = tl.load(
            y_ptr + row.to(tl.int64) * Y_STRIDE + cols, mask=mask & (row < count), other=0.0
        )
        if WEIGHTED:
            acc += tl.load(weight_ptr + t * TOPK + j) * y.to(tl.float32)
        else:
            acc += y.to(tl.float32)
    tl.store(out_ptr + t * HD + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sort_pairs(ids: torch.Tensor, num_experts: int):
    """(token of each sorted row [T*k] int32, sorted row of each pair [T*k] int32, offs [E]
    int32: cumulative pair counts per expert). Sync-free; ids equal to E sort last, at rows
    offs[E-1] and beyond."""
    top_k = ids.shape[1]
    # int32 keys: half the radix passes of int64
    flat = ids.reshape(-1).clamp(max=num_experts).to(torch.int32)
    n = flat.numel()
    dev = flat.device
    keys, order = torch.sort(flat, stable=True)
    ends = torch.arange(1, num_experts + 1, dtype=torch.int32, device=dev)
    offs = torch.searchsorted(keys, ends, out_int32=True)  # pairs with id < e + 1
    token_of_row = (order // top_k).to(torch.int32)
    row_of_pair = torch.empty(n, dtype=torch.int32, device=dev)
    row_of_pair.scatter_(0, order, torch.arange(n, dtype=torch.int32, device=dev))
    return token_of_row, row_of_pair, offs


def gather_rows(x: torch.Tensor, token_of_row: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    n, hidden = token_of_row.numel(), x.shape[1]
    out = torch.empty(n, hidden, device=x.device, dtype=x.dtype)
    block = min(1024, triton.next_power_of_2(hidden))
    _gather_kernel[(triton.cdiv(n, ROWS),)](
        x, token_of_row, offs, out, HD=hidden, E=offs.numel(), ROWS=ROWS, BLOCK=block, num_warps=4
    )
    return out


def swiglu_rows(gate_up: torch.Tensor, offs: torch.Tensor, limit: float) -> torch.Tensor:
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    h = torch.empty(n, inter, device=gate_up.device, dtype=gate_up.dtype)
    block = min(1024, triton.next_power_of_2(inter))
    _swiglu_kernel[(triton.cdiv(n, ROWS),)](
        gate_up,
        h,
        offs,
        float(limit),
        GU_STRIDE=gate_up.stride(0),
        INTER=inter,
        E=offs.numel(),
        ROWS=ROWS,
        BLOCK=block,
        num_warps=4,
    )
    return h


def combine(
    y: torch.Tensor,
    row_of_pair: torch.Tensor,
    weights: torch.Tensor | None,
    offs: torch.Tensor,
    dtype,
    top_k: int | None = None,
) -> torch.Tensor:
    """[T, Hd] in dtype: each token's k rows of y (row_of_pair) summed in a fixed order, times
    their routing weights unless weights is None (then top_k says k); rows at or past offs[-1]
    add nothing."""
    top_k = weights.shape[1] if weights is not None else top_k
    tokens = row_of_pair.numel() // top_k
    hidden = y.shape[1]
    out = torch.empty(tokens, hidden, device=y.device, dtype=dtype)
    block = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(tokens, triton.cdiv(hidden, block))](
        y,
        row_of_pair,
        offs if weights is None else weights.contiguous().float().reshape(-1),
        offs,
        out,
        Y_STRIDE=y.stride(0),
        HD=hidden,
        TOPK=top_k,
        E=offs.numel(),
        BLOCK=block,
        WEIGHTED=weights is not None,
        num_warps=4,
    )
    return out


def experts_grouped(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """x: [T, Hd]; w13: [E, 2I, Hd] (gate rows then up rows); w2: [E, Hd, I];
    weights [T, k] float32; ids [T, k] int64.

    Returns sum_k weights[t,k] * expert_{ids[t,k]}(x[t]), shape [T, Hd], in x's dtype, as
    kernels.moe.experts: ids equal to E add nothing and cost nothing. On CUDA x and the weights
    must be bf16 (other dtypes make torch._grouped_mm sync with the host).

    Buffers are sized for all T*k pairs (the local count is on the device only): at 8,192
    tokens, top-8, Hd 4096, I 2048 that is 2 GiB of bf16 scratch, as the fused path's.
    """
    tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    if hidden % 8 or inter % 8 or num_experts >= 1024:
        raise ValueError(f"grouped GEMM needs Hd, I multiples of 8 and E < 1024: {w13.shape}")
    if tokens == 0:
        return torch.empty_like(x)
    token_of_row, row_of_pair, offs = sort_pairs(ids, num_experts)
    xs = gather_rows(x.contiguous(), token_of_row, offs)
    gate_up = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
    h = swiglu_rows(gate_up, offs, limit)
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
    return combine(y, row_of_pair, weights, offs, x.dtype)

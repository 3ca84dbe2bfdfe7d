"""Block-FP8 W8A8 linears in Triton: same signatures and results as kernels/fp8.py.

quantize_act: one program per token and up to GROUPS groups of 128 channels; the scale is
amax / 448 and the values x * (448 / amax) are rounded to nearest-even on the e4m3 grid by hand
(_round_e4m3) before the cast, so the bits equal the torch reference's on the GPU and under
TRITON_INTERPRET=1 alike (the interpreter's own fp32 -> fp8 cast truncates).

block_fp8_linear: quantize_act, then one GEMM program per [BLOCK_M, BLOCK_N] output tile; each
K step of BLOCK_K (<= 128, dividing 128, so a step never straddles a scale group) multiplies
e4m3 tiles on the tensor cores and adds dot * a_scale[m] * w_scale[n // 128] to an fp32
accumulator (the per-group promotion that keeps FP8 accumulation error bounded). No host sync;
tile sizes are host-side functions of the shapes, so the path is capturable in CUDA graphs.
M, N and K are run-time arguments: one compiled kernel per tile configuration, not per shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8 import AMAX_FLOOR, BLOCK, FP8, FP8_MAX, blocks

# Programs the small-M GEMM heuristic aims at: about two per SM on an H200 (132 SMs).
TARGET_PROGRAMS = 264
AMAX_FLOOR_C = tl.constexpr(AMAX_FLOOR)
FP8_MAX_C = tl.constexpr(FP8_MAX)


@triton.jit
def _round_e4m3(q):
    """q (fp32, |q| <= 448) rounded to nearest-even on the e4m3 grid: 3 mantissa bits, steps
    of 2^(e-3) for exponent e >= -6 and 2^-9 below (subnormals). Exact in fp32."""
    bits = q.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2^(e-3)
    inv = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2^(3-e)
    r = q * inv
    r = (r + 12582912.0) - 12582912.0  # 1.5 * 2^23: round to nearest-even integer
    return r * step


@triton.jit
def _quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K: tl.constexpr,
    KB: tl.constexpr,
    GROUPS: tl.constexpr,
    GROUP: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    c = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = (g[:, None] < KB) & (c < K)
    x = tl.load(x_ptr + t * K + c, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), AMAX_FLOOR_C)
    inv = tl.math.div_rn(tl.full([GROUPS], FP8_MAX_C, tl.float32), amax)
    q = tl.minimum(tl.maximum(x * inv[:, None], -FP8_MAX_C), FP8_MAX_C)
    tl.store(q_ptr + t * K + c, _round_e4m3(q).to(q_ptr.dtype.element_ty), mask=mask)
    scale = tl.math.div_rn(amax, tl.full([GROUPS], FP8_MAX_C, tl.float32))
    tl.store(s_ptr + t * KB + g, scale, mask=g < KB)


def quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, per group of 128 channels: (x8 [T, K] float8_e4m3fn, scales [T, ceil(K/128)]
    float32), as kernels.fp8.quantize_act."""
    tokens, k = x.shape
    kb = blocks(k)
    x = x.contiguous()
    q = torch.empty(tokens, k, device=x.device, dtype=FP8)
    s = torch.empty(tokens, kb, device=x.device, dtype=torch.float32)
    if tokens == 0:
        return q, s
    groups = min(8, triton.next_power_of_2(kb))
    _quant_kernel[(tokens, triton.cdiv(kb, groups))](
        x, q, s, K=k, KB=kb, GROUPS=groups, GROUP=BLOCK, num_warps=4 if groups > 2 else 1
    )
    return q, s


@triton.jit
def _gemm_kernel(
    a_ptr,  # [M, K] e4m3
    as_ptr,  # [M, KB] float32
    b_ptr,  # [N, K] e4m3 (the weight)
    bs_ptr,  # [NB, KB] float32
    c_ptr,  # [M, N]
    M,
    N,
    K,
    KB,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    # grouped ordering: GROUP_M row tiles share each weight tile while it is in L2
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m

    m_offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_offs = tl.arange(0, BLOCK_K)
    m_mask = m_offs < M
    n_mask = n_offs < N
    # int32 tile offsets (the host checks every buffer fits): fewer registers than int64
    m_safe = tl.where(m_mask, m_offs, 0)
    n_safe = tl.where(n_mask, n_offs, 0)
    a_ptrs = a_ptr + m_safe[:, None] * K + k_offs[None, :]
    b_ptrs = b_ptr + n_safe[None, :] * K + k_offs[:, None]
    as_ptrs = as_ptr + m_safe * KB
    bs_ptrs = bs_ptr + (n_safe // GROUP) * KB
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # rows past M and columns past N read row / column 0 (never stored): no mask needed
        if EVEN_K:
            a = tl.load(a_ptrs + k0)
            b = tl.load(b_ptrs + k0)
        else:
            k_mask = (k0 + k_offs) < K
            a = tl.load(a_ptrs + k0, mask=k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs + k0, mask=k_mask[:, None], other=0.0)
        a_s = tl.load(as_ptrs + k0 // GROUP)
        b_s = tl.load(bs_ptrs + k0 // GROUP)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    c_ptrs = c_ptr + m_offs[:, None] * N + n_offs[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def gemm_config(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for an H200 (host ints only)."""
    block_k = max(32, min(BLOCK, triton.next_power_of_2(k)))  # e4m3 dots take K >= 32
    if m <= 16:
        block_m, block_n, warps, stages = 16, 128, 4, 4
    elif m <= 64:
        block_m, block_n, warps, stages = 64, 128, 4, 4
    else:
        block_m, block_n, warps, stages = 128, 128, 8, 3
    if m <= 64:
        # few row tiles (decode): narrow the N tiles until the grid covers the SMs about twice
        while block_n > 32 and triton.cdiv(m, block_m) * triton.cdiv(n, block_n) < TARGET_PROGRAMS:
            block_n //= 2
    block_n = max(16, min(block_n, triton.next_power_of_2(n)))
    return block_m, block_n, block_k, warps, stages


def block_fp8_linear(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y = x W^T, W in block FP8, x quantized per token group (W8A8); as
    kernels.fp8.block_fp8_linear. x [..., in], w8 [out, in], scale [ceil(out/128),
    ceil(in/128)] float32; returns [..., out] in x's dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        return torch.empty(*lead, w8.shape[0], device=x.device, dtype=x.dtype)
    x8, xs = quantize_act(x2)
    return fp8_gemm(x8, xs, w8, scale, x.dtype).view(*lead, w8.shape[0])


def fp8_gemm(
    x8: torch.Tensor, xs: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The block-scaled GEMM alone: x8 [M, K] e4m3 with scales xs [M, ceil(K/128)] times
    w8 [N, K]^T with block scales; [M, N] in dtype."""
    (m, k), n = x8.shape, w8.shape[0]
    assert max(m, n) * k < 2**31 and m * n < 2**31, "FP8 GEMM buffers exceed int32 offsets"
    y = torch.empty(m, n, device=x8.device, dtype=dtype)
    block_m, block_n, block_k, warps, stages = gemm_config(m, n, k)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _gemm_kernel[grid](
        x8,
        xs,
        w8,
        scale,
        y,
        m,
        n,
        k,
        blocks(k),
        GROUP=BLOCK,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=8,
        EVEN_K=k % block_k == 0,
        num_warps=warps,
        num_stages=stages,
    )
    return y

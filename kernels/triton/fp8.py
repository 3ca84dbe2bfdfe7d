"""Block-FP8 W8A8 linears on CUDA: same signatures and results as kernels/fp8.py.

quantize_act: one program per token and up to GROUPS groups of 128 channels, quantized by
kernels/triton/e4m3.py (IEEE quotients, e4m3 rounding by hand), so the bits equal the torch
reference's on the GPU and under TRITON_INTERPRET=1 alike. The scales are written token-major
([T, KB], for the Triton kernels) or group-major (stride (1, T), what torch._scaled_mm takes).
Launched with PDL (kernels/triton/pdl.py; it begins with grid_dependency()).

block_fp8_linear runs at most SKINNY_MAX_TOKENS token rows (decode, verify) on quantize_act and
the skinny GEMM reading its output (kernels/triton/skinny_gemm.py: the weight streamed by split-K
programs), and more on one of two GEMMs per weight shape:
- torch._scaled_mm with 1x128 activation and 128x128 weight block scales (cuBLASLt's
  DeepSeek-style scaling: SM90, cuBLASLt >= 12.9, PyTorch >= 2.9; N and K multiples of 16). It
  is probed once per (N, K, dtype, device), at load (linear_backends, which the loader logs) or
  at the first eager call: a shape it refuses, or whose result disagrees with the Triton GEMM,
  stays on Triton. Never probed during graph capture (Triton is used then).
- the Triton GEMM, one program per [BLOCK_M, BLOCK_N] output tile; each K step of BLOCK_K
  (<= 128, dividing 128, so a step never straddles a scale group) multiplies e4m3 tiles on the
  tensor cores and adds dot * a_scale[m] * w_scale[n // 128] to an fp32 accumulator (the
  per-group promotion that keeps FP8 accumulation error bounded). Called from a bf16/fp32 x it
  quantizes each A tile in its K loop with the same code as quantize_act (QUANT_A: one launch,
  no quantized copy of x; bit-equal by construction).
No host sync; tile sizes and the backend are host-side functions of the shapes, so the path is
capturable in CUDA graphs. M, N and K are run-time arguments of the Triton GEMM: one compiled
kernel per tile configuration, not per shape.

time_linear measures one weight shape, FP8 (block_fp8_linear as above) against the dense
linear a bf16 weight runs (cuBLAS), as device time under a CUDA graph: what
serving/models/fp8_choice.py decides from at load.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from kernels.fp8 import BLOCK, FP8, blocks, quantize_weight
from kernels.triton.e4m3 import quant_rows
from kernels.triton.pdl import LAUNCH, grid_dependency
from kernels.triton.skinny_gemm import skinny_linear

log = logging.getLogger(__name__)

# token rows up to which block_fp8_linear runs quantize_act + the skinny GEMM (two launches).
# H100, bench.decode_gemm at rank 0 of TP8 (2026-12-07, 12 shapes): against quantize_act +
# torch._scaled_mm it wins every shape at 1 and 2 rows (KDA in_proj 13.5 against 19.1 us), 10 of
# 12 at 8, 3 of 12 at 32. The skinny GEMM quantizing x's tile in every program's K loop instead
# (one launch) took 1.1-2x as long at every shape and count (KDA in_proj 26.3 us at 1 row): gone
SKINNY_MAX_TOKENS = 8

# Programs the small-M GEMM heuristic aims at: about two per SM on an H200 (132 SMs).
TARGET_PROGRAMS = 264
# pipelined A and B tiles' shared memory (the rest of the 227 KiB: Triton's own scratch)
SMEM_TILE_BUDGET = 160 * 1024
SCALED_MM_ROWS = 4  # cuBLASLt's 1x128 activation scales take token counts in multiples of this


@triton.jit
def _quant_kernel(
    x_ptr,  # [T, K], row stride stride_xt, unit column stride
    q_ptr,
    s_ptr,
    stride_xt,
    stride_st,
    stride_sg,
    K: tl.constexpr,
    KB: tl.constexpr,
    GROUPS: tl.constexpr,
    GROUP: tl.constexpr,
):
    grid_dependency()
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    c = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = (g[:, None] < KB) & (c < K)
    x = tl.load(x_ptr + t * stride_xt + c, mask=mask, other=0.0).to(tl.float32)
    q, scale = quant_rows(x)
    tl.store(q_ptr + t * K + c, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + t * stride_st + g * stride_sg, scale, mask=g < KB)


def quantize_act(x: torch.Tensor, group_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, per group of 128 channels: (x8 [T, K] float8_e4m3fn, scales [T, ceil(K/128)]
    float32), as kernels.fp8.quantize_act. group_major: the scales' strides are (1, T), the
    outer-dim-major layout torch._scaled_mm takes for 1x128 scales. x may have a row stride (a
    column slice of a stacked projection's output): no copy."""
    tokens, k = x.shape
    kb = blocks(k)
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = torch.empty(tokens, k, device=x.device, dtype=FP8)
    if group_major:
        s = torch.empty(kb, tokens, device=x.device, dtype=torch.float32).t()
    else:
        s = torch.empty(tokens, kb, device=x.device, dtype=torch.float32)
    if tokens == 0:
        return q, s
    groups = min(8, triton.next_power_of_2(kb))
    _quant_kernel[(tokens, triton.cdiv(kb, groups))](
        x,
        q,
        s,
        x.stride(0),
        s.stride(0),
        s.stride(1),
        K=k,
        KB=kb,
        GROUPS=groups,
        GROUP=BLOCK,
        num_warps=4 if groups > 2 else 1,
        **LAUNCH,
    )
    return q, s


@triton.jit
def _gemm_kernel(
    a_ptr,  # [M, K]: e4m3, or (QUANT_A) x in bf16/fp16/fp32
    as_ptr,  # [M, KB] float32, strides (stride_asm, stride_asg); unused under QUANT_A
    b_ptr,  # [N, K] e4m3 (the weight)
    bs_ptr,  # [NB, KB] float32
    c_ptr,  # [M, N]
    M,
    N,
    K,
    KB,
    stride_asm,
    stride_asg,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    QUANT_A: tl.constexpr,
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
    as_ptrs = as_ptr + m_safe * stride_asm
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
        if QUANT_A:  # BLOCK_K covers the whole group (the host sets it so): quantize here
            qa, a_s = quant_rows(a.to(tl.float32))
            a = qa.to(b_ptr.dtype.element_ty)  # exact: qa is on the e4m3 grid
        else:
            a_s = tl.load(as_ptrs + (k0 // GROUP) * stride_asg)
        b_s = tl.load(bs_ptrs + k0 // GROUP)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    c_ptrs = c_ptr + m_offs[:, None] * N + n_offs[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def gemm_config(m: int, n: int, k: int, a_bytes: int = 1) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for an H200 (host ints only).
    BLOCK_K is 128 (one scale group; what QUANT_A needs) or, for K < 128, covers K. a_bytes:
    the A tile's element size (1: e4m3; 2 or 4: QUANT_A on bf16 or float32 input).

    Hazard: the pipeline holds num_stages - 1 A and B tiles in shared memory (227 KiB per SM on
    the H200). Float32 input at 128-row tiles and 4 stages asked for 272 KiB and Triton refused
    to launch (OutOfResources, measured); stages drop until the tiles fit SMEM_TILE_BUDGET."""
    block_k = max(32, min(BLOCK, triton.next_power_of_2(k)))  # e4m3 dots take K >= 32
    if m <= 16:
        block_m, block_n, warps, stages = 16, 128, 4, 4
    elif m <= 32:
        block_m, block_n, warps, stages = 32, 128, 4, 4
    elif m <= 128:
        block_m, block_n, warps, stages = 64, 128, 4, 4
    else:  # 32 KiB of e4m3 tiles per stage
        block_m, block_n, warps, stages = 128, 128, 8, 4
    if m <= 128:
        # few row tiles (decode): narrow the N tiles until the grid covers the SMs about twice
        # (no split-K: it would need atomics or a second pass, and lose determinism)
        while block_n > 32 and triton.cdiv(m, block_m) * triton.cdiv(n, block_n) < TARGET_PROGRAMS:
            block_n //= 2
    block_n = max(16, min(block_n, triton.next_power_of_2(n)))
    stage_bytes = block_m * block_k * a_bytes + block_n * block_k
    while stages > 2 and (stages - 1) * stage_bytes > SMEM_TILE_BUDGET:
        stages -= 1
    return block_m, block_n, block_k, warps, stages


def _triton_gemm(
    a: torch.Tensor, a_scale: torch.Tensor | None, w8: torch.Tensor, scale: torch.Tensor, dtype
) -> torch.Tensor:
    """The Triton GEMM: a e4m3 with scales a_scale, or a_scale None: a in bf16/fp16/fp32,
    quantized per tile in the kernel."""
    (m, k), n = a.shape, w8.shape[0]
    assert max(m, n) * k < 2**31 and m * n < 2**31, "FP8 GEMM buffers exceed int32 offsets"
    y = torch.empty(m, n, device=a.device, dtype=dtype)
    block_m, block_n, block_k, warps, stages = gemm_config(m, n, k, a.element_size())
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    quant_a = a_scale is None
    _gemm_kernel[grid](
        a,
        a if quant_a else a_scale,
        w8,
        scale,
        y,
        m,
        n,
        k,
        blocks(k),
        0 if quant_a else a_scale.stride(0),
        0 if quant_a else a_scale.stride(1),
        GROUP=BLOCK,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=8,
        EVEN_K=k % block_k == 0,
        QUANT_A=quant_a,
        num_warps=warps,
        num_stages=stages,
    )
    return y


def fp8_gemm(
    x8: torch.Tensor, xs: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The block-scaled Triton GEMM alone: x8 [M, K] e4m3 with scales xs [M, ceil(K/128)] (either
    layout) times w8 [N, K]^T with block scales; [M, N] in dtype."""
    return _triton_gemm(x8, xs, w8, scale, dtype)


def scaled_mm_gemm(
    x8: torch.Tensor, xs: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The same GEMM through torch._scaled_mm (cuBLASLt): xs group-major (quantize_act(...,
    group_major=True)); the weight [N, K] row-major is the column-major [K, N] operand it takes,
    and its scales [NB, KB] transposed are the 128x128 scales of that operand."""
    return torch._scaled_mm(x8, w8.t(), scale_a=xs, scale_b=scale.t(), out_dtype=dtype)


def block_fp8_linear_triton(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor):
    """block_fp8_linear on the Triton GEMM with the quantization fused (x 2-D)."""
    return _triton_gemm(x.contiguous(), None, w8, scale, x.dtype)


def block_fp8_linear_scaled_mm(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor):
    """block_fp8_linear on torch._scaled_mm (x 2-D): quantize_act, then cuBLASLt.

    Hazard: cuBLASLt refuses 1x128 activation scales unless the token count is a multiple of 4
    (CUBLAS_STATUS_NOT_SUPPORTED at 1, 2, 33, 4095 tokens on the H200, cuBLAS 13.0; their
    column-major leading dimension must be 16-byte aligned), so x gets zero rows up to one and
    the output drops them (rows are independent)."""
    m = x.shape[0]
    if m % SCALED_MM_ROWS:
        x = torch.nn.functional.pad(x, (0, 0, 0, SCALED_MM_ROWS - m % SCALED_MM_ROWS))
    x8, xs = quantize_act(x, group_major=True)
    return scaled_mm_gemm(x8, xs, w8, scale, x.dtype)[:m]


def block_fp8_linear(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y = x W^T, W in block FP8, x quantized per token group (W8A8); as
    kernels.fp8.block_fp8_linear. x [..., in], w8 [out, in], scale [ceil(out/128),
    ceil(in/128)] float32; returns [..., out] in x's dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    n = w8.shape[0]
    x2 = x.reshape(-1, k)  # x may be a column slice (StackedProjections' outputs)
    gemm = linear_gemm(x2.shape[0], n, k, x.dtype, x.device)
    if gemm == "skinny":
        y = skinny_linear(x2, w8, scale, x_fp8=quantize_act(x2))  # 0 rows too
    elif gemm == "scaled_mm":
        y = block_fp8_linear_scaled_mm(x2.contiguous(), w8, scale)
    else:
        y = block_fp8_linear_triton(x2.contiguous(), w8, scale)
    return y.view(*lead, n)


def linear_gemm(tokens: int, n: int, k: int, dtype: torch.dtype, device) -> str:
    """The GEMM block_fp8_linear runs for `tokens` rows against an [n, k] weight: "skinny",
    "scaled_mm" or "triton" (host ints; may probe torch._scaled_mm, see scaled_mm_usable)."""
    if tokens <= SKINNY_MAX_TOKENS:
        return "skinny"
    return "scaled_mm" if scaled_mm_usable(n, k, dtype, device) else "triton"


# (N, K, dtype, device) -> whether torch._scaled_mm runs this shape and agrees with Triton
_SCALED_MM_OK: dict[tuple, bool] = {}


def scaled_mm_usable(n: int, k: int, dtype: torch.dtype, device) -> bool:
    """Whether block_fp8_linear sends this weight shape to torch._scaled_mm: probed once, on
    first use outside graph capture (a capture before any eager call gets Triton)."""
    device = torch.device(device)
    if device.type != "cuda":  # the interpreter's CPU tensors
        return False
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (n, k, dtype, device)
    ok = _SCALED_MM_OK.get(key)
    if ok is None:
        if torch.cuda.is_current_stream_capturing():
            return False
        ok = _SCALED_MM_OK[key] = _probe_scaled_mm(n, k, dtype, device)
    return ok


def _probe_scaled_mm(n: int, k: int, dtype: torch.dtype, device: torch.device) -> bool:
    if (
        dtype not in (torch.bfloat16, torch.float16)  # cuBLASLt's block scaling: 16-bit out
        or n % 16
        or k % 16
        or torch.cuda.get_device_capability(device)[0] != 9  # DeepSeek-style scaling: SM90
    ):
        return False
    gen = torch.Generator(device=device).manual_seed(0)
    w8 = (torch.randn(n, k, device=device, generator=gen, dtype=dtype) * 16).clamp(-448, 448)
    w8 = w8.to(FP8)
    scale = torch.rand(blocks(n), blocks(k), device=device, generator=gen) / 64 + 1e-3
    for m in (1, 37):
        x = torch.randn(m, k, device=device, generator=gen, dtype=dtype)
        try:
            out = block_fp8_linear_scaled_mm(x, w8, scale)
        except (RuntimeError, NotImplementedError, ValueError) as e:
            log.info("FP8 linear %dx%d: torch._scaled_mm refused (%s); Triton GEMM", n, k, e)
            return False
        ref = block_fp8_linear_triton(x, w8, scale).float()
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        if not err <= 1e-2:  # one bf16 rounding apart, at most (see the tests)
            log.warning(
                "FP8 linear %dx%d: torch._scaled_mm differs from the Triton GEMM by %.3g "
                "(relative max); Triton GEMM",
                n,
                k,
                err,
            )
            return False
    return True


def linear_backends(shapes, dtype: torch.dtype, device) -> dict[tuple[int, int], str]:
    """The GEMM block_fp8_linear will use per weight shape (N, K) above SKINNY_MAX_TOKENS rows:
    "scaled_mm" or "triton" (probes them now, at load, so no capture meets an unprobed shape)."""
    return {
        (n, k): "scaled_mm" if scaled_mm_usable(n, k, dtype, device) else "triton"
        for n, k in sorted(set(shapes))
    }


# time_linear: each graph rotates through at most this many weight copies, and replays it
# TIMING_REPLAYS times after TIMING_WARMUP (the median replay counts)
TIMING_COPIES = 32
TIMING_WARMUP, TIMING_REPLAYS = 2, 7


def time_linear(n: int, k: int, tokens: int, dtype: torch.dtype, device) -> tuple[float, float]:
    """Device microseconds per call of y = x W^T, x [tokens, k] in `dtype`, for a random weight
    [n, k]: (block_fp8_linear: activation quantization plus the GEMM it picks for this shape and
    token count; cuBLAS on the weight in `dtype`, what a dense projection runs). Each is
    captured in one CUDA graph (no launch overhead, as the decode graphs run) that rotates
    through weight copies (and outputs) adding up to twice the L2 cache, so each call reads its
    operands from HBM as successive layers do; the median of the graph's replays, per call.
    Allocates about 2 x L2 of copies; runs eagerly first (Triton compiles, the torch._scaled_mm
    probe), never under an outer capture."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(n, k, device=device, generator=gen) * k**-0.5
    w8, scale = quantize_weight(w)
    dense = w.to(dtype)
    del w
    x = torch.randn(tokens, k, device=device, generator=gen).to(dtype)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    act = tokens * (n + k) * x.element_size()

    def copies(weight_bytes: int) -> int:
        return max(1, min(TIMING_COPIES, -(-2 * l2 // (weight_bytes + act))))

    fp8_ops = [(w8.clone(), scale.clone()) for _ in range(copies(w8.numel() + scale.numel() * 4))]
    dense_ops = [dense.clone() for _ in range(copies(dense.numel() * dense.element_size()))]
    fp8_us = graph_time_us(lambda op: block_fp8_linear(x, *op), fp8_ops)
    dense_us = graph_time_us(lambda op: torch.nn.functional.linear(x, op), dense_ops)
    return fp8_us, dense_us


def graph_time_us(fn, operands: list, replays: int = TIMING_REPLAYS) -> float:
    """Median device microseconds per fn(op), every call captured in one CUDA graph and
    replayed: no launch overhead, as in the decode graphs. Operands (weight copies) that rotate
    through more bytes than L2 holds are each read from HBM, as successive layers' weights are."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile, probe and allocate outside the capture
        fn(operands[0])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for op in operands:
            fn(op)
    for _ in range(TIMING_WARMUP):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return sorted(times)[len(times) // 2] * 1e3 / len(operands)

"""Triton versions of the vision tower's elementwise references, same signatures and roundings:

- qkv_heads (kernels/vision.py): one launch over (row block, head) from the qkv projection's
  output to q, k, v in one [3, heads, N, hd] tensor, each plane contiguous (the layout
  scaled_dot_product_attention reads without a copy). q and k: per-head RMSNorm in float32,
  rounded to the dtype, scaled with the product rounded to it (kernels.norm.rms_norm), then
  RoPE in float32 from those rounded values, rounded once (kernels.vision.rotate); each head is
  held as its two halves, so rotate_half is a swap of registers. Replaces ~12 launches (float32
  copies, the stack, the RoPE's five, the permutes sdpa made contiguous).
The MLP's clamped SwiGLU is kernels/triton/swiglu.py's (the language model's too).

Against torch only the order of the norm's sum of squares and the exp/rsqrt implementations
differ: float32 results agree to a few ulps, bf16 ones to one bf16 ulp where a float32 value
lands near a rounding boundary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

QKV_ROWS = 32  # rows of one program of _qkv_heads_kernel


@triton.jit
def _norm_rope(src, w_ptr, cos1, cos2, sin1, sin2, m, cols, cmask, eps, HD: tl.constexpr):
    """One head's q or k rows [R, hd] at src (halves [R, hd/2] at src and src + hd/2):
    RMSNorm (rounded, scaled, rounded) then RoPE, in float32, as two halves."""
    dt = src.dtype.element_ty
    x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HD // 2, mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HD + eps)
    w1 = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HD // 2 + cols, mask=cmask, other=0.0).to(tl.float32)
    n1 = (w1[None, :] * (x1 * rstd[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    n2 = (w2[None, :] * (x2 * rstd[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    # rotate: x * cos + (x2, x1) * signed_sin
    return (n1 * cos1 + n2 * sin1).to(dt), (n2 * cos2 + n1 * sin2).to(dt)


@triton.jit
def _qkv_heads_kernel(
    qkv_ptr,
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    n,
    eps,
    HEADS: tl.constexpr,
    HD: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    ROWS: tl.constexpr,
):
    head = tl.program_id(1)
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    cmask = cols < HD // 2
    m = (rows < n)[:, None] & cmask[None, :]
    D: tl.constexpr = HEADS * HD
    table = rows[:, None] * HD + cols[None, :]  # cos / signed_sin [N, hd], float32
    cos1 = tl.load(cos_ptr + table, mask=m, other=0.0)
    cos2 = tl.load(cos_ptr + table + HD // 2, mask=m, other=0.0)
    sin1 = tl.load(sin_ptr + table, mask=m, other=0.0)
    sin2 = tl.load(sin_ptr + table + HD // 2, mask=m, other=0.0)
    src = qkv_ptr + rows[:, None] * (3 * D) + head * HD + cols[None, :]
    plane = n * D  # one of q, k, v: [heads, N, hd]
    dst = out_ptr + head * n * HD + rows[:, None] * HD + cols[None, :]
    q1, q2 = _norm_rope(src, qw_ptr, cos1, cos2, sin1, sin2, m, cols, cmask, eps, HD)
    tl.store(dst, q1, mask=m)
    tl.store(dst + HD // 2, q2, mask=m)
    k1, k2 = _norm_rope(src + D, kw_ptr, cos1, cos2, sin1, sin2, m, cols, cmask, eps, HD)
    tl.store(dst + plane, k1, mask=m)
    tl.store(dst + plane + HD // 2, k2, mask=m)
    tl.store(dst + 2 * plane, tl.load(src + 2 * D, mask=m), mask=m)
    tl.store(dst + 2 * plane + HD // 2, tl.load(src + 2 * D + HD // 2, mask=m), mask=m)


def qkv_heads(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, hd = qkv.shape[0], q_weight.shape[0]
    heads = qkv.shape[1] // (3 * hd)
    assert qkv.is_contiguous() and qkv.shape[1] == 3 * heads * hd and hd % 2 == 0, "qkv"
    assert cos.dtype == signed_sin.dtype == torch.float32, "float32 tables"
    assert cos.shape == signed_sin.shape == (n, hd) and cos.is_contiguous(), "tables"
    assert signed_sin.is_contiguous() and k_weight.shape == (hd,), "tables or weights"
    out = qkv.new_empty(3, heads, n, hd)
    if n:
        _qkv_heads_kernel[(triton.cdiv(n, QKV_ROWS), heads)](
            qkv,
            q_weight,
            k_weight,
            cos,
            signed_sin,
            out,
            n,
            eps,
            HEADS=heads,
            HD=hd,
            BLOCK_HALF=triton.next_power_of_2(hd // 2),
            ROWS=QKV_ROWS,
            num_warps=4,
        )
    q, k, v = out.unbind(0)
    return q, k, v

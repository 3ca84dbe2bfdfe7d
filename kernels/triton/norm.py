"""kernels/norm.py's add_rms_norm in one pass: one program per row reads x and delta once and
writes their sum and its RMSNorm, with the reference's roundings (the sum rounded to the dtype;
the norm in float32 from the rounded sum, rounded to the dtype, then scaled with the product
rounded to it). Only the sum of squares is summed in another order than torch.rms_norm's."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, delta_ptr, w_ptr, sum_ptr, out_ptr, eps, D: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
    delta = tl.load(delta_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
    total = (x + delta).to(dt)
    tl.store(sum_ptr + row * D + offs, total, mask=mask)
    t = total.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(t * t, axis=0) / D + eps)
    normed = (t * rstd).to(dt).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + offs, (w * normed).to(dt), mask=mask)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [..., D] contiguous, one dtype; weight [D] -> (x + delta, its RMSNorm)."""
    d = x.shape[-1]
    assert x.is_contiguous() and delta.is_contiguous() and delta.shape == x.shape, "layout"
    assert delta.dtype == x.dtype and weight.shape == (d,), "dtypes or weight"
    total, out = torch.empty_like(x), torch.empty_like(x)
    rows = x.numel() // d
    if rows:
        block = triton.next_power_of_2(d)
        _add_rms_norm_kernel[(rows,)](
            x,
            delta,
            weight,
            total,
            out,
            eps,
            D=d,
            BLOCK=block,
            num_warps=min(8, max(1, block // 256)),
        )
    return total, out

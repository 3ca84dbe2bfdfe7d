"""kernels/norm.py's rms_norm and add_rms_norm, each one launch (torch's rms_norm with its dtype
casts and the scale is four on CUDA): one program per row reads x (and delta) once and writes
the RMSNorm (and the sum), with the reference's roundings (the sum rounded to the dtype; the
norm in float32 from the rounded input, rounded to the dtype, then scaled with the product
rounded to it). Only the sum of squares is summed in another order than torch.rms_norm's.
Launched with programmatic dependent launch where the GPU has it (kernels/triton/pdl.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.pdl import LAUNCH, grid_dependency


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    delta_ptr,  # ADD: added to x first, the sum stored at sum_ptr (rows of D, contiguous)
    w_ptr,
    sum_ptr,
    out_ptr,
    x_stride,
    out_stride,
    eps,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    dt = out_ptr.dtype.element_ty
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # a weight: before the wait
    grid_dependency()
    t = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        delta = tl.load(delta_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
        total = (t + delta).to(dt)
        tl.store(sum_ptr + row * D + offs, total, mask=mask)
        t = total.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(t * t, axis=0) / D + eps)
    normed = (t * rstd).to(dt).to(tl.float32)
    tl.store(out_ptr + row * out_stride + offs, (w * normed).to(dt), mask=mask)


def _launch(x, delta, weight, total, out, eps: float) -> None:
    rows, d = x.shape
    if rows:
        block = triton.next_power_of_2(d)
        _rms_norm_kernel[(rows,)](
            x, delta, weight, total, out, x.stride(0), out.stride(0), eps, D=d, BLOCK=block,
            ADD=delta is not None, num_warps=min(8, max(1, block // 256)), **LAUNCH,
        )  # fmt: skip


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [N, D] (rows may be strided), weight [D] -> RMSNorm [N, D] in x's dtype, into `out`
    where given (any [N, D] view with unit column stride: a column slice of a wider buffer)."""
    assert weight.shape == (x.shape[1],) and x.stride(1) == 1, "weight or layout"
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    assert out.shape == x.shape and out.stride(1) == 1 and out.dtype == x.dtype, "out"
    _launch(x, None, weight, None, out, eps)
    return out


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [..., D] contiguous, one dtype; weight [D] -> (x + delta, its RMSNorm)."""
    d = x.shape[-1]
    assert x.is_contiguous() and delta.is_contiguous() and delta.shape == x.shape, "layout"
    assert delta.dtype == x.dtype and weight.shape == (d,), "dtypes or weight"
    total, out = torch.empty_like(x), torch.empty_like(x)
    _launch(x.view(-1, d), delta, weight, total, out.view(-1, d), eps)
    return total, out

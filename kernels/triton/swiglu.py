"""kernels/moe.py's swiglu (GLM's clamped SwiGLU) in one launch instead of torch's four (two
clamps, silu, mul): the dense MLPs', past the small-batch MoE the shared expert's, and the vision
tower's MLP. It
rounds where the reference rounds (silu's output to the dtype, then the product), so bf16
outputs match to one ulp where sigmoid's float32 value lands on a rounding boundary."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.pdl import LAUNCH, grid_dependency

BLOCK = 1024


@triton.jit
def _swiglu_kernel(
    gate_ptr, up_ptr, out_ptr, gate_stride, up_stride, inter, limit, BLOCK: tl.constexpr
):
    grid_dependency()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dt = out_ptr.dtype.element_ty
    g = tl.load(gate_ptr + row * gate_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * up_stride + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (silu * u).to(dt), mask=mask)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """gate, up [T, I] (rows may be strided: the two halves of one stacked projection) ->
    silu(min(gate, limit)) * clamp(up, -limit, limit), [T, I] contiguous."""
    assert gate.shape == up.shape and gate.dim() == 2 and gate.dtype == up.dtype, "shapes"
    assert gate.stride(1) == 1 and up.stride(1) == 1, "columns must be contiguous"
    rows, inter = gate.shape
    out = torch.empty((rows, inter), dtype=gate.dtype, device=gate.device)
    if rows and inter:
        grid = (rows, triton.cdiv(inter, BLOCK))
        _swiglu_kernel[grid](
            gate,
            up,
            out,
            gate.stride(0),
            up.stride(0),
            inter,
            float(limit),
            BLOCK=BLOCK,
            num_warps=4,
            **LAUNCH,
        )
    return out

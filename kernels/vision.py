"""The vision tower's attention input: from the qkv projection's output to the q, k, v that
softmax attention reads (serving/models/vision.py's VisionAttention). kernels/triton/vision.py
does it in one launch; the tower's other fused ops are kernels/norm.add_rms_norm and
kernels/moe.swiglu (the same clamped SwiGLU as the experts')."""

from __future__ import annotations

import torch

from kernels.norm import rms_norm


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [N, ..., hd] with cos and signed_sin [N, hd] (VisionTower.rope), in float32,
    back in x's dtype: x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1), written
    as x's halves swapped times sin with its first half negated."""
    xf = x.float()
    half = xf.shape[-1] // 2
    swapped = xf.unflatten(-1, (2, half)).flip(-2).flatten(-2)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
    return torch.addcmul(xf * cos.view(shape), swapped, signed_sin.view(shape)).to(x.dtype)


def qkv_heads(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [N, 3 * heads * hd] (q's heads, then k's, then v's) -> q, k, v [heads, N, hd]: q and
    k RMS-normed per head with their weights [hd] (kernels.norm.rms_norm: rounded to the dtype,
    then scaled in it), then rotated (rotate: float32, rounded to the dtype once); v as it is.
    Views here (the last dim contiguous, which scaled_dot_product_attention takes as they are);
    the Triton version returns slices of one [3, heads, N, hd] tensor."""
    n, hd = qkv.shape[0], q_weight.shape[0]
    q, k, v = qkv.view(n, 3, -1, hd).unbind(1)  # each [N, heads, hd]
    qk = rotate(
        torch.stack((rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)), dim=1),
        cos,
        signed_sin,
    )
    q, k = qk.permute(1, 2, 0, 3).unbind(0)
    return q, k, v.transpose(0, 1)

"""RMSNorm's reference: normalised in float32, rounded to the input's dtype, then scaled (in
that dtype, as the checkpoint's model computes it)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # torch.rms_norm is x * rsqrt(mean(x^2) + eps), one fused kernel on CUDA (four launches
    # here, against eight written out: the vision tower runs four norms a block, 24 blocks).
    normed = torch.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add and the next sublayer's RMSNorm of its result: (x + delta rounded to x's
    dtype, rms_norm of that sum). kernels/triton/norm.py does both in one pass."""
    total = x + delta
    return total, rms_norm(total, weight, eps)

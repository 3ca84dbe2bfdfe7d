"""RMSNorm (computed in float32, scaled in the input's dtype: kernels.norm.rms_norm), and a
residual add fused with the RMSNorm after it; on the fast path each is one Triton launch
(kernels/triton/norm.py)."""

from __future__ import annotations

import torch
from torch import nn

from kernels import fast_path
from kernels import norm as norm_kernels
from serving.layers.linear import param


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = param(dim, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out: where to write it (a [N, D] view with unit column stride, e.g. a column slice
        of a wider buffer), for x [N, D]; x may be any [..., D] without it."""
        if fast_path(x) and x.stride(-1) == 1 and (x.dim() == 2 or x.is_contiguous()):
            from kernels.triton.norm import rms_norm

            flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
            return rms_norm(flat, self.weight, self.eps, out).view(x.shape)
        normed = norm_kernels.rms_norm(x, self.weight, self.eps)
        return normed if out is None else out.copy_(normed)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, norm: RMSNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, norm(x + delta)), in one pass on the fast path."""
    fused = norm_kernels.add_rms_norm
    if fast_path(x):
        from kernels.triton.norm import add_rms_norm as fused
    return fused(x, delta, norm.weight, norm.eps)

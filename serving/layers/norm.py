"""RMSNorm (computed in float32, scaled in the input's dtype: kernels.norm.rms_norm)."""

from __future__ import annotations

import torch
from torch import nn

from kernels.norm import rms_norm
from serving.layers.linear import param


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = param(dim, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

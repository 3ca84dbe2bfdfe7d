"""Parameters and the linear layer: the plug point for tensor-parallel splits.

Parameters are created empty; the checkpoint loader fills every one of them (a parameter it
cannot fill is an error). Names follow the checkpoint so loading is a lookup, not a rename.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T. Under TP: column-parallel (split rows of W) or row-parallel (split columns)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = param(out_features, in_features, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

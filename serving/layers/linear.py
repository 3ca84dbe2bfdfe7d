"""Parameters and the linear layer: the plug point for tensor-parallel splits.

Parameters are created empty; the checkpoint loader fills every one of them (a parameter it
cannot fill is an error). Names follow the checkpoint so loading is a lookup, not a rename.

A parameter that holds only this rank's share of a checkpoint tensor carries `shard`:
(dim of the checkpoint tensor that is split, pieces, this rank's piece). The loader reads just
that slice from the safetensors file. A parameter marked `padded` (the vocabulary rows of embed
and lm_head, serving/distributed.padded_vocab) is longer along that dim than the checkpoint over
all pieces: a piece is ceil(n / pieces) rows, the last pieces end in zero rows the checkpoint
lacks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from serving.distributed import all_gather_last, state, tp_all_reduce


def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def shard(p: nn.Parameter, dim: int, size: int, rank: int) -> nn.Parameter:
    """Mark `p` as piece `rank` of `size` along checkpoint dim `dim` (no-op for size 1)."""
    if size > 1:
        p.shard = (dim, size, rank)  # type: ignore[attr-defined]
    return p


def padded(p: nn.Parameter) -> nn.Parameter:
    """Mark `p` as padded past the checkpoint along its shard dim (zero rows, never read)."""
    p.padded = True  # type: ignore[attr-defined]
    return p


def tp_param(*shape: int, dtype: torch.dtype, dim: int = 0) -> nn.Parameter:
    """A parameter split over the TP ranks along `dim` (shape given unsplit)."""
    s = state()
    local = list(shape)
    local[dim] //= s.tp_size
    return shard(param(*local, dtype=dtype), dim, s.tp_size, s.tp_rank)


class Linear(nn.Module):
    """y = x W^T. Under TP: column-parallel (split rows of W) or row-parallel (split columns).

    split "column": the output is this rank's slice of features (gather=True: all-gathered to
    full width, the vocab-parallel lm_head). split "row": the input is this rank's slice and
    the partial products are summed over the ranks (reduce=False leaves that to the caller, who
    then owns exactly one all-reduce for several partial sums, as MoE does)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        dtype: torch.dtype,
        split: str | None = None,
        reduce: bool = True,
        gather: bool = False,
    ) -> None:
        super().__init__()
        s = state()
        self.split = split if s.tp_size > 1 else None
        self.reduce, self.gather = reduce, gather
        if self.split == "column":
            self.weight = tp_param(out_features, in_features, dtype=dtype, dim=0)
        elif self.split == "row":
            self.weight = tp_param(out_features, in_features, dtype=dtype, dim=1)
        else:
            self.weight = param(out_features, in_features, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.split == "row" and self.reduce:
            return tp_all_reduce(y)
        if self.split == "column" and self.gather:
            return all_gather_last(y)
        return y

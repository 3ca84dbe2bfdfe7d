"""Parameters and the linear layer: the plug point for tensor-parallel splits.

Parameters are created empty; the checkpoint loader fills every one of them (a parameter it
cannot fill is an error). Names follow the checkpoint so loading is a lookup, not a rename.

A parameter that holds only this rank's share of a checkpoint tensor carries `shard`:
(dim of the checkpoint tensor that is split, pieces, this rank's piece). The loader reads just
that slice from the safetensors file. A parameter marked `padded` (the vocabulary rows of embed
and lm_head, serving/distributed.padded_vocab) is longer along that dim than the checkpoint over
all pieces: a piece is ceil(n / pieces) rows, the last pieces end in zero rows the checkpoint
lacks.

Several projections of one input run as one GEMM: serving/layers/stacked_projections.py.

Kernels: a dense weight runs dense_linear: cuBLAS (F.linear, addmm), or on the fast path the skinny
GEMM's GEMV form (kernels/triton/skinny_gemm.py) up to SKINNY_DENSE_MAX_TOKENS rows, 2. Measured at
rank 0 of TP8's shapes (docs/BENCHMARKS.md): one row alone, the GEMV is 1-17% faster than cuBLAS per
shape (H100); in the H200's decode step at batch 1 it takes 56 launches out (cuBLAS's split-K
reductions among them) and ties on time (5.19 ms against 5.16). At 2 rows (EAGLE's verify at batch
1) it wins on some shapes and loses on others, and the step nets a gain (rank 0 cut to 28 layers,
H100: EAGLE's step 4.934 -> 4.786 ms). From 3 rows the skinny GEMM's tl.dot form is 1.1-2.8x slower
than cuBLAS, so cuBLAS keeps them. The Triton kernels take part in programmatic dependent launch;
a cuBLAS launch ends the overlap on both sides. A block-FP8 weight on the fast path
(kernels.fast_path) runs kernels/triton/fp8.block_fp8_linear (the skinny GEMM up to a few rows,
then torch._scaled_mm or Triton); the CPU and PDSERVE_TORCH_KERNELS=1 run kernels/fp8.py.

Block FP8: a module with a `kind` (FP8_KINDS) can hold its weights as float8_e4m3fn beside
float32 block scales `<param>_scale_inv` (hold_fp8, called by the loader before it fills them)
and then runs the W8A8 kernels (kernels/fp8.py; kernels/triton/fp8.py on the fast path). The
scales cover this rank's share: the loader refuses a share that starts inside a 128-block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import fast_path
from kernels import fp8 as fp8_kernels
from serving.config import FP8_KINDS
from serving.distributed import all_gather_last, state, tp_all_reduce

# token rows up to which a dense weight on the fast path runs the skinny GEMM, not cuBLAS (the
# module doc); bench.fast_path --variant times the decode step both ways. Hazard: rows past
# kernels/triton/skinny_gemm.GEMV_MAX_ROWS take its tl.dot form, which loses to cuBLAS, so the
# two move together (set both in a variant)
SKINNY_DENSE_MAX_TOKENS = 2


def dense_linear(x: torch.Tensor, w: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ add, a tensor of the output's shape) for a dense W [N, K]: the skinny GEMM for
    a few rows on the fast path (SKINNY_DENSE_MAX_TOKENS), else one cuBLAS GEMM (addmm with add
    for a 2-D x; add is summed before the output's one rounding either way)."""
    rows = x.numel() // x.shape[-1] if SKINNY_DENSE_MAX_TOKENS and x.shape[-1] else 0
    if (
        0 < rows <= SKINNY_DENSE_MAX_TOKENS
        and fast_path(x)
        and x.dtype == w.dtype
        and w.dtype in (torch.bfloat16, torch.float16)
    ):
        from kernels.triton.skinny_gemm import skinny_linear

        x2 = x.reshape(rows, x.shape[-1])
        add2 = None if add is None else add.reshape(rows, w.shape[0])
        return skinny_linear(x2, w, add=add2).view(*x.shape[:-1], w.shape[0])
    if add is not None and x.dim() == 2:
        return torch.addmm(add, x, w.t())
    y = F.linear(x, w)
    return y if add is None else y + add


def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def shard(p: nn.Parameter, dim: int, size: int, rank: int) -> nn.Parameter:
    """Mark `p` as piece `rank` of `size` along checkpoint dim `dim` (no-op for size 1)."""
    if size > 1:
        p.shard = (dim, size, rank)  # type: ignore[attr-defined]
    return p


def fp8_twin(p: nn.Parameter) -> nn.Parameter:
    """An empty float8_e4m3fn parameter shaped and sharded like `p`."""
    twin = nn.Parameter(torch.empty(p.shape, dtype=fp8_kernels.FP8, device=p.device), False)
    if hasattr(p, "shard"):
        twin.shard = p.shard  # type: ignore[attr-defined]
    return twin


def block_scales(p: nn.Parameter) -> nn.Parameter:
    """Empty float32 block scales of FP8 weight(s) `p` [..., out, in]: [..., ceil(out/128),
    ceil(in/128)] (the loader fills them for this rank's share)."""
    *lead, rows, cols = p.shape
    blocks = fp8_kernels.blocks
    shape = (*lead, blocks(rows), blocks(cols))
    return nn.Parameter(torch.empty(shape, dtype=torch.float32, device=p.device), False)


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
        kind: str | None = None,
    ) -> None:
        super().__init__()
        s = state()
        self.split = split if s.tp_size > 1 else None
        self.reduce, self.gather = reduce, gather
        # kind: FP8_KINDS entry, or None for a weight read as a matrix or kept in bf16 (an FP8
        # checkpoint tensor for it is dequantized at load)
        assert kind is None or kind in FP8_KINDS, kind
        self.kind = kind
        if self.split == "column":
            self.weight = tp_param(out_features, in_features, dtype=dtype, dim=0)
        elif self.split == "row":
            self.weight = tp_param(out_features, in_features, dtype=dtype, dim=1)
        else:
            self.weight = param(out_features, in_features, dtype=dtype)
        self.register_parameter("weight_scale_inv", None)
        # the StackedProjections this projection is a part of (its owner's), if any; typed
        # loosely: stacked_projections.py imports this module (fp8_choice reads it)
        self.stacked_in: object | None = None

    def hold_fp8(self) -> None:
        """Hold the weight in block FP8 (float8_e4m3fn + float32 `weight_scale_inv`)."""
        if self.weight_scale_inv is None:
            self.weight = fp8_twin(self.weight)
            self.weight_scale_inv = block_scales(self.weight)

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ add, a tensor of the output's shape, before any collective: for a dense
        2-D x one GEMM that reads it as its C, not a GEMM and an add)."""
        assert add is None or not (self.split == "row" and self.reduce) and not self.gather
        if self.weight_scale_inv is None:
            y = dense_linear(x, self.weight, add)
        else:
            y = fp8_linear(x)(x, self.weight, self.weight_scale_inv)
            if add is not None:
                y = y + add
        if self.split == "row" and self.reduce:
            return tp_all_reduce(y)
        if self.split == "column" and self.gather:
            return all_gather_last(y)
        return y


def fp8_linear(x: torch.Tensor):
    if fast_path(x):
        from kernels.triton.fp8 import block_fp8_linear

        return block_fp8_linear
    return fp8_kernels.block_fp8_linear

"""Parameters and the linear layer: the plug point for tensor-parallel splits.

Parameters are created empty; the checkpoint loader fills every one of them (a parameter it
cannot fill is an error). Names follow the checkpoint so loading is a lookup, not a rename.

A parameter that holds only this rank's share of a checkpoint tensor carries `shard`:
(dim of the checkpoint tensor that is split, pieces, this rank's piece). The loader reads just
that slice from the safetensors file. A parameter marked `padded` (the vocabulary rows of embed
and lm_head, serving/distributed.padded_vocab) is longer along that dim than the checkpoint over
all pieces: a piece is ceil(n / pieces) rows, the last pieces end in zero rows the checkpoint
lacks.

Stacked projections: several projections of one input (KDA's q/k/v/gates, MLA's and the
indexer's down-projections, gate/up of a dense MLP) run as one GEMM over their weights stacked
(StackedProjections; one per way the parts are held, dense or block FP8), one launch instead
of up to six: at TP8 a decode step is launch-bound.

Block FP8: a module with a `kind` (FP8_KINDS) can hold its weights as float8_e4m3fn beside
float32 block scales `<param>_scale_inv` (hold_fp8, called by the loader before it fills them)
and then runs the W8A8 kernels (kernels/fp8.py; kernels/triton/fp8.py on the fast path). The
scales cover this rank's share: the loader refuses a share that starts inside a 128-block.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kernels import fast_path
from kernels import fp8 as fp8_kernels
from serving.config import FP8_KINDS
from serving.distributed import all_gather_last, state, tp_all_reduce


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

    def hold_fp8(self) -> None:
        """Hold the weight in block FP8 (float8_e4m3fn + float32 `weight_scale_inv`)."""
        if self.weight_scale_inv is None:
            self.weight = fp8_twin(self.weight)
            self.weight_scale_inv = block_scales(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale_inv is not None:
            y = fp8_linear(x)(x, self.weight, self.weight_scale_inv)
        else:
            y = F.linear(x, self.weight)
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


class _Stack(NamedTuple):
    """Parts held alike, stacked: their positions among the outputs, the stacked weight (and
    block scales, FP8), each part's rows, and the first part's own parameter (a stale stack's
    part no longer shares the stacked storage)."""

    index: list[int]
    weight: torch.Tensor
    scale: torch.Tensor | None
    sizes: list[int]
    first: torch.Tensor


class StackedProjections:
    """Projections of one input x, named by their owner's attributes (Linear modules, or plain
    weight parameters applied as x W^T), run as few GEMMs as the way their weights are held
    allows once `stack()` has put them side by side: the parts in the model's dtype in one
    tensor, the block-FP8 parts in another with their block scales (one W8A8 GEMM: the
    activation's quantization is per token and 128-channel group of x, the same for every part;
    every FP8 part but the last has a multiple of 128 rows, so no scale block spans two parts).
    So KDA's six are one GEMM in bf16 or with every projection FP8 (--fp8-linears all), two
    when the timed choice (serving/models/fp8_choice.py) keeps the small ones dense. The parts'
    parameters become views of the stacked tensors, so the checkpoint names, the loader and the
    exporters see the parts unchanged.

    Hazards: a part's storage replaced after stacking (module.to(), a new Parameter) leaves the
    stack stale: `__call__` then runs the parts one by one (each stack's first part's data
    pointer is compared). Training (a part requiring grad under autograd) runs them one by one
    too: the stacked tensor is no leaf. Only parts that need no collective after their GEMM
    stack (no row split, no gather); otherwise nothing stacks.

    Not an nn.Module: it owns no parameters (the owner registers them) and is no submodule."""

    def __init__(self, owner: nn.Module, names: tuple[str, ...]) -> None:
        self.owner, self.names = owner, names
        self.stacks: list[_Stack] = []

    def _part(self, name: str):
        try:
            return self.owner.get_submodule(name)
        except AttributeError:
            return self.owner.get_parameter(name)

    def stack(self) -> bool:
        """Stack the parts' weights, by how they are held (after the weights are final); False
        if nothing stacks (a part needs a collective, or no two parts are held alike)."""
        held = []  # (weight, FP8 block scales or None) per part
        for part in (self._part(n) for n in self.names):
            if isinstance(part, Linear):
                if part.split == "row" or part.gather:
                    return False
                held.append((part.weight, part.weight_scale_inv))
            else:
                held.append((part, None))
        groups: dict[tuple, list[int]] = {}
        for i, (w, scale) in enumerate(held):
            groups.setdefault((scale is not None, w.dtype, w.device), []).append(i)
        stacks = []
        for (fp8, *_), index in groups.items():
            weights = [held[i][0] for i in index]
            straddles = fp8 and any(w.shape[0] % fp8_kernels.BLOCK for w in weights[:-1])
            if len(index) < 2 or straddles:
                continue  # its parts run alone
            scale = _stack([held[i][1] for i in index]) if fp8 else None
            sizes = [w.shape[0] for w in weights]
            stacks.append(_Stack(index, _stack(weights), scale, sizes, weights[0]))
        if not stacks:
            return False
        self.stacks = stacks
        return True

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        stacks = self.stacks
        current = stacks and all(s.first.data_ptr() == s.weight.data_ptr() for s in stacks)
        if current and not (torch.is_grad_enabled() and any(s.first.requires_grad for s in stacks)):
            out: list[torch.Tensor | None] = [None] * len(self.names)
            for s in stacks:
                if s.scale is None:
                    y = F.linear(x, s.weight)
                else:
                    y = fp8_linear(x)(x, s.weight, s.scale)
                for i, piece in zip(s.index, y.split(s.sizes, dim=-1)):
                    out[i] = piece
            for i in [i for i, o in enumerate(out) if o is None]:  # the parts that run alone
                out[i] = self._run(self.names[i], x)
            return tuple(out)  # type: ignore[arg-type]
        return tuple(self._run(name, x) for name in self.names)

    def _run(self, name: str, x: torch.Tensor) -> torch.Tensor:
        part = self._part(name)
        return part(x) if isinstance(part, Linear) else F.linear(x, part)


def _stack(params: list[torch.Tensor]) -> torch.Tensor:
    """The parameters' data concatenated along dim 0; each parameter becomes a view of it."""
    stacked = torch.cat([p.data for p in params])
    offset = 0
    for p in params:
        p.data = stacked[offset : offset + p.shape[0]]
        offset += p.shape[0]
    return stacked


def stack_projections(*models: nn.Module | None) -> None:
    """Stack every StackedProjections of these models (call once their weights are final)."""
    for model in models:
        if model is None:
            continue
        for module in model.modules():
            for value in vars(module).values():
                if isinstance(value, StackedProjections):
                    value.stack()

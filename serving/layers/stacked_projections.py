"""Several projections of one input x (KDA's q/k/v/gates, MLA's and the indexer's
down-projections, gate/up of a dense MLP) run as one GEMM over their weights stacked, one launch
instead of up to six: at TP8 a decode step is launch-bound. Block-FP8 parts stack too, their
scales with them (stack_runs says which runs of parts share a GEMM).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kernels import fp8 as fp8_kernels
from serving.layers.linear import Linear, dense_linear, fp8_linear

# rows of a stacked block-FP8 weight are a multiple of this (zero rows after the parts): the N
# that torch._scaled_mm, its prefill GEMM, takes (KDA's stack ends in an 8-row b_proj at TP8)
FP8_STACK_ROWS = 16


def stack_runs(rows: list[int], fp8: list[bool]) -> list[list[int]]:
    """The GEMMs a StackedProjections runs, as lists of part indices: the dense parts together,
    and the block-FP8 parts in their order, in runs that close after a part whose rows are not a
    multiple of 128. Inside a run every part starts on a scale block boundary, so the parts'
    scales stacked row-block after row-block are the stacked weight's; a part that ends inside
    a block (KDA's 8-row b_proj at TP8, a small model's 64-row q) can only end a run."""
    dense = [i for i, f in enumerate(fp8) if not f]
    runs, run = [dense] if dense else [], []
    for i, f in enumerate(fp8):
        if f:
            run.append(i)
            if rows[i] % fp8_kernels.BLOCK:
                runs.append(run)
                run = []
    return runs + [run] if run else runs


def stacked_rows(rows: list[int], fp8: bool) -> int:
    """Rows of the weight one run of parts (stack_runs) stacks into: a block-FP8 stack of
    several parts is padded to FP8_STACK_ROWS; one part runs as it is."""
    total = sum(rows)
    if fp8 and len(rows) > 1:
        return -(-total // FP8_STACK_ROWS) * FP8_STACK_ROWS
    return total


@dataclass
class _StackedGemm:
    """One GEMM of a StackedProjections: the parts it covers (indices into names, in order),
    their rows, the stacked weight (padding rows at the end) and, for block FP8, its scales."""

    parts: list[int]
    sizes: list[int]
    weight: torch.Tensor
    scale: torch.Tensor | None
    first: nn.Parameter  # the first part's weight parameter, a view at the stack's start


class StackedProjections:
    """Projections of one input x, named by their owner's attributes (Linear modules, or plain
    weight parameters applied as x W^T), run as one GEMM per run of parts (stack_runs: the dense
    parts, and the block-FP8 ones) once `stack()` has put their weights side by side in one
    tensor per run (FP8: the scales too). The parts' parameters become views of those tensors,
    so the checkpoint names, the loader and the exporters see the parts unchanged.

    Hazards: a part's storage replaced after stacking (module.to(), a new Parameter) leaves a
    stack stale: `__call__` then runs its parts one by one (the first part's data pointer is
    compared). Training (a part requiring grad under autograd) runs them one by one too: the
    stacked tensor is no leaf. Parts that need a collective after their GEMM (a row split, a
    gather) stack nothing. Dense parts of different dtypes do not stack.

    serving/models/fp8_choice.py times an FP8 part at the shape of its run (fp8_rows), which is
    what runs; the owner's parts know their stack (Linear.stacked_in) for that.

    Not an nn.Module: it owns no parameters (the owner registers them) and is no submodule."""

    def __init__(self, owner: nn.Module, names: tuple[str, ...]) -> None:
        self.owner, self.names = owner, names
        self.gemms: list[_StackedGemm] = []
        for name in names:
            part = self._part(name)
            if isinstance(part, Linear):
                part.stacked_in = self

    def _part(self, name: str):
        try:
            return self.owner.get_submodule(name)
        except AttributeError:
            return self.owner.get_parameter(name)

    def _parts(self) -> list:
        return [self._part(n) for n in self.names]

    def fp8_rows(self, part: Linear, fp8: Callable[[Linear], bool]) -> int:
        """Rows of the weight `part` runs in once stacked, where fp8(p) says whether part p holds
        block FP8 (before the load holds them: which will)."""
        parts = self._parts()
        flags = [isinstance(p, Linear) and fp8(p) for p in parts]
        rows = [_weight(p).shape[0] for p in parts]
        i = next(j for j, p in enumerate(parts) if p is part)
        run = next(r for r in stack_runs(rows, flags) if i in r)
        return stacked_rows([rows[j] for j in run], flags[i])

    def stack(self) -> bool:
        """Stack the parts' weights (after the weights are final); False if no GEMM covers more
        than one part."""
        parts = self._parts()
        if any(isinstance(p, Linear) and (p.split == "row" or p.gather) for p in parts):
            return False
        weights = [_weight(p) for p in parts]
        scales = [p.weight_scale_inv if isinstance(p, Linear) else None for p in parts]
        gemms = []
        for run in stack_runs([w.shape[0] for w in weights], [s is not None for s in scales]):
            ws = [weights[i] for i in run]
            if len(run) < 2 or any(w.dtype != ws[0].dtype or w.device != ws[0].device for w in ws):
                continue
            sizes, fp8 = [w.shape[0] for w in ws], scales[run[0]] is not None
            stacked = _cat_rows([w.data for w in ws], stacked_rows(sizes, fp8))
            offset = 0
            for w in ws:
                w.data = stacked[offset : offset + w.shape[0]]
                offset += w.shape[0]
            scale = None
            if fp8:
                ss = [scales[i] for i in run]
                scale = torch.cat([s.data for s in ss])
                offset = 0
                for s in ss:
                    s.data = scale[offset : offset + s.shape[0]]
                    offset += s.shape[0]
            gemms.append(_StackedGemm(run, sizes, stacked, scale, ws[0]))
        self.gemms = gemms
        return bool(gemms)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out: list[torch.Tensor | None] = [None] * len(self.names)
        for g in self.gemms:
            if g.first.data_ptr() != g.weight.data_ptr():
                continue  # stale: its parts run one by one
            if torch.is_grad_enabled() and g.first.requires_grad:
                continue
            if g.scale is None:
                y = dense_linear(x, g.weight)
            else:
                y = fp8_linear(x)(x, g.weight, g.scale)
            pieces = y.split([*g.sizes, g.weight.shape[0] - sum(g.sizes)], dim=-1)
            for i, piece in zip(g.parts, pieces):
                out[i] = piece
        for i, name in enumerate(self.names):
            if out[i] is None:
                part = self._part(name)
                out[i] = part(x) if isinstance(part, Linear) else dense_linear(x, part)
        return tuple(out)


def _weight(part) -> nn.Parameter:
    return part.weight if isinstance(part, Linear) else part


def _cat_rows(weights: list[torch.Tensor], rows: int) -> torch.Tensor:
    """The weights [r_i, K] one after another in a new [rows, K] tensor, zero rows after them.
    FP8 goes through its bytes (uint8): concatenating and zero-filling need no float8 kernels."""
    dtype = weights[0].dtype
    raw = dtype == fp8_kernels.FP8
    parts = [w.view(torch.uint8) if raw else w for w in weights]
    pad = rows - sum(w.shape[0] for w in weights)
    if pad:
        parts.append(parts[0].new_zeros(pad, parts[0].shape[1]))
    stacked = torch.cat(parts)
    return stacked.view(dtype) if raw else stacked


def stack_projections(*models: nn.Module | None) -> None:
    """Stack every StackedProjections of these models (call once their weights are final)."""
    for model in models:
        if model is None:
            continue
        for module in model.modules():
            for value in vars(module).values():
                if isinstance(value, StackedProjections):
                    value.stack()

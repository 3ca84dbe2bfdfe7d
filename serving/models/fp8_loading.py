"""Block-FP8 checkpoint tensors at load (serving/models/fp8_weights.py reads what the header
says): which modules hold their FP8 tensors as they are (and `hold_fp8` on them, but the
projections fp8_choice sends to the dense path), this rank's scale blocks of every FP8 weight,
and the weights of everything else dequantized once."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open

from kernels.fp8 import dequantize
from serving.config import ModelConfig
from serving.distributed import ParallelState
from serving.layers.stacked_projections import StackedProjections
from serving.models.fp8_choice import LinearChoice, choose_linears, linear_shape
from serving.models.fp8_weights import (
    SCALE_SUFFIX,
    ScaleSlice,
    TensorInfo,
    check_holdable,
    scale_slice,
)
from serving.models.weight_names import Target, map_name

log = logging.getLogger(__name__)


def fp8_modules(
    modules: dict[str, torch.nn.Module],
    header: dict[str, TensorInfo] | None,
    fp8: set[str],
    config: ModelConfig,
    load_draft: bool,
    ps: ParallelState,
    keep_bf16: frozenset[str],
) -> list[tuple[str, str, torch.nn.Module]]:
    """(role, path, module) of every module with a `kind` not in keep_bf16 whose checkpoint
    tensors (this rank's) are all FP8; refuses shares whose scale blocks are not their own.
    header None (a config-only FP8 checkpoint: the memory plan, a simulated rank): every module
    with a `kind` not in keep_bf16."""
    tensors: dict[tuple[str, str], list[tuple[str, Target]]] = {}
    for name in header or ():
        if (
            name.endswith(SCALE_SUFFIX)
            or (mapped := map_name(name, config, load_draft, ps)) is None
        ):
            continue
        role, target = mapped
        tensors.setdefault((role, target.param.rpartition(".")[0]), []).append((name, target))
    out = []
    for role, root in modules.items():
        params = dict(root.named_parameters())
        for path, module in root.named_modules():
            kind = getattr(module, "kind", None)
            if kind is None or kind in keep_bf16:
                continue
            if header is not None:
                mine = tensors.get((role, path), [])
                if not mine or any(name not in fp8 for name, _ in mine):
                    continue
                for name, target in mine:
                    shard = getattr(params.get(target.param), "shard", None)
                    check_holdable(name, header[name].shape, shard, kind)
            out.append((role, path, module))
    return out


def hold_fp8_modules(
    selected: list[tuple[str, str, torch.nn.Module]],
    dense_shapes: frozenset[tuple[int, int]] = frozenset(),
) -> None:
    """hold_fp8() on every module fp8_modules() selected but the projections whose weight shape
    is in dense_shapes (fp8_choice: FP8 not faster there)."""
    fp8 = _selected(selected)
    for _, _, module in selected:
        if linear_shape(module, fp8) not in dense_shapes:
            module.hold_fp8()


def _selected(selected: list[tuple[str, str, torch.nn.Module]]):
    """fp8_choice.linear_shape's predicate: the parts of a stack that fp8_modules selected."""
    ids = {id(module) for _, _, module in selected}
    return lambda part: id(part) in ids


def choose_and_hold(
    held: list[tuple[str, str, torch.nn.Module]], dtype: torch.dtype, device, policy: str
) -> LinearChoice:
    """fp8_choice's decision for these modules (fp8_modules' list), then hold_fp8() on each
    but the projections it sends to the dense path."""
    shapes: dict[tuple[int, int], list[str]] = {}
    fp8 = _selected(held)
    for role, path, module in held:
        shape = linear_shape(module, fp8)
        if shape is not None:
            shapes.setdefault(shape, []).append(f"{role}.{path}" if role == "draft" else path)
    choice = choose_linears(shapes, dtype, device, policy)
    hold_fp8_modules(held, choice.dense_shapes)
    return choice


def read_scales(
    files: list[Path],
    header: dict[str, TensorInfo],
    config: ModelConfig,
    load_draft: bool,
    ps: ParallelState,
    params: dict[str, dict[str, torch.nn.Parameter]],
) -> dict[str, tuple[torch.Tensor, ScaleSlice]]:
    """This rank's scale blocks of every FP8 weight it loads, float32, by weight name."""
    out = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if not name.endswith(SCALE_SUFFIX):
                    continue
                weight = name[: -len(SCALE_SUFFIX)]
                mapped = map_name(weight, config, load_draft, ps)
                if mapped is None or (param := params[mapped[0]].get(mapped[1].param)) is None:
                    continue  # skipped on purpose, or the weight's own error comes next
                where = scale_slice(header[weight].shape, getattr(param, "shard", None))
                out[weight] = (f.get_slice(name)[where.index()].float(), where)
    return out


def dequantize_share(w8: torch.Tensor, scale: torch.Tensor, where: ScaleSlice) -> torch.Tensor:
    """float32 weights of a share read with the scale blocks that cover it."""
    if where.dim == 0:
        return dequantize(w8, scale, where.offset)
    return dequantize(w8.T, scale.T, where.offset).T


def log_fp8_linear_backends(roots, dtype: torch.dtype, device) -> None:
    """Decide now (kernels/triton/fp8.py probes each weight shape once) and log which GEMM the
    FP8 linears use above the skinny GEMM's token rows: torch._scaled_mm (cuBLASLt block
    scales) or the Triton GEMM; the parts' shapes and their stacks' (after stack_projections)."""
    from kernels.triton.fp8 import linear_backends

    modules = [m for root in roots if root is not None for m in root.modules()]
    shapes = [
        tuple(m.weight.shape)
        for m in modules
        if getattr(m, "weight_scale_inv", None) is not None and m.weight.dim() == 2
    ]
    for stack in (v for m in modules for v in vars(m).values()):
        if isinstance(stack, StackedProjections):
            shapes += [tuple(g.weight.shape) for g in stack.gemms if g.scale is not None]
    chosen = linear_backends(shapes, dtype, device)
    by_backend: dict[str, list[str]] = {}
    for (n, k), backend in chosen.items():
        by_backend.setdefault(backend, []).append(f"{n}x{k}")
    log.info(
        "FP8 linears (%d weights, %d shapes): %s",
        len(shapes),
        len(chosen),
        "; ".join(f"{b} for {', '.join(s)}" for b, s in sorted(by_backend.items())) or "none",
    )

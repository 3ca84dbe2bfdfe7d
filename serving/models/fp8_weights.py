"""Block-FP8 checkpoint tensors: which are FP8, where a rank's scale blocks are, which modules
hold them.

A checkpoint tensor is FP8 when its dtype is float8_e4m3fn and `<name>_scale_inv` lies beside
it (float32 or float8_e8m0fnu, [ceil(out/128), ceil(in/128)]); every other tensor keeps its own
dtype. Only dtypes count, never names (GLM-5.2's `modules_to_not_convert` misspells one).
Everything here reads safetensors headers only, so every mismatch is an error before a byte of
weights is read.

A rank's share of a weight is rows (or columns) [r*L, (r+1)*L) of n. Its scales are the blocks
that cover those rows. On the dequantizing path (CPU, or a module with no FP8 kernel) any share
works: the first block is offset. A module that holds FP8 (CUDA) needs its share's blocks to be
its own: the share starts on a block boundary, or lies inside one block.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from kernels.fp8 import BLOCK, blocks

FP8_DTYPE = "F8_E4M3"
SCALE_DTYPES = ("F32", "F8_E8M0")
SCALE_SUFFIX = "_scale_inv"


class Fp8CheckpointError(ValueError):
    """An FP8 tensor without its scales, scales that do not fit it, or a share the kernels
    cannot take; the message names the tensor."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, from its JSON header alone."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return {name: TensorInfo(v["dtype"], tuple(v["shape"])) for name, v in header.items()}


def fp8_weights(header: dict[str, TensorInfo]) -> set[str]:
    """Names of the FP8 weights; checks every FP8 tensor has scales of its shape and every
    scale tensor has an FP8 weight."""
    for name, info in header.items():
        if (
            info.dtype.startswith("F8")
            and info.dtype != FP8_DTYPE
            and not name.endswith(SCALE_SUFFIX)
        ):
            raise Fp8CheckpointError(
                f"{name!r}: dtype {info.dtype} is not supported (FP8 weights are "
                f"{FP8_DTYPE}, float8_e4m3fn)"
            )
    found = set()
    for name, info in header.items():
        if name.endswith(SCALE_SUFFIX):
            weight = header.get(name[: -len(SCALE_SUFFIX)])
            if weight is None or weight.dtype != FP8_DTYPE:
                raise Fp8CheckpointError(
                    f"{name!r}: block scales without a float8_e4m3fn tensor "
                    f"{name[: -len(SCALE_SUFFIX)]!r} beside them"
                )
            continue
        if info.dtype != FP8_DTYPE:
            continue
        scale = header.get(name + SCALE_SUFFIX)
        if scale is None:
            raise Fp8CheckpointError(
                f"{name!r} is float8_e4m3fn but has no {name + SCALE_SUFFIX!r} beside it"
            )
        if len(info.shape) != 2:
            raise Fp8CheckpointError(
                f"{name!r}: FP8 tensors must be 2-D weights [out, in], got {info.shape}"
            )
        want = tuple(blocks(n) for n in info.shape)
        if scale.shape != want:
            raise Fp8CheckpointError(
                f"{name + SCALE_SUFFIX!r} has shape {scale.shape}; weight {name!r} "
                f"{info.shape} in 128 x 128 blocks needs {want}"
            )
        if scale.dtype not in SCALE_DTYPES:
            raise Fp8CheckpointError(
                f"{name + SCALE_SUFFIX!r}: dtype {scale.dtype} is not supported "
                f"(scales are {' or '.join(SCALE_DTYPES)})"
            )
        found.add(name)
    return found


@dataclass(frozen=True)
class ScaleSlice:
    """A rank's scale blocks of one weight: blocks [start, stop) along `dim` (the other dim
    whole), and `offset`: rows (columns) of the first block before the share begins."""

    dim: int
    start: int
    stop: int
    offset: int

    def index(self) -> tuple[slice, slice]:
        cut = slice(self.start, self.stop)
        return (cut, slice(None)) if self.dim == 0 else (slice(None), cut)


def scale_slice(shape: tuple[int, ...], shard: tuple[int, int, int] | None) -> ScaleSlice:
    """The blocks of the scales that cover piece `rank` of `size` along `dim` of a weight."""
    if shard is None:
        return ScaleSlice(0, 0, blocks(shape[0]), 0)
    dim, size, rank = shard
    share = shape[dim] // size
    first, last = rank * share, (rank + 1) * share
    return ScaleSlice(dim, first // BLOCK, blocks(last), first % BLOCK)


def check_holdable(name: str, shape: tuple[int, ...], shard, kind: str) -> None:
    """Refuse a share whose blocks are not its own (the FP8 kernels index scales by
    local row // 128)."""
    s = scale_slice(shape, shard)
    if s.offset == 0 or s.stop - s.start == 1:
        return
    dim, size, rank = shard
    share = shape[dim] // size
    raise Fp8CheckpointError(
        f"{name!r} {shape}: rank {rank} of {size} would hold {'rows' if dim == 0 else 'columns'}"
        f" [{rank * share}, {(rank + 1) * share}) of {shape[dim]}, which start inside a "
        f"{BLOCK}-wide scale block; FP8 execution needs each rank's {share} to start on a block "
        f"boundary (a multiple of {BLOCK}) or to lie inside one block. Choose a --tp-size that "
        f"gives such shares, or --fp8-keep-bf16 {kind} (that layer kind dequantized at load)"
    )

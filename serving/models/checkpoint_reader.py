"""A checkpoint's safetensors files (single or sharded, by its index) and this rank's slices
of their tensors, read so that no rank materialises a whole shard."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from serving.distributed import split


class CheckpointError(ValueError):
    """The checkpoint does not match the model config; the message names the tensor."""


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"index lists shards that do not exist: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    return files


# Pages of a memory-mapped shard that reads touched stay in this process's RSS until the file is
# closed, and a column slice (row-parallel weights) touches every page of its tensor. So a shard
# is reopened after each window of this many tensor bytes: a rank's peak host memory is its own
# parameters plus about one window, not plus the whole file. (The header is parsed again per
# window: ~1 ms, 80 times for a 5 GB shard.)
MAPPED_WINDOW = 64 << 20


def iter_slices(model_dir: str | Path) -> Iterator[tuple[str, Callable[..., torch.Tensor]]]:
    """(name, read) per checkpoint tensor; read(shard, padded) returns the whole tensor (shard
    None) or piece `rank` of `size` along `dim` for shard = (dim, size, rank), reading only that
    piece. padded: pieces are ceil(n / size) long and the last ones come back short (or empty),
    where the parameter ends in padding rows. Call each read before asking for the next tensor
    (its file may be closed after)."""
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
        at = 0
        while at < len(names):
            touched = [0]  # bytes of the tensors read through this mapping
            with safe_open(str(path), framework="pt") as f:
                while at < len(names) and touched[0] < MAPPED_WINDOW:
                    name = names[at]
                    at += 1

                    def read(spec, pad=False, f=f, name=name, touched=touched) -> torch.Tensor:
                        if spec is None:
                            t = f.get_tensor(name)
                            touched[0] += t.numel() * t.element_size()
                            return t
                        dim, size, rank = spec
                        sl = f.get_slice(name)
                        shape = sl.get_shape()
                        index = [slice(None)] * len(shape)
                        if pad:
                            share = -(-shape[dim] // size)
                            stop = min((rank + 1) * share, shape[dim])
                            index[dim] = slice(min(rank * share, stop), stop)
                        elif shape[dim] % size:
                            raise CheckpointError(
                                f"{name!r}: dim {dim} of {tuple(shape)} does not split over "
                                f"{size} ranks"
                            )
                        else:
                            index[dim] = split(shape[dim], size, rank)
                        t = sl[tuple(index)]
                        touched[0] += t.numel() * t.element_size() * size
                        return t

                    yield name, read

"""Which bytes a PD handoff moves, and how they are addressed on both sides.

Page buffers (indexed by KV page): every DSA layer's latents and pooled index keys, target and
draft. Page p of a buffer is one contiguous range, so a run of consecutive pages is one write.
Row buffers (indexed by request row): KDA conv and recurrent states, compression tails, aux
(serving/memory/pool.AuxRows: its host-read columns live in host memory, pinned on CUDA, so
decode reads them without a device sync; EAGLE's columns stay on the device). Mooncake writes
between host and device memory alike: a buffer's address is all a write needs.

The layout (names and per-item byte sizes, in order) must be identical on both sides; comparing
it at the handshake catches a page-size, dtype, model or speculative-config mismatch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

import torch

from serving.config import ModelConfig
from serving.memory.pool import MemoryPool

ROW_STATE = ("conv", "state", "tail_keys", "tail_gates")


@dataclass(frozen=True)
class Buffer:
    name: str
    addr: int
    item_bytes: int  # one page (page buffers) or one request row (row buffers)
    items: int

    @property
    def nbytes(self) -> int:
        return self.item_bytes * self.items


def _bytes_per_row(t: torch.Tensor) -> int:
    return t[0].numel() * t.element_size()


def page_buffers(pool: MemoryPool) -> list[Buffer]:
    size = pool.plan.page_size
    out = []
    for prefix, cache in (("target", pool.target), ("draft", pool.draft)):
        if cache is None:
            continue
        for name, t in cache.tensors():
            if name.endswith(".latent"):
                per_page = size
            elif name.endswith(".index_keys"):
                per_page = size // pool.config.index_kpool
            else:
                continue
            item = per_page * _bytes_per_row(t)
            out.append(Buffer(f"{prefix}.{name}", t.data_ptr(), item, t.shape[0] // per_page))
    return out


def row_buffers(pool: MemoryPool) -> list[Buffer]:
    out = []
    for prefix, cache in (("target", pool.target), ("draft", pool.draft)):
        if cache is None:
            continue
        for name, t in cache.tensors():
            if name.split(".")[-1] in ROW_STATE:
                out.append(Buffer(f"{prefix}.{name}", t.data_ptr(), _bytes_per_row(t), t.shape[0]))
    for name, t in pool.aux.tensors():
        out.append(Buffer(name, t.data_ptr(), _bytes_per_row(t), t.shape[0]))
    return out


def layout(pool: MemoryPool) -> list[list]:
    """[name, item_bytes] of every buffer, in transfer order: the handshake fingerprint."""
    return [[b.name, b.item_bytes] for b in page_buffers(pool) + row_buffers(pool)]


def model_fingerprint(config: ModelConfig) -> str:
    """Short hash of the architecture (not the weights): both sides must serve the same model."""
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k != "extra"}
    return hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


def layout_mismatch(ours: list[list], theirs: list[list]) -> str | None:
    """One line saying how two layouts differ, or None."""
    if ours == theirs:
        return None
    mine, other = dict(map(tuple, ours)), dict(map(tuple, theirs))
    for name in mine.keys() | other.keys():
        if mine.get(name) != other.get(name):
            return (
                f"buffer {name}: {mine.get(name)} B per item here, {other.get(name)} B on the peer "
                "(page size, KV dtype, model or speculative settings differ)"
            )
    return "buffer order differs"


def tp_mismatch(prefill_tp: int, decode_tp: int) -> str | None:
    """Why a prefill and a decode worker of these --tp-size values cannot hand off, or None."""
    if prefill_tp == decode_tp:
        return None
    return (
        f"prefill tp {prefill_tp} / decode tp {decode_tp}: KDA states are split by heads over "
        "the TP ranks, so both sides must run the same --tp-size"
    )


def simulation_mismatch(prefill: int | None, decode: int | None) -> str | None:
    """Why a prefill and a decode worker cannot hand off as simulated ranks, or None: a
    simulated rank (--simulate-rank) holds one rank's share only, so both sides must simulate
    the same rank (and a real worker cannot pair with a simulated one)."""
    if prefill == decode:
        return None

    def side(r: int | None) -> str:
        return "a real worker" if r is None else f"simulated rank {r}"

    return f"prefill is {side(prefill)}, decode {side(decode)}: both must simulate the same rank"


def page_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Merge (src page, dst page) pairs into runs contiguous on both sides: (src, dst, count)."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


Writes = tuple[list[int], list[int], list[int]]


def page_writes(
    local: list[Buffer], remote: list[int], src_pages: list[int], dst_pages: list[int]
) -> Writes:
    """Writes for pages src_pages -> dst_pages of every page buffer (remote = peer addresses)."""
    srcs, dsts, lens = [], [], []
    for buf, raddr in zip(local, remote):
        for s, d, n in page_runs(src_pages, dst_pages):
            srcs.append(buf.addr + s * buf.item_bytes)
            dsts.append(raddr + d * buf.item_bytes)
            lens.append(n * buf.item_bytes)
    return srcs, dsts, lens


def row_writes(local: list[Buffer], remote: list[int], src_row: int, dst_row: int) -> Writes:
    return (
        [b.addr + src_row * b.item_bytes for b in local],
        [r + dst_row * b.item_bytes for b, r in zip(local, remote)],
        [b.item_bytes for b in local],
    )

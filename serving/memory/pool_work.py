"""The pool's device work for requests it hands rows and pages to (MemoryPool): row resets, page
maps and snapshot loads, applied at once or, inside batched(), queued and launched together when
the block ends: admitting 32 prefix-cache hits in one step costs the launches that admitting one
does."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import chain

import torch

from serving.forward_batch import to_device
from serving.memory.cache import ModelCache, load_kda_states, reset_request_state


@dataclass
class PoolWork:
    """Device work of the pool, applied as one batch, in this order:
    resets:  rows handed out, their KDA states and compression tails zeroed;
    maps:    (row, first page index, pages): positions of the row pointed at the pages' slots;
    loads:   (snapshot slot, row): a row started from a prefix-cache state snapshot.
    The order is the dependency: a row handed out and started from a snapshot in one batch is
    zeroed first (its tails stay zero), then loaded. No row is reset twice or loaded twice,
    and no position is mapped twice (each admission or growth maps pages a row did not have)."""

    resets: list[int] = field(default_factory=list)
    maps: list[tuple[int, int, list[int]]] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.resets or self.maps or self.loads)

    def add(self, other: PoolWork) -> None:
        self.resets += other.resets
        self.maps += other.maps
        self.loads += other.loads


class PoolWorkQueue:
    """PoolWork applied as asked (through `apply`), or queued inside batched()."""

    def __init__(self, apply: Callable[[PoolWork], None]) -> None:
        self.apply = apply
        self.queued: PoolWork | None = None

    @property
    def open(self) -> bool:
        return self.queued is not None

    @contextmanager
    def batched(self) -> Iterator[None]:
        """Work asked for inside the block is queued and applied when it ends, as a few
        launches for all of it. Nested blocks join the outer one.

        Hazard: until the block ends, the device has not seen the queued work: nothing inside
        may launch device work on those rows, positions or slots (scheduling is host work only;
        a save asserts it is not inside). A snapshot slot whose load is queued may be evicted
        and handed to a save inside the block: the save runs in a later forward, after the load
        in stream order."""
        if self.queued is not None:
            yield
            return
        self.queued = PoolWork()
        try:
            yield
        finally:
            work, self.queued = self.queued, None
            if work:
                self.apply(work)

    def do(self, work: PoolWork) -> None:
        """Queue `work` inside batched(), else apply it now."""
        if self.queued is None:
            self.apply(work)
        else:
            self.queued.add(work)


def apply_work(
    work: PoolWork,
    caches: list[ModelCache],
    target: ModelCache,
    req_to_token: torch.Tensor,
    page_offsets: torch.Tensor,
) -> None:
    """A batch's device work: one host-to-device copy of every index, then per buffer one
    index_fill (resets, every cache), one index_put into the request table (maps; page_offsets:
    arange(page size) on the device) and one gather plus one index_copy (loads, the target's
    snapshots), whatever the number of rows."""
    size, max_context = page_offsets.numel(), req_to_token.shape[1]
    page_rows = [row for row, _, pages in work.maps for _ in pages]
    page_starts = [(first + i) * size for _, first, pages in work.maps for i in range(len(pages))]
    page_ids = [p for _, _, pages in work.maps for p in pages]
    load_slots = [slot for slot, _ in work.loads]
    load_rows = [row for _, row in work.loads]
    parts = [work.resets, page_rows, page_starts, page_ids, load_slots, load_rows]
    ids = to_device(list(chain.from_iterable(parts)), torch.int64, req_to_token.device)
    resets, rows, starts, pages, slots, loaded = ids.split([len(p) for p in parts])
    if work.resets:
        for cache in caches:
            reset_request_state(cache, resets)
    if page_ids:
        # A last page may overhang the table: its positions past the end clamp to the last
        # column and write that column's own slot (equal values, so the duplicates agree).
        pos = (starts[:, None] + page_offsets).clamp_(max=max_context - 1)
        slots_of = pages[:, None] * size + (pos - starts[:, None])
        req_to_token.index_put_((rows[:, None], pos), slots_of)
    if work.loads:
        load_kda_states(target, slots, loaded)

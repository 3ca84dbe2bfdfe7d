"""Free lists for request rows and KV pages.

Row 0 and page 0 are reserved padding: padded batch entries point at them, so nothing live
is ever there. Double frees and foreign ids raise at once, since a leak or an alias here corrupts
another request's cache silently.
"""

from __future__ import annotations

import heapq


class FreeList:
    """Ids 1..capacity handed out lowest first (0 is the reserved padding id).

    The free ids are a min-heap: alloc and free cost O(log n) per id. (A list kept sorted cost
    O(free ids) per free: 4 ms a call on an H200 worker's 778k KV pages, measured, on the
    scheduler's path at every finished request.)"""

    def __init__(self, capacity: int, what: str) -> None:
        self.capacity = capacity
        self.what = what
        self._free = list(range(1, capacity + 1))  # ascending: already a heap
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    @property
    def used(self) -> frozenset[int]:
        """A copy: O(ids in use), so not for every step (the prefix cache keeps most pages
        in use)."""
        return frozenset(self._used)

    def alloc(self, n: int = 1) -> list[int] | None:
        """n ids, or None (nothing taken) when fewer than n are free."""
        if n > len(self._free):
            return None
        ids = [heapq.heappop(self._free) for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if i not in self._used:
                raise RuntimeError(f"{self.what} {i} freed but not in use")
            self._used.remove(i)
            heapq.heappush(self._free, i)


class PageAllocator(FreeList):
    """KV pages of `page_size` slots; slot = page * page_size + offset."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        super().__init__(num_pages, "page")
        self.page_size = page_size

    @property
    def num_slots(self) -> int:
        """Slots in the token pools, padding page included."""
        return (self.capacity + 1) * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

"""admit: the one place a request gets its memory (a request row and the pages for its first
chunk); grow: more pages as it advances; release: everything back. The engine's prefill half and
PD decode's preallocation both admit through here.

Invariant: a request owns its row and the pages in req.pages from admit() until release(); no
other code hands rows or pages to a request or takes them back.
"""

from __future__ import annotations

from serving.engine.request import Req
from serving.memory.pool import MemoryPool


class Admission:
    def __init__(self, pool: MemoryPool) -> None:
        self.pool = pool

    def admit(self, req: Req, max_tokens: int, reserve: int) -> int | None:
        """Give `req` a row and the pages for its next chunk of at most `max_tokens` tokens,
        keeping `reserve` pages free for the running requests' next decode tokens. Returns the
        chunk's length, or None with nothing taken."""
        pool = self.pool
        n = min(req.uncached, max_tokens)
        if pool.pages.num_free - pool.pages.pages_for(n + 1) < reserve:
            return None
        row = pool.alloc_row()
        if row is None:
            return None
        if not pool.grow(row, req.pages, n):
            pool.free_row(row)
            return None
        req.row = row
        return n

    def grow(self, req: Req, num_tokens: int) -> bool:
        """Pages for positions up to num_tokens; False (nothing taken) when short."""
        return self.pool.grow(req.row, req.pages, num_tokens)

    def release(self, req: Req) -> None:
        if req.pages:
            self.pool.free_pages(req.pages)
        if req.row is not None:
            self.pool.free_row(req.row)
            req.row = None

"""admit: the one place a request gets its memory (the cached prefix, locked; a request row
started from the prefix's state snapshot; the pages for its first chunk); grow: more pages as it
advances; release: everything back (what it computed stays in the prefix cache). The engine's
prefill half and PD decode's preallocation both admit through here.

The prefix cache's state snapshots sit on a grid G = lcm(page size, index_kpool, 64): a multiple
of kpool, so a hit never needs a compression tail (the open pool is empty there); of the page
size, so a hit is whole pages; of fla's chunk (64), so a kernel's chunk states line up with it.
Snapshots are taken
- in a prefill forward, at the last grid position of each chunk and where the request's tokens
  branch off KV the cache already holds (a shared system prompt then the request's own text: the
  next request with that prompt hits it, which the chunk's end alone would miss); plan_save, the
  KDA layers save between passes over the chunk (no extra forward); inserted after the step;
- while decoding, whenever a request crosses a grid position (track: one slot per request,
  overwritten; with EAGLE from the verify's per-position history), inserted every
  --mamba-track-interval tokens and, at the end of the request, the last one (release).
Pages are inserted with the snapshot that ends them, never beyond it: KV past the last state
could never be matched.

PD decode's page cache (a tree without snapshots, --disaggregation-decode-enable-radix-cache):
only a request another worker prefills matches it (preallocate: prefilled_elsewhere), taking
whole pages of KV and no state (prefill writes the row's state after the whole prompt, and the
pages past the match); a local prefill there (a health check, a retracted request's re-prefill)
takes no hit, since it would need a state. An adopted request's KV goes into the tree at its
release, through its last whole page whose KV is known computed. Hazard: the pages of tokens
decode generated hold decode's KV, not what prefill would compute (bf16 rounding may differ),
so through PD a later turn's prompt may see decode's KV for its earlier answer.

Invariant: a request owns its row and the pages in req.pages but not in req.shared_pages from
admit() until release(); the tree owns the shared ones, and the request's KV lock on req.prefix
keeps them. No other code hands rows, pages or state slots to a request or takes them back.

Hazard (the overlap scheduler): a request that finishes while a launched step still holds it
(req.in_flight) may still have its row and pages written by the device: an extra decode step
whose token is discarded. release() then only defers; settle(), after that step completed,
frees. Freeing at once would be safe for the device's own later kernels (one stream), but not
for writers outside the stream: a PD transfer into pages or a row handed out again.
"""

from __future__ import annotations

import math
import time

from serving.engine.cache_keys import cache_keys
from serving.engine.request import Req
from serving.memory.pool import MemoryPool
from serving.memory.radix_cache import RadixCache
from serving.protocol import SchedulerStats

FLA_CHUNK = 64


def snapshot_grid(page_size: int, kpool: int) -> int:
    return math.lcm(page_size, kpool, FLA_CHUNK)


class Admission:
    def __init__(
        self,
        pool: MemoryPool,
        stats: SchedulerStats,
        cache: RadixCache | None = None,
        track_interval: int = 0,
        vocab: int = 0,
    ) -> None:
        """cache None: no prefix cache. With a draft in the pool, cache keys are (token, next
        token) pairs: the draft's KV at a position depends on the next token."""
        self.pool, self.stats, self.cache = pool, stats, cache
        self.snapshots = cache is not None and cache.snapshots  # else: no cache or pages only
        self.grid = cache.grid if self.snapshots else 0
        self.track_interval, self.vocab = track_interval, vocab
        self.pair_keys = pool.draft is not None
        self.deferred: list[Req] = []  # released while in flight; freed by settle()
        self.match_s = 0.0  # time spent matching prefixes, ever (the step phases read it)

    def batched(self):
        """Device work of admissions and growths in the block: one batch (MemoryPool.batched)."""
        return self.pool.batched()

    # ---- admit ----
    def admit(
        self, req: Req, max_tokens: int, running: int, prefilled_elsewhere: bool = False
    ) -> int | None:
        """Give `req` its cached prefix (when the cache has one), a row and the pages for its
        next chunk of at most `max_tokens` tokens. The reserve policy: one page stays free (or
        evictable) per request that decodes beside it (`running`), for that request's next
        decode tokens. Returns the chunk's length, or None with nothing taken.
        prefilled_elsewhere: PD decode's preallocation (another worker writes the prompt's KV
        and state); only it matches a page cache, and its hit is decode_cached_tokens."""
        pool, cache = self.pool, self.cache
        looked_up = self.snapshots or (cache is not None and prefilled_elsewhere)
        node, hit = None, 0
        if looked_up:
            started = time.perf_counter()
            keys = self.keys(req.fill_ids, req)
            if self.snapshots:
                match = cache.match(keys, self._match_limit(req))
                req.branch = match.kv_length // self.grid * self.grid
            else:
                match = cache.match_pages(keys)
            self.match_s += time.perf_counter() - started
            node, hit = match.node, match.length
        n = min(len(req.fill_ids) - hit, max_tokens)
        if node is not None:
            cache.lock(node)  # before any eviction below: the prefix must survive it
            if self.snapshots:
                cache.lock_state(node)
        row = None
        if self._make_free(pool.pages.pages_for(n + 1) + running):
            row = pool.alloc_row()
        if row is None:
            if node is not None:
                if self.snapshots:
                    cache.unlock_state(node)
                cache.unlock(node)
            return None
        if node is not None:
            prefix = node.path_pages()
            pool.map_pages(row, 0, prefix)
            if self.snapshots:
                pool.load_states([node.slot], [row])
                cache.unlock_state(node)
            req.pages, req.shared_pages, req.prefix = list(prefix), set(prefix), node
        grown = pool.grow(row, req.pages, hit + n)
        assert grown, "the pages were made free above"
        req.row, req.cached = row, hit
        if prefilled_elsewhere and looked_up:
            req.decode_cached_tokens = hit
        if req.cached_tokens is None:  # the first admission's hit is the one reported
            if not prefilled_elsewhere:  # else adopt() sets prefill's
                req.cached_tokens = min(hit, len(req.input_ids))
            if looked_up:
                self.stats.cache_lookup_tokens_total += len(req.input_ids)
                self.stats.cache_hit_tokens_total += min(hit, len(req.input_ids))
        return n

    def _match_limit(self, req: Req) -> int:
        """At least one token is computed (its logits are sampled), and no prompt position whose
        logprob is still to be scored is skipped. Image positions may hit: keyed by content."""
        limit = len(req.fill_ids) - 1
        if req.input_scored < len(req.input_ids):
            limit = min(limit, req.input_scored - 1)
        return limit

    def grow(self, req: Req, num_tokens: int) -> bool:
        """Pages for positions up to num_tokens, evicting cached ones if need be; False
        (nothing taken) when short."""
        need = self.pool.pages.pages_for(num_tokens) - len(req.pages)
        return self._make_free(need) and self.pool.grow(req.row, req.pages, num_tokens)

    def _make_free(self, pages: int) -> bool:
        short = pages - self.pool.pages.num_free
        if short > 0 and self.cache is not None and self.cache.evictable_pages >= short:
            self.cache.evict_pages(short)
        return self.pool.pages.num_free >= pages

    # ---- release ----
    def release(self, req: Req) -> None:
        """Everything back: the last tracked snapshot (and the KV before it) goes into the
        cache, the cache's pages are unlocked, the request's own pages and row are freed.
        Deferred to settle() while a launched step still holds the request."""
        if req.in_flight:
            if req not in self.deferred:
                self.deferred.append(req)
            return
        if req.adopted and self.cache is not None and not self.snapshots:
            self._insert_pages(req)
        if req.track_slot is not None:
            slot, req.track_slot = req.track_slot, None
            if req.track_pos > self._prefix_len(req):
                self.insert(req, req.track_pos, slot, req.fill_ids)
            else:
                self.pool.state_slots.free([slot])
        req.track_pos = 0
        if req.prefix is not None:
            self.cache.unlock(req.prefix)
            req.prefix = None
        own = [p for p in req.pages if p not in req.shared_pages]
        req.pages.clear()
        req.shared_pages = set()
        if own:
            self.pool.free_pages(own)
        if req.row is not None:
            self.pool.free_row(req.row)
            req.row = None

    def _insert_pages(self, req: Req) -> None:
        """PD decode's page cache: the adopted request's KV, through its last whole page whose
        positions were all computed (req.cached; never the last token, which no step has fed),
        joins the tree; the request then locks it as its prefix until its pages are freed."""
        page = self.pool.plan.page_size
        tokens = req.fill_ids
        keys = self.keys(tokens, req)  # with a draft: one short (the pairs' last token)
        end = min(req.cached, len(tokens) - 1, len(keys), len(req.pages) * page) // page * page
        if end <= self._prefix_len(req):
            return
        node, adopted = self.cache.insert(keys[:end], req.pages[: end // page])
        req.shared_pages.update(adopted)
        self.cache.lock(node)
        if req.prefix is not None:
            self.cache.unlock(req.prefix)
        req.prefix = node

    def settle(self) -> None:
        """Release the deferred requests whose last step has completed."""
        done = [r for r in self.deferred if not r.in_flight]
        self.deferred = [r for r in self.deferred if r.in_flight]
        for req in done:
            self.release(req)

    def owned_pages(self, req: Req) -> list[int]:
        """The pages `req` itself owns (for the pool invariant)."""
        return [p for p in req.pages if p not in req.shared_pages]

    # ---- snapshots ----
    def keys(self, tokens: list[int], req: Req) -> list[int]:
        """The cache's key per position of `tokens` (serving/engine/cache_keys.py)."""
        return cache_keys(tokens, req, self.vocab, self.pair_keys)

    def plan_save(self, req: Req, n: int) -> list[tuple[int, int]]:
        """Where in the chunk req.cached.. +n to snapshot the KDA state for the cache: (tokens
        into the chunk, slot) at the branch point and at the chunk's last grid position, when
        inside the chunk and not cached yet."""
        if not self.snapshots:
            return []
        start, end = req.cached, req.cached + n
        points = sorted({p for p in (req.branch, end // self.grid * self.grid) if start < p <= end})
        keys = self.keys(req.fill_ids, req)
        saves = []
        for p in points:
            if self.cache.has_state(keys, p):
                continue  # cached already (a re-prefill, or a twin request)
            slot = self._alloc_slot()
            if slot is not None:
                saves.append((p - start, slot))
        return saves

    def track(self, reqs: list[Req], before: list[int]) -> None:
        """Decode, after the forward: snapshot the state of each request that crossed a grid
        position (its cached was `before` the step) into its tracking slot."""
        rows, slots = [], []
        for req, start in zip(reqs, before):
            pos = self._crossed(req, start)
            if pos and (slot := self.track_slot(req)) is not None:
                rows.append(req.row)
                slots.append(slot)
                req.track_pos = pos
        if rows:
            self.pool.save_states(rows, slots)

    def offer(self, req: Req, steps: int) -> tuple[int, int] | None:
        """EAGLE, before a verify of steps + 1 positions: (verify position, slot) at which to
        snapshot req's state if the step's accepted run reaches the next grid position."""
        if not self.snapshots:
            return None
        j = (req.cached // self.grid + 1) * self.grid - req.cached - 1
        if j > steps:
            return None
        slot = self.track_slot(req)
        return (j, slot) if slot is not None else None

    def may_cross_grid(self, req: Req, end: int) -> bool:
        """Whether req's state at a snapshot grid position in (req.cached, end] may be due."""
        return self.snapshots and end // self.grid > req.cached // self.grid

    def tracked(self, req: Req, before: int) -> None:
        """EAGLE, after a step whose offer was made: the snapshot was taken iff the accepted
        run crossed the grid position."""
        if pos := self._crossed(req, before):
            req.track_pos = pos

    def _crossed(self, req: Req, before: int) -> int:
        """The grid position req.cached reached since `before`, or 0."""
        if not self.snapshots:
            return 0
        pos = req.cached // self.grid * self.grid
        return pos if pos > before else 0

    def track_slot(self, req: Req) -> int | None:
        """The request's private snapshot slot (allocated on first use)."""
        if req.track_slot is None:
            req.track_slot = self._alloc_slot()
            req.track_pos = 0
        return req.track_slot

    def checkpoint(self, req: Req) -> None:
        """Decode: hand the tracked snapshot to the cache at every --mamba-track-interval."""
        if (
            req.track_slot is not None
            and req.track_pos
            and req.track_pos % self.track_interval == 0
            and req.track_pos > self._prefix_len(req)
        ):
            slot, req.track_slot = req.track_slot, None
            self.insert(req, req.track_pos, slot, req.fill_ids)

    def _prefix_len(self, req: Req) -> int:
        return 0 if req.prefix is None else req.prefix.depth

    def insert(self, req: Req, end: int, slot: int, tokens: list[int]) -> None:
        """Give the cache req's KV for positions < end and the snapshot at `end` in `slot`
        (tokens: req's tokens, at least through position end - 1, and with a draft through
        `end`). The request then locks the new, longer prefix; pages the tree already held
        stay the request's own (freed at its release: a transfer may still read them)."""
        cache = self.cache
        keys = self.keys(tokens, req)
        if len(keys) < end or len(req.pages) * self.pool.plan.page_size < end:
            self.pool.state_slots.free([slot])  # its tokens were cut (a stop inside EAGLE's run)
            return
        node, adopted = cache.insert(keys[:end], req.pages[: end // self.pool.plan.page_size])
        if not cache.set_state(node, slot):
            self.pool.state_slots.free([slot])
        req.shared_pages.update(adopted)
        cache.lock(node)
        if req.prefix is not None:
            cache.unlock(req.prefix)
        req.prefix = node

    def _alloc_slot(self) -> int | None:
        got = self.pool.state_slots.alloc(1)
        if got is None and self.cache.evict_states(1):
            got = self.pool.state_slots.alloc(1)
        return got[0] if got else None

    # ---- flush ----
    def flush(self) -> None:
        """Empty the cache (no request may hold a lock)."""
        if self.cache is not None:
            self.cache.flush()

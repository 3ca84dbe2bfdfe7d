"""The prefix cache: a radix tree over token keys, page-granular, whose nodes hold KV pages and,
at some node ends, a KDA state snapshot.

    root -- [k0 .. k127] pages (p3, p9) -- [k128 .. k191] pages (p4), state slot 7
                                      \\-- [k128' .. ] ...

A node's key is a run of whole pages of token keys (serving/engine/admission.py builds them; with
an EAGLE draft a key is a (token, next token) pair, because the draft's KV at a position depends
on the next token). Its pages hold every page buffer of that run, target and draft alike (they
share page ids). A node's state slot is the KDA conv + recurrent state after the node's last
position; only depths on the snapshot grid carry one (a multiple of the page size, index_kpool
and fla's chunk), so a hit never has to rebuild a compression tail (the open pool is empty).

KV and states are two resources with their own locks and LRU clocks (SGLang's
MambaRadixCache):
- a KV lock on a node pins it and every ancestor (a running request's prefix is never evicted);
- a state lock pins one node's snapshot (held between a match and the copy into a request row);
- evict_pages drops unlocked leaves, least recently used first, stateless ones (tombstones)
  before any other; evict_states drops unlocked snapshots, LRU first, and a leaf that loses its
  state goes with its KV (a leaf is never a tombstone unless a lock holds it, and it is dropped
  when that lock goes).
A match ends at the deepest node that holds both KV and a state.

Without snapshots (snapshots=False: PD decode, whose request states come from prefill) the tree
holds KV pages only: match_pages ends at the deepest whole page the tree holds (splitting a
node there), and a leaf without a state is content, not a tombstone (nothing prunes it; only
evict_pages and flush drop nodes).

Invariant: every page and state slot the tree holds came from the pool's free lists and goes
back there exactly once (eviction or flush); a locked node, or an ancestor of one, is never
evicted.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from serving.memory.pool import MemoryPool


@dataclass(eq=False)
class Node:
    key: list[int]  # a list: compared with a slice of the request's keys in one C call
    pages: list[int]
    parent: Node | None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)  # by first page
    slot: int | None = None  # state snapshot after this node's last position
    kv_locks: int = 0
    state_locks: int = 0
    kv_used: int = 0  # LRU clocks
    state_used: int = 0

    @property
    def depth(self) -> int:
        node, depth = self, 0
        while node is not None:
            depth += len(node.key)
            node = node.parent
        return depth

    def path_pages(self) -> list[int]:
        """The pages of every node from the root down to this one, in position order."""
        runs, node = [], self
        while node is not None:
            runs.append(node.pages)
            node = node.parent
        return [p for run in reversed(runs) for p in run]


@dataclass
class Match:
    node: Node | None  # None: no hit
    length: int = 0  # tokens whose KV and state the node's path holds
    kv_length: int = 0  # tokens whose KV the tree holds (>= length; whole pages)


class RadixCache:
    def __init__(self, pool: MemoryPool, grid: int, snapshots: bool = True) -> None:
        if grid % pool.plan.page_size:
            raise ValueError(f"snapshot grid {grid} is not a multiple of the page size")
        self.pool, self.page, self.grid = pool, pool.plan.page_size, grid
        self.snapshots = snapshots
        self.root = Node([], [], None)
        self.clock = itertools.count(1)
        self.pages_held = 0
        self.pages_locked = 0  # pages of nodes with kv_locks > 0
        self.states_held = 0

    @property
    def evictable_pages(self) -> int:
        return self.pages_held - self.pages_locked

    # ---- lookups ----
    def match(self, keys: list[int], limit: int, end: int | None = None) -> Match:
        """The deepest node on the path of keys[:end] (default: all of them) that holds a state,
        at depth <= limit; and how far the tree holds the path's KV (where it branches off, a
        state is worth taking)."""
        end = len(keys) if end is None else min(end, len(keys))
        node, depth, best = self.root, 0, Match(None)
        p = self.page
        while depth + p <= end:
            child = node.children.get(tuple(keys[depth : depth + p]))
            if child is None:
                break
            same = self._common(child.key, keys, depth, end)
            if same < len(child.key):  # a partial node: its state (at its end) is not on it
                best.kv_length = max(best.kv_length, depth + same)
                break
            node, depth = child, depth + len(child.key)
            best.kv_length = depth
            if node.slot is not None and depth <= limit:
                best.node, best.length = node, depth
        if best.node is not None:
            now = next(self.clock)
            best.node.state_used = now
            n: Node | None = best.node
            while n is not None:
                n.kv_used = now
                n = n.parent
        return best

    def match_pages(self, keys: list[int]) -> Match:
        """Without snapshots: the node ending at the deepest whole page of `keys` whose KV the
        tree holds (a node that holds more is split there, so locking the match pins no page
        past it); length == kv_length."""
        node, depth, p = self.root, 0, self.page
        while depth + p <= len(keys):
            child = node.children.get(tuple(keys[depth : depth + p]))
            if child is None:
                break
            same = self._common(child.key, keys, depth, len(keys))  # >= p: its first page
            partial = same < len(child.key)
            node, depth = self._split(child, same) if partial else child, depth + same
            if partial:
                break
        if node is self.root:
            return Match(None)
        now = next(self.clock)
        n: Node | None = node
        while n is not None:
            n.kv_used = now
            n = n.parent
        return Match(node, depth, depth)

    def has_state(self, keys: list[int], end: int | None = None) -> bool:
        """Whether a node ends exactly at `end` (default len(keys)) on this path with a state."""
        end = len(keys) if end is None else end
        return end <= len(keys) and self.match(keys, end, end).length == end

    # ---- locks ----
    def lock(self, node: Node) -> None:
        n: Node | None = node
        while n is not None and n is not self.root:
            if n.kv_locks == 0:
                self.pages_locked += len(n.pages)
            n.kv_locks += 1
            n = n.parent

    def unlock(self, node: Node) -> None:
        n: Node | None = node
        while n is not None and n is not self.root:
            n.kv_locks -= 1
            assert n.kv_locks >= 0, "KV lock released twice"
            if n.kv_locks == 0:
                self.pages_locked -= len(n.pages)
            n = n.parent
        self._prune(node)

    def lock_state(self, node: Node) -> None:
        node.state_locks += 1

    def unlock_state(self, node: Node) -> None:
        node.state_locks -= 1
        assert node.state_locks >= 0, "state lock released twice"

    # ---- insertion ----
    def insert(self, keys: list[int], pages: list[int]) -> tuple[Node, list[int]]:
        """Make `keys` (whole pages) a path of the tree, its KV in `pages` (one per page of
        keys). Returns the node that ends at len(keys) and the pages the tree adopted; where the
        tree already held a run, it keeps its own pages and the caller keeps (and later frees)
        its duplicates."""
        p = self.page
        assert len(keys) % p == 0 and len(pages) == len(keys) // p
        node, depth, adopted = self.root, 0, []
        now = next(self.clock)
        while depth < len(keys):
            first = tuple(keys[depth : depth + p])
            child = node.children.get(first)
            if child is None:
                child = Node(keys[depth:], pages[depth // p :], node)
                node.children[first] = child
                self.pages_held += len(child.pages)
                adopted += child.pages
            else:
                same = self._common(child.key, keys, depth, len(keys))
                if same < len(child.key):
                    child = self._split(child, same)
            child.kv_used = now
            node, depth = child, depth + len(child.key)
        return node, adopted

    def set_state(self, node: Node, slot: int) -> bool:
        """Give `node` the snapshot in `slot`; False if it has one already (the caller frees
        its slot)."""
        assert node.depth % self.grid == 0, "a state off the snapshot grid"
        if node.slot is not None:
            return False
        node.slot, node.state_used = slot, next(self.clock)
        self.states_held += 1
        return True

    def _common(self, key: list[int], keys: list[int], depth: int, end: int) -> int:
        """Tokens (whole pages) that `key` shares with keys[depth:end]. A node's key is often
        thousands of tokens (a system prompt) and nearly always shared whole: that is one
        comparison, the page-by-page walk only where they part."""
        n = len(key)
        if depth + n <= end and key == keys[depth : depth + n]:
            return n
        p, n = self.page, 0
        while n < len(key) and depth + n + p <= end:
            if key[n : n + p] != keys[depth + n : depth + n + p]:
                break
            n += p
        return n

    def _split(self, node: Node, at: int) -> Node:
        """Cut `node` after `at` tokens; returns the new upper node (the parent of `node`).
        The state stays at the lower node's end; locks pass through both halves."""
        parent = node.parent
        upper = Node(
            node.key[:at],
            node.pages[: at // self.page],
            parent,
            kv_locks=node.kv_locks,
            kv_used=node.kv_used,
        )
        parent.children[tuple(node.key[: self.page])] = upper
        node.key, node.pages = node.key[at:], node.pages[at // self.page :]
        node.parent = upper
        upper.children[tuple(node.key[: self.page])] = node
        return upper

    # ---- eviction ----
    def evict_pages(self, want: int) -> int:
        """Free at least `want` pages from unlocked leaves (tombstones first, then least
        recently used); returns the pages freed."""
        freed = 0
        heap = [(n.slot is not None, n.kv_used, id(n), n) for n in self._evictable_leaves()]
        heapq.heapify(heap)
        while freed < want and heap:
            *_, leaf = heapq.heappop(heap)
            parent = leaf.parent
            freed += self._remove(leaf)
            if parent is not self.root and self._evictable_leaf(parent):
                heapq.heappush(heap, (parent.slot is not None, parent.kv_used, id(parent), parent))
        return freed

    def evict_states(self, want: int) -> int:
        """Free at least `want` state slots, least recently used first; returns the slots
        freed. A leaf that loses its state loses its KV too (unless locked: then when its lock
        goes)."""
        nodes = [n for n in self._nodes() if n.slot is not None and n.state_locks == 0]
        nodes.sort(key=lambda n: n.state_used)
        freed = 0
        for node in nodes[:want]:
            self.pool.state_slots.free([node.slot])
            node.slot = None
            self.states_held -= 1
            freed += 1
            self._prune(node)
        return freed

    def flush(self) -> None:
        """Drop every node; the caller makes sure no request holds a lock."""
        for node in self._nodes():
            assert node.kv_locks == 0 and node.state_locks == 0, "flush with a locked node"
        for child in list(self.root.children.values()):
            self._drop_subtree(child)
        self.root.children.clear()

    def _drop_subtree(self, node: Node) -> None:
        for child in list(node.children.values()):
            self._drop_subtree(child)
        node.children.clear()
        self._free_node(node)

    def _prune(self, node: Node) -> None:
        """Remove tombstone leaves (no state, no lock, no child) from `node` upwards (with
        snapshots: without them a stateless leaf is the cache's content)."""
        while (
            self.snapshots
            and node is not self.root
            and self._evictable_leaf(node)
            and node.slot is None
        ):
            parent = node.parent
            self._remove(node)
            node = parent

    def _remove(self, leaf: Node) -> int:
        del leaf.parent.children[tuple(leaf.key[: self.page])]
        return self._free_node(leaf)

    def _free_node(self, node: Node) -> int:
        self.pool.free_pages(node.pages)  # clears node.pages
        if node.slot is not None:
            self.pool.state_slots.free([node.slot])
            node.slot = None
            self.states_held -= 1
        n = len(node.key) // self.page
        self.pages_held -= n
        return n

    def _evictable_leaf(self, node: Node) -> bool:
        return not node.children and node.kv_locks == 0 and node.state_locks == 0

    def _evictable_leaves(self) -> list[Node]:
        return [n for n in self._nodes() if self._evictable_leaf(n)]

    def _nodes(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    # ---- the invariant ----
    def owned(self) -> tuple[list[int], list[int]]:
        """Every page and state slot the tree holds."""
        nodes = self._nodes()
        return [p for n in nodes for p in n.pages], [n.slot for n in nodes if n.slot is not None]

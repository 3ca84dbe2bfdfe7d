"""Load-balancing policies: which of the healthy workers of one role takes a request.

`select(workers, text)` gets a non-empty list of healthy workers and, for policies with
`needs_text`, the request's prompt text (`prompt_text`); it returns one of them. Load is the
router's own in-flight count per worker (`Worker.in_flight`), kept exact by the router for
every request it sends, so no policy asks the workers anything.
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from router.config import RouterConfig
from router.workers import Worker


class Policy:
    needs_text = False

    def select(self, workers: Sequence[Worker], text: str | None) -> Worker:
        raise NotImplementedError


class RoundRobin(Policy):
    """Each worker in turn, in the order they were given on the command line."""

    def __init__(self) -> None:
        self.next = 0

    def select(self, workers: Sequence[Worker], text: str | None) -> Worker:
        worker = workers[self.next % len(workers)]
        self.next += 1
        return worker


class Random(Policy):
    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def select(self, workers: Sequence[Worker], text: str | None) -> Worker:
        return self.rng.choice(workers)


class PowerOfTwo(Policy):
    """Two workers at random; the one with fewer requests in flight (the first on a tie)."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def select(self, workers: Sequence[Worker], text: str | None) -> Worker:
        if len(workers) == 1:
            return workers[0]
        a, b = self.rng.sample(workers, 2)
        return b if b.in_flight < a.in_flight else a


class CacheAware(Policy):
    """Prefix affinity: a prompt goes where the longest known prefix of it went last, so the
    worker's prefix cache can serve it, unless load is out of balance.

    The prefix table is an approximate radix tree: the prompt's first PREFIX_CHARS characters,
    cut into BLOCK_CHARS blocks, each keyed by a hash chained over all blocks before it (so a
    key stands for the whole prefix up to its block), mapped to the worker that last took
    that prefix. The match is the run of leading keys found in the table; its length over
    the prompt's (bounded) length is the match ratio. The table forgets the least recently
    used keys beyond max_tree_size characters' worth.

    - Imbalance (max - min in-flight > balance_abs AND max > balance_rel x min): the least
      loaded worker, whatever the prefix says.
    - Else a match ratio >= cache_threshold with a healthy owner: that owner.
    - Else the least loaded worker (fewest in flight; the first of equals), which then owns
      the prefix.
    Hash collisions only misplace a request; they never break one.
    """

    needs_text = True
    BLOCK_CHARS = 64
    PREFIX_CHARS = 8192

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs: int = 64,
        balance_rel: float = 1.5,
        max_chars: int = 1 << 22,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.max_keys = max(1, max_chars // self.BLOCK_CHARS)
        self.table: OrderedDict[int, Worker] = OrderedDict()

    def select(self, workers: Sequence[Worker], text: str | None) -> Worker:
        least = min(workers, key=_load)
        most = max(workers, key=_load)
        keys = self.block_keys(text or "")
        imbalanced = (
            most.in_flight - least.in_flight > self.balance_abs
            and most.in_flight > self.balance_rel * least.in_flight
        )
        chosen = least
        if not imbalanced and keys:
            owner, matched = self.match(keys)
            total = min(len(text or ""), self.PREFIX_CHARS)
            ratio = min(matched, total) / total
            if owner is not None and owner in workers and ratio >= self.cache_threshold:
                chosen = owner
        self.remember(keys, chosen)
        return chosen

    def block_keys(self, text: str) -> list[int]:
        """One chained hash per block of the prompt's first PREFIX_CHARS characters (the last
        block may be short)."""
        keys, h = [], 0
        for start in range(0, min(len(text), self.PREFIX_CHARS), self.BLOCK_CHARS):
            h = hash((h, text[start : start + self.BLOCK_CHARS]))
            keys.append(h)
        return keys

    def match(self, keys: list[int]) -> tuple[Worker | None, int]:
        """(owner of the longest known prefix, its length in characters)."""
        owner, n = None, 0
        for key in keys:
            worker = self.table.get(key)
            if worker is None:
                break
            owner, n = worker, n + 1
        return owner, n * self.BLOCK_CHARS

    def remember(self, keys: list[int], worker: Worker) -> None:
        table = self.table
        for key in keys:
            table[key] = worker
            table.move_to_end(key)
        while len(table) > self.max_keys:
            table.popitem(last=False)


def _load(worker: Worker) -> int:
    return worker.in_flight


def prompt_text(route: str, body: Any) -> str:
    """The text a prefix cache would key on: chat messages as role/content pairs, the (first)
    prompt or text, or token ids written out. Empty when the body has none of these."""
    if not isinstance(body, dict):
        return ""
    if route == "/v1/chat/completions":
        parts = []
        for m in body.get("messages") or ():
            if isinstance(m, dict):
                parts.append(f"{m.get('role')}\x00{_content_text(m.get('content'))}\x00")
        return "".join(parts)
    if route == "/v1/responses":
        value = body.get("input")
        return value if isinstance(value, str) else json.dumps(value)
    value = body.get("prompt") if route == "/v1/completions" else body.get("text")
    if value is None and route == "/generate":
        value = body.get("input_ids")
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        value = value[0]  # a batch: its first prompt stands for it
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return ",".join(map(str, value))
    return ""


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def create_policy(name: str, config: RouterConfig) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return Random()
    if name == "power_of_two":
        return PowerOfTwo()
    if name == "cache_aware":
        return CacheAware(
            config.cache_threshold,
            config.balance_abs_threshold,
            config.balance_rel_threshold,
            config.max_tree_size,
        )
    raise ValueError(f"unknown policy {name!r}")

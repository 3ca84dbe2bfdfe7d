"""The PD bootstrap triple.

`inject_bootstrap` is the only place the triple is built. A prefill worker and a decode worker
that get the same triple find each other through the prefill's bootstrap server
(bootstrap_host:bootstrap_port) and name the KV handoff by bootstrap_room.
"""

from __future__ import annotations

import random
from typing import Any

from router.workers import Worker

ROOM_BITS = 63
_rooms = random.Random()  # private: seeding the global `random` (tests) must not repeat rooms


def inject_bootstrap(route: str, body: dict[str, Any], prefill: Worker) -> None:
    """Set bootstrap_host/bootstrap_port/bootstrap_room on `body`, overwriting any the client
    sent (the router is the only source of rooms).

    - bootstrap_host: the prefill URL's host as written (not resolved).
    - bootstrap_port: the port given with --prefill, or None (the worker then uses its own).
    - bootstrap_room: a fresh random 63-bit int per request and per attempt (a retry gets a new
      one). Two live requests share a room with probability ~ live^2 / 2^64.
    A batch (several prompts in one request) gets one list entry per prompt, with distinct
    rooms; chat requests are never batches (n > 1 samples share the prompt's room).
    """
    n = batch_size(route, body)
    if n is None:
        body["bootstrap_host"] = prefill.host
        body["bootstrap_port"] = prefill.bootstrap_port
        body["bootstrap_room"] = _rooms.getrandbits(ROOM_BITS)
        return
    rooms: set[int] = set()
    while len(rooms) < n:
        rooms.add(_rooms.getrandbits(ROOM_BITS))
    body["bootstrap_host"] = [prefill.host] * n
    body["bootstrap_port"] = [prefill.bootstrap_port] * n
    body["bootstrap_room"] = list(rooms)


def batch_size(route: str, body: dict[str, Any]) -> int | None:
    """Number of prompts when the request is a batch; None for a single prompt.

    /generate: `text` as a list, or `input_ids` as a list of lists. /v1/completions: `prompt`
    as a list of strings or of token lists (a flat list of ints is one prompt).
    """
    if route == "/generate":
        text, ids = body.get("text"), body.get("input_ids")
        if isinstance(text, list):
            return len(text)
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            return len(ids)
    elif route == "/v1/completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            return len(prompt)
    return None

"""The worker-to-worker control plane: KVPoll states and the JSON messages on ZMQ.

decode -> prefill   register  {session, decode_addr, page_addrs, row_addrs, layout}
decode -> prefill   dest      {room, session, decode_addr, pages, row, prompt_len}
decode -> prefill   abort     {room, decode_addr}
decode -> prefill   waiting   {rooms}    rooms still queued for decode memory (a keepalive)
prefill -> decode   status    {room, status, message}     status: KVPoll.Success / Failed
prefill -> decode   abort_ack {room}

JSON, not pickle: these cross hosts, and a peer must never be able to run code here.
"""

from __future__ import annotations

import enum
import json
from typing import Any


class KVPoll(enum.IntEnum):
    """SGLang's handoff states; a room only moves forward and Failed is final."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


def advance(current: KVPoll, new: KVPoll) -> KVPoll:
    if current == KVPoll.Failed:
        return current
    if new == KVPoll.Failed:
        return new
    return max(current, new)


def encode(kind: str, **fields: Any) -> bytes:
    return json.dumps({"kind": kind, **fields}, separators=(",", ":")).encode()


def decode(raw: bytes) -> dict[str, Any]:
    msg = json.loads(raw)
    if not isinstance(msg, dict) or "kind" not in msg:
        raise ValueError("control message without a kind")
    return msg

"""The worker-to-worker control plane: KVPoll states and the JSON messages on ZMQ.

decode -> prefill   register  {session, decode_addr, page_addrs, row_addrs, layout}
decode -> prefill   dest      {room, session, decode_addr, pages, row, prompt_len}
decode -> prefill   abort     {room, decode_addr}
prefill -> decode   status    {room, status, message[, input_logprobs]}
                              status: KVPoll.Success / Failed; with Success, the scored
                              prompt tokens (logprob_start_len) as [[logprob, id, [[id, lp]..]]..]
prefill -> decode   abort_ack {room}

JSON, not pickle: these cross hosts, and a peer must never be able to run code here.
"""

from __future__ import annotations

import enum
import json
from typing import Any

from serving.protocol import TokenLogprob


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


def encode_logprobs(logprobs: list[TokenLogprob]) -> list[list[Any]]:
    return [[lp.logprob, lp.token_id, [list(t) for t in lp.top]] for lp in logprobs]


def decode_logprobs(raw: Any) -> list[TokenLogprob]:
    return [TokenLogprob(int(i), lp, [(int(t), float(v)) for t, v in top]) for lp, i, top in raw]


def encode(kind: str, **fields: Any) -> bytes:
    return json.dumps({"kind": kind, **fields}, separators=(",", ":")).encode()


def decode(raw: bytes) -> dict[str, Any]:
    msg = json.loads(raw)
    if not isinstance(msg, dict) or "kind" not in msg:
        raise ValueError("control message without a kind")
    return msg

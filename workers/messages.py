"""The worker-to-worker control plane: KVPoll states and the typed messages on ZMQ.

decode -> prefill   Register     once per prefill worker: its TP size and, per decode rank, that
                                 rank's Mooncake session and buffer addresses; the layout
decode -> prefill   Destination  per request: where its pages, state rows and aux row go (none
                                 for a scoring-only request: NO_ROW), and how much of the
                                 prompt's KV decode's prefix cache holds already (not sent)
decode -> prefill   Abort        the request ended at decode (with a reason when decode refused
                                 the handoff); prefill answers AbortAck
decode -> prefill   Waiting      rooms still queued at decode for memory (a keepalive)
prefill -> decode   Status       KVPoll.Success (everything landed, with the prompt logprobs
                                 prefill scored, if asked, and prefill's stage times) or
                                 KVPoll.Failed
prefill -> decode   AbortAck     nothing of the room is in flight any more

The codec (encode/decode) is the only place that knows the wire form: JSON objects with a
"kind", not pickle, since these cross hosts and a peer must never be able to run code here.
decode() checks every field's name and type, so a handler never sees a malformed message.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field
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


@dataclass(frozen=True)
class Register:
    """Decode's memory, rank by rank: each decode rank registered its own buffers with its own
    Mooncake engine, so entry r of sessions/page_addrs/row_addrs is decode rank r's."""

    decode_addr: str  # decode rank 0's control socket, host:port
    tp_size: int  # decode's --tp-size: must equal prefill's (KDA states split by heads)
    sessions: list[str]  # per decode rank: its Mooncake session id
    page_addrs: list[list[int]]  # per decode rank: every page buffer's base, in layout order
    row_addrs: list[list[int]]  # per decode rank: every request-row buffer's, in layout order
    layout: list[list]  # [name, bytes per item] of every buffer (kv_layout.layout), every rank


# Destination.row of a scoring-only request (max_new_tokens 0, prompt logprobs): decode holds no
# memory for it (pages empty), prefill writes nothing and answers Success with the scores.
NO_ROW = -1


@dataclass(frozen=True)
class Destination:
    room: int
    session: str
    decode_addr: str
    pages: list[int]
    row: int  # NO_ROW: a scoring-only request
    prompt_len: int
    # prompt tokens (whole pages) whose KV decode's prefix cache holds, in pages[:that / page
    # size] (SGLang's decode_prefix_len): prefill writes none of those pages; the rest of the
    # pages, the state rows and the aux row always (the state after the prompt is prefill's)
    decode_prefix_len: int = 0


@dataclass(frozen=True)
class Abort:
    room: int
    decode_addr: str
    reason: str = ""  # set when decode refused the handoff (e.g. at the handshake): prefill's
    # client gets it as a 502; empty: decode's client left (499)


@dataclass(frozen=True)
class Waiting:
    rooms: list[int]


@dataclass(frozen=True)
class Status:
    room: int
    status: int  # KVPoll.Success or KVPoll.Failed
    message: str = ""
    # with Success: the prompt tokens prefill scored (logprob_start_len), encode_logprobs' form
    input_logprobs: list[list] = field(default_factory=list)
    # with Success: prefill's stages of the request in seconds (PREFILL_STAGES), for decode's
    # meta_info
    stage_times: dict[str, float] = field(default_factory=dict)


# prefill's stages of a request that go to decode with Success: the three TTFT parts prefill
# saw, then two parts of the KV transfer (docs/PROTOCOL.md)
PREFILL_STAGES = (
    "prefill_arrival_wait_time",
    "queue_time",
    "prefill_forward_time",
    "kv_ship_wait_time",
    "kv_write_time",
)


def encode_logprobs(logprobs: list[TokenLogprob]) -> list[list[Any]]:
    """[[logprob, token id, [[id, logprob], ...]], ...]: JSON-safe TokenLogprobs."""
    return [[lp.logprob, lp.token_id, [list(t) for t in lp.top]] for lp in logprobs]


def decode_logprobs(raw: list[list]) -> list[TokenLogprob]:
    """encode_logprobs' inverse; ValueError on anything else."""
    try:
        return [
            TokenLogprob(
                int(i), None if lp is None else float(lp), [(int(t), float(v)) for t, v in top]
            )
            for lp, i, top in raw
        ]
    except (TypeError, ValueError) as e:
        raise ValueError(f"status.input_logprobs: malformed ({e})") from e


@dataclass(frozen=True)
class AbortAck:
    room: int


ControlMessage = Register | Destination | Abort | Waiting | Status | AbortAck
_KINDS: dict[str, type] = {
    "register": Register,
    "dest": Destination,
    "abort": Abort,
    "waiting": Waiting,
    "status": Status,
    "abort_ack": AbortAck,
}
_KIND_OF = {cls: kind for kind, cls in _KINDS.items()}


def _has_type(value: Any, kind: str) -> bool:
    """Whether a JSON value is of a field's declared type ("int", "str", "list[...]")."""
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind == "list":
        return isinstance(value, list)
    if kind == "dict[str, float]":
        return isinstance(value, dict) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
            for v in value.values()
        )
    inner = kind.removeprefix("list[").removesuffix("]")
    return isinstance(value, list) and all(_has_type(v, inner) for v in value)


def encode(msg: ControlMessage) -> bytes:
    body = {"kind": _KIND_OF[type(msg)], **dataclasses.asdict(msg)}
    return json.dumps(body, separators=(",", ":")).encode()


def decode(raw: bytes) -> ControlMessage:
    """The message in `raw`; ValueError naming what is wrong with it."""
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"not JSON ({e})") from e
    if not isinstance(body, dict):
        raise ValueError("not a JSON object")
    kind = body.pop("kind", None)
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"unknown kind {kind!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if unknown := set(body) - set(fields):
        raise ValueError(f"{kind}: unknown fields {sorted(unknown)}")
    for name, f in fields.items():
        if name not in body:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"{kind}: missing field {name}")
            continue
        if not _has_type(body[name], f.type):
            raise ValueError(f"{kind}.{name}: expected {f.type}, got {body[name]!r:.60}")
    return cls(**body)

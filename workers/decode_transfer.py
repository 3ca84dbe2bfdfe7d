"""A decode room's handoff (Transfer: its request, where it stands, what prefill sent with it)
and the memory of failed rooms that a late write could still reach (Quarantine)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from serving.engine.request import Req
from serving.memory.pool import AuxRows
from serving.protocol import TokenLogprob
from workers.messages import (
    NO_ROW,
    PREFILL_STAGES,
    Destination,
    KVPoll,
    Status,
    advance,
    decode_logprobs,
)

log = logging.getLogger(__name__)


@dataclass
class Transfer:
    req: Req
    room: int
    bootstrap: str  # the prefill's bootstrap server, host:port
    state: KVPoll
    deadline: float = 0.0
    rank: str | None = None  # the prefill scheduler rank's control address
    input_logprobs: list[TokenLogprob] | None = None  # scored by prefill, sent with Success
    dest_sent_at: float = 0.0  # when the destinations went out

    @property
    def scores_only(self) -> bool:
        """max_new_tokens 0 (the front allows it only with prompt logprobs): prefill scores the
        prompt and sends the scores with Success; no memory is held here and nothing moves."""
        return self.req.sampling.params.max_new_tokens == 0

    def destination(self, session: str, decode_addr: str) -> Destination:
        req = self.req
        return Destination(
            room=self.room,
            session=session,
            decode_addr=decode_addr,
            pages=req.pages,
            row=NO_ROW if self.scores_only else req.row,
            prompt_len=len(req.input_ids),
            decode_prefix_len=req.decode_cached_tokens or 0,
        )

    def succeeded(self, msg: Status) -> None:
        """Prefill's Success arrived: the KV is all here. ValueError: its scores are malformed.
        Prefill's stages join the request's; the KV transfer is the rest of the time from the
        destinations going out to Success (prefill's wait for the writes, the writes, and the
        control messages' way), so the TTFT parts add up to the time to first token.
        kv_ship_wait_time and kv_write_time are parts of kv_transfer_time, not more of it."""
        self.input_logprobs = decode_logprobs(msg.input_logprobs)
        self.state = advance(self.state, KVPoll.Success)
        req = self.req
        req.queued_at = time.monotonic()  # from here it waits for a running slot
        for name in PREFILL_STAGES:
            req.stages[name] = float(msg.stage_times.get(name, 0.0))
        waited = req.queued_at - self.dest_sent_at
        before = ("prefill_arrival_wait_time", "queue_time", "prefill_forward_time")
        req.stages["kv_transfer_time"] = max(0.0, waited - sum(req.stages[k] for k in before))

    def first_token(self, aux: AuxRows) -> tuple[int, int, int, list[TokenLogprob] | None]:
        """(room, first token, prefill's cached tokens, its logprobs) from the request's aux
        row, whose room is cleared when it is this transfer's: a later handoff into the row
        must write its own. Host memory (AuxRows): no wait for the step in flight."""
        row = self.req.row
        room, first, cached, ntop = aux.ints[row].tolist()
        logprobs = None
        if self.req.return_logprob:
            floats = aux.floats[row].tolist()
            ids = aux.top_ids[row, :ntop].tolist()
            logprobs = [TokenLogprob(first, floats[0], list(zip(ids, floats[1 : 1 + ntop])))]
        if room == self.room:
            aux.ints[row] = 0
        return room, first, cached, logprobs


@dataclass
class Quarantined:
    holder: Req  # owns the row and pages, under the failed request's rid + "#quarantined"
    rank: str | None
    deadline: float


class Quarantine:
    """Rows and pages of failed rooms whose destinations went out: prefill may still write into
    them, so they are reused only after its AbortAck, once it is known dead, or after
    `timeout` seconds (a late write must never land in another request's memory). The holder
    keeps the request's lock on its cached prefix (decode's page cache) until then, and the
    prefix's pages stay the tree's: prefill writes none of them, and none is freed here."""

    def __init__(self, free: Callable[[Req], None], timeout: float) -> None:
        self.free, self.timeout = free, timeout
        self.rooms: dict[int, Quarantined] = {}

    def hold(self, t: Transfer) -> None:
        """Take t's memory from its request (which fails without it)."""
        req = t.req
        holder = Req(
            f"{req.rid}#quarantined",
            [],
            req.sampling,
            row=req.row,
            pages=list(req.pages),
            prefix=req.prefix,
            shared_pages=req.shared_pages,
        )
        self.rooms[t.room] = Quarantined(holder, t.rank, time.monotonic() + self.timeout)
        req.row, req.pages, req.prefix, req.shared_pages = None, [], None, set()

    def acked(self, room: int) -> None:
        q = self.rooms.pop(room, None)
        if q is not None:
            self.free(q.holder)

    def expire(self, now: float) -> None:
        for room, q in list(self.rooms.items()):
            if now > q.deadline:
                log.warning("room %d: no abort ack from prefill; reusing its memory", room)
                self.free(self.rooms.pop(room).holder)

    def prefill_dead(self, rank: str | None) -> None:
        for room, q in list(self.rooms.items()):
            if q.rank == rank:  # a dead prefill writes nothing more
                self.free(self.rooms.pop(room).holder)

    def holders(self) -> list[Req]:
        return [q.holder for q in self.rooms.values()]

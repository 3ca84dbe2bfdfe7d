"""The prefill worker's role: wait for decode's destinations, prefill in chunks, ship each chunk's
KV pages as it completes, then the request state rows and the aux row (workers/shipping.py), and
answer the HTTP request (one token) only after the transfer succeeded.

Per room (SGLang's KVPoll, forward only):
    Bootstrapping     the HTTP request is here; decode's destinations are not
    WaitingForInput   destinations arrived; the request is queued in the scheduler
    Transferring      at least one chunk is on its way
    Success | Failed  decode is told; the request's memory is released and reported

Under TP/EP every rank writes its own share (workers/rank_transfer.py); this role runs on rank 0
only and orders the other ranks' writes through the step fanout. A room reaches Success only
once every rank has reported its writes done. A simulated rank R (--simulate-rank), the only
process, writes rank R's share to a decode worker simulating rank R (checked at the handshake).
"""

from __future__ import annotations

import logging
import time

from serving.distributed import state
from serving.engine.request import Req
from serving.engine.role import Role
from serving.executor.fanout import Fanout
from serving.memory.pool import MemoryPool
from serving.protocol import FAKE_BOOTSTRAP_HOST, GenerateRequest, SchedulerStats
from serving.sampling_params import SamplingParams
from serving.server_args import ServerArgs
from workers.bootstrap_server import register_rank
from workers.kv_endpoint import KVEndpoint
from workers.kv_layout import model_fingerprint
from workers.messages import (
    Abort,
    AbortAck,
    Destination,
    KVPoll,
    Register,
    Status,
    Waiting,
    advance,
    encode_logprobs,
)
from workers.shipping import Job, Room, Shipping
from workers.timeouts import Timeouts
from workers.transfer_engine import advertise_host

log = logging.getLogger(__name__)


class PrefillRole(Role):
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.timeouts = Timeouts.from_env()
        self.rooms: dict[int, Room] = {}
        self.by_rid: dict[str, int] = {}
        # decode's destinations or abort that beat the HTTP request, by room
        self.early: dict[int, tuple[float, Destination | Abort]] = {}
        # for /metrics (report): failed rooms (not client aborts) by where they failed
        self.bootstrap_failed = 0
        self.transfer_failed = 0

    def attach(self, scheduler, pool: MemoryPool, fanout: Fanout) -> None:
        super().attach(scheduler, pool, fanout)
        host = advertise_host(self.args.host)
        self.endpoint = KVEndpoint(pool, host, self.args.disaggregation_ib_device)
        ps = state()
        # the rank processes that write: one when simulated (rank R's share only)
        self.shipping = Shipping(self.endpoint, pool, ps.processes, ps.tp_size, fanout)
        simulated = ps.rank if ps.simulated else None
        fingerprint, layout = model_fingerprint(pool.config), self.endpoint.layout
        register_rank(
            self.args, host, self.endpoint.port, ps.tp_size, simulated, fingerprint, layout
        )

    # ---- intake ----
    def submit(self, request: GenerateRequest) -> None:
        # prefill samples the first token only (none for a scoring-only request)
        first = min(request.sampling.max_new_tokens, 1)
        one = SamplingParams(
            **{**vars(request.sampling), "max_new_tokens": first, "min_new_tokens": 0}
        )
        request.sampling = one
        if request.bootstrap_host == FAKE_BOOTSTRAP_HOST:
            self.scheduler.add(request)  # local only (health checks): no peer, no transfer
            return
        room, fail = request.bootstrap_room, self.scheduler.fail_request
        if room is None:
            return fail(request, "bootstrap_room is required in PD mode", 400)
        if room in self.rooms:
            return fail(request, f"bootstrap_room {room} is already in use", 400)
        self.rooms[room] = Room(request, time.monotonic() + self.timeouts.bootstrap)
        self.by_rid[request.rid] = room
        early_at, early = self.early.pop(room, (0.0, None))
        if isinstance(early, Destination):
            self.rooms[room].arrival_wait = time.monotonic() - early_at
            self._on_dest(early)
        elif isinstance(early, Abort):
            self._on_abort(early)

    def abort(self, rid: str, reason: str) -> None:
        room = self.by_rid.get(rid)
        if room is not None and self.rooms[room].req is None:
            self._fail(room, f"aborted: {reason}", status=499)
            return
        self.scheduler.abort(rid, reason)

    # ---- the loop ----
    def poll(self) -> None:
        self.shipping.order(self.rooms)
        for msg in self.endpoint.receive():
            match msg:
                case Register():
                    self.shipping.register(msg)
                case Destination():
                    self._on_dest(msg)
                case Abort():
                    self._on_abort(msg)
                case Waiting():
                    self._on_waiting(msg)
                case _:
                    log.warning("unexpected control message at prefill: %s", msg)
        # Ships come from processed steps: each was synchronised before its hooks ran. With a
        # later step in flight (overlap) nothing launched since writes a shipped page or row
        # (the prefill worker never decodes; a next chunk writes only later pages, and rows ship
        # with the last chunk), so no event is needed. Without one, process-time device work
        # (EAGLE's draft extend) may still be queued: the sender records an event.
        for job in self.shipping.drive(written=self.scheduler.inflight is not None):
            self._on_job_done(job)
        now = time.monotonic()
        for room_id, room in list(self.rooms.items()):
            if room.state == KVPoll.Bootstrapping and now > room.deadline:
                self._fail(
                    room_id,
                    f"decode sent no KV destinations within "
                    f"{self.timeouts.bootstrap:.0f} s (is decode up?)",
                    504,
                )
        for room_id, (t, _) in list(self.early.items()):
            if now - t > self.timeouts.bootstrap:
                del self.early[room_id]

    @property
    def queued(self) -> int:
        return sum(room.state == KVPoll.Bootstrapping for room in self.rooms.values())

    def report(self, stats: SchedulerStats) -> None:
        stats.num_prefill_prealloc_queue_reqs = self.queued
        stats.num_prefill_inflight_queue_reqs = len(self.owned())
        stats.num_bootstrap_failed_reqs_total = self.bootstrap_failed
        stats.num_transfer_failed_reqs_total = self.transfer_failed
        (stats.kv_transfer_latency_ms, stats.kv_transfer_speed_gb_s,
         stats.kv_transfer_total_mb) = self.shipping.last_transfer  # fmt: skip

    def _on_waiting(self, msg: Waiting) -> None:
        """Decode still queues these rooms for memory: their wait for destinations is decode's
        back-pressure, not a lost decode, so their bootstrap deadline moves on."""
        deadline = time.monotonic() + self.timeouts.bootstrap
        for room_id in msg.rooms:
            room = self.rooms.get(room_id)
            if room is not None and room.state == KVPoll.Bootstrapping:
                room.deadline = deadline

    def _on_dest(self, msg: Destination) -> None:
        room_id = msg.room
        room = self.rooms.get(room_id)
        if room is None:
            self.early[room_id] = (time.monotonic(), msg)
            return
        if room.dest is not None:
            return
        room.dest = msg
        problem = self.shipping.destination_problem(room, msg)
        if problem is not None:
            return self._fail(room_id, problem, 502)
        room.state = advance(room.state, KVPoll.WaitingForInput)
        self.scheduler.add(room.request)

    def _on_abort(self, msg: Abort) -> None:
        room_id = msg.room
        room = self.rooms.get(room_id)
        if room is None:  # kept for a request still on its way here: it fails at once
            self.early[room_id] = (time.monotonic(), msg)
            self.endpoint.send(msg.decode_addr, AbortAck(room_id))
            return
        room.abort_from = msg.decode_addr
        why = f"decode refused the handoff: {msg.reason}" if msg.reason else "aborted by decode"
        room.failure = room.failure or why
        if room.req is None:
            self._fail(room_id, why, 502 if msg.reason else 499)
        elif room.req.finish_reason is None:
            self.scheduler.abort(room.request.rid, "aborted by decode")
        # else: held, its last write in flight; _on_job_done finishes it

    # ---- scheduler hooks ----
    # The hooks below only record what to ship (the step's device work is complete when they
    # run); the writes go out from poll(), after the step.
    def chunk_prefilled(self, req: Req, end: int) -> None:
        room_id = self.by_rid.get(req.rid)
        if room_id is not None and end < len(req.input_ids):  # the last chunk: finished()
            room = self.rooms[room_id]
            room.req = req
            # not req.cached: under the overlap scheduler it may count a chunk still computing
            room.computed = end
            if not room.scores_only:
                self.shipping.record(room_id, final=False)

    def finished(self, req: Req) -> bool:
        room_id = self.by_rid.get(req.rid)
        if room_id is None:
            return False
        room = self.rooms[room_id]
        room.req = req
        if req.finish_reason.kind == "abort" or room.failure:
            room.failure = room.failure or req.finish_reason.message or "aborted"
            self._notify_failed(room_id, room, req.finish_reason.status)
            if room.in_flight:
                return True  # pages may still be read by a queued write; release after it
            self._forget(room_id)
            return False
        if room.scores_only:  # nothing was written: the scores go out now, memory is freed
            self._succeed(room_id, room)
            self._forget(room_id)
            return False
        self.shipping.record(room_id, final=True)
        return True

    def owned(self) -> list[Req]:
        """Finished requests held until their transfer ends."""
        return [
            r.req
            for r in self.rooms.values()
            if r.req is not None and r.req.finish_reason is not None and r.req.row is not None
        ]

    @property
    def busy(self) -> bool:
        return self.shipping.busy or any(r.in_flight for r in self.rooms.values())

    def sockets(self) -> list:
        return [self.endpoint.pull]

    # ---- the room's end ----
    def _on_job_done(self, job: Job) -> None:
        room = self.rooms.get(job.room)
        if room is None:
            return
        if self.shipping.settle(room, job):
            log.error("room %d: %s", job.room, room.failure)
            self._notify_failed(job.room, room, 502)
        if job.final and room.failure is None:
            self._succeed(job.room, room, self.shipping.landed(room, job))
            last = room.req.last_logprob
            self.scheduler.release_held(room.req, logprobs=[last] if last is not None else None)
            self._forget(job.room)
        elif room.failure is not None and room.in_flight == 0 and room.req is not None:
            if room.req.finish_reason is not None:  # held by finished(): report the failure now
                self.scheduler.release_held(room.req, error=room.failure, status=502)
                self._forget(job.room)
            else:  # still in the scheduler: aborting it releases through finished()
                self.scheduler.abort(room.request.rid, room.failure, status=502)

    def _succeed(self, room_id: int, room: Room, stages: dict[str, float] | None = None) -> None:
        """Tell decode the room's KV is all written (none moves for a scoring-only request),
        with the prompt's logprobs and (stages) prefill's stage times of its request."""
        room.state = advance(room.state, KVPoll.Success)
        scored, times = encode_logprobs(room.req.input_logprobs), stages or {}
        success = Status(room_id, int(KVPoll.Success), input_logprobs=scored, stage_times=times)
        self.endpoint.send(room.dest.decode_addr, success)

    def _notify_failed(self, room_id: int, room: Room, status: int) -> None:
        """The room failed (`status`: the HTTP status its request fails with): tell decode,
        once, and count it by where it failed (a client's abort, 499, is no failure)."""
        if room.state == KVPoll.Failed:
            return
        if status != 499 and room.state == KVPoll.Bootstrapping:
            self.bootstrap_failed += 1
        elif status != 499 and room.state == KVPoll.Transferring:
            self.transfer_failed += 1
        room.state = KVPoll.Failed
        if room.dest is not None:
            status = Status(room_id, int(KVPoll.Failed), room.failure or "")
            self.endpoint.send(room.dest.decode_addr, status)

    def _fail(self, room_id: int, message: str, status: int) -> None:
        """Fail a room whose request is not (or no longer) in the scheduler."""
        room = self.rooms[room_id]
        room.failure = message
        log.warning("room %d (%s) failed: %s", room_id, room.request.rid, message)
        self._notify_failed(room_id, room, status)
        self._forget(room_id)
        self.scheduler.fail_request(room.request, message, status)

    def _forget(self, room_id: int) -> None:
        """The room is over and nothing of it is in flight."""
        room = self.rooms.pop(room_id, None)
        if room is not None:
            self.by_rid.pop(room.request.rid, None)
            if room.abort_from is not None:
                self.endpoint.send(room.abort_from, AbortAck(room_id))

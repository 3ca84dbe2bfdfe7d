"""The decode worker's role: preallocate a request row, KV pages and the aux row for each request,
send those destinations to its prefill worker, wait for the KV, adopt the request with its first
token and decode.

    submit -> Bootstrapping (find the prefill rank) -> WaitingForInput (wait for a row + pages)
           -> Transferring (destinations sent) -> Success (aux checked) -> running
           \\-> Failed: the client gets an error; row and pages are freed

A request keeps the row it got here for its whole life, so rows up to max_running_requests +
extra slots are live while only max_running_requests decode at once. Memory whose destinations
were sent is reused only after prefill acknowledged an abort (or stopped, or a timeout): a late
write must never land in another request's pages.

Under TP/EP this role runs on rank 0 and decides everything; every rank has registered its own
pool with its own Mooncake engine (workers/rank_transfer.FollowerKV), and the registration sent
to prefill lists each rank's session and addresses. Prefill says Success only when every one of
its ranks has written, so decode needs nothing from its followers but their addresses, and that
their row resets are applied before the destinations go out (Fanout.ask_role). A simulated rank
(--simulate-rank) registers its one rank and pairs only with a prefill simulating the same rank.
"""

from __future__ import annotations

import logging
import time

from serving.distributed import state
from serving.engine.request import Req
from serving.engine.role import Role
from serving.executor.fanout import Fanout
from serving.executor.streams import landed_writes
from serving.memory.pool import MemoryPool
from serving.protocol import FAKE_BOOTSTRAP_HOST, GenerateRequest, SchedulerStats
from serving.server_args import ServerArgs
from workers.decode_transfer import Quarantine, Transfer
from workers.kv_endpoint import KVEndpoint
from workers.kv_layout import model_fingerprint
from workers.messages import AbortAck, KVPoll, Status, advance
from workers.prefill_link import PrefillLink
from workers.rank_transfer import DESCRIBE
from workers.timeouts import Timeouts
from workers.transfer_engine import advertise_host

log = logging.getLogger(__name__)


class DecodeRole(Role):
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.timeouts = Timeouts.from_env()
        self.transfers: dict[int, Transfer] = {}  # by room, in arrival order
        self.by_rid: dict[str, int] = {}
        # for /metrics (report): failed rooms (not client aborts) by where they failed
        self.bootstrap_failed = 0
        self.transfer_failed = 0

    def attach(self, scheduler, pool: MemoryPool, fanout: Fanout) -> None:
        super().attach(scheduler, pool, fanout)
        self.pool, self.fanout = pool, fanout
        self.endpoint = KVEndpoint(
            pool, advertise_host(self.args.host), self.args.disaggregation_ib_device
        )
        ps = state()
        # entry r: decode rank r's memory
        memory = [self.endpoint.memory, *fanout.ask_role(DESCRIBE)]
        simulated = ps.rank if ps.simulated else None
        fingerprint = model_fingerprint(pool.config)
        self.link = PrefillLink(
            self.args, self.endpoint, memory, ps.tp_size, simulated, fingerprint, self.timeouts
        )
        self.quarantine = Quarantine(scheduler.free, self.timeouts.abort_ack)

    # ---- intake ----
    def submit(self, request: GenerateRequest) -> None:
        if request.bootstrap_host == FAKE_BOOTSTRAP_HOST:
            if request.images:  # counted by the front, not preprocessed: nothing to encode
                return self.scheduler.fail_request(request, "PD decode prefills no images", 400)
            self.scheduler.add(request)  # local prefill + decode (health checks)
            return
        room = request.bootstrap_room
        fail = self.scheduler.fail_request
        if room is None or not request.bootstrap_host:
            message = (
                "bootstrap_host and bootstrap_room are required in PD mode "
                "(send requests through the router)"
            )
            return fail(request, message, 400)
        if room in self.transfers:
            return fail(request, f"bootstrap_room {room} is already in use", 400)
        req = self.scheduler.intake(request)
        if req is None:
            return  # refused and answered
        port = request.bootstrap_port or self.args.disaggregation_bootstrap_port
        addr = f"{request.bootstrap_host}:{port}"
        t = Transfer(
            req, room, addr, KVPoll.Bootstrapping, deadline=time.monotonic() + self.timeouts.waiting
        )
        self.transfers[room] = t
        self.by_rid[req.rid] = room
        if self.link.rank(addr) is not None:
            self._wait_for_memory(t)
        else:
            self.link.look_up(addr)

    def abort(self, rid: str, reason: str) -> None:
        room = self.by_rid.get(rid)
        if room is None:
            self.scheduler.abort(rid, reason)
        else:
            self._fail(self.transfers[room], f"aborted: {reason}", 499, tell_prefill=True)

    # ---- the loop ----
    def poll(self) -> None:
        self._directory_events()
        for msg in self.endpoint.receive():
            match msg:
                case Status():
                    self._on_status(msg)
                case AbortAck():
                    self.quarantine.acked(msg.room)
                case _:
                    log.warning("unexpected control message at decode: %s", msg)
        self._preallocate()
        self._adopt_landed()
        now = time.monotonic()
        waiting = (t for t in self.transfers.values() if t.state == KVPoll.WaitingForInput)
        self.link.keep_waiting(now, ((t.bootstrap, t.room) for t in waiting))
        for t in list(self.transfers.values()):
            if t.state < KVPoll.Success and now > t.deadline:
                self._fail(
                    t,
                    f"no KV from prefill {t.bootstrap} within {self.timeouts.waiting:.0f} s",
                    504,
                    tell_prefill=True,
                )
        self.quarantine.expire(now)

    def _directory_events(self) -> None:
        for kind, addr, payload in self.link.events():
            waiting = [t for t in self.transfers.values() if t.bootstrap == addr]
            if kind == "found":
                mismatch = self.link.handshake(addr, payload)
                for t in waiting:
                    if mismatch is not None:
                        # prefill's request for the room fails at once with the reason too
                        self.link.abort(payload["rank"], t.room, mismatch)
                        self._fail(t, f"prefill/decode mismatch: {mismatch}", 502)
                    else:
                        self._wait_for_memory(t)
            elif kind == "unreachable":
                for t in waiting:
                    self._fail(
                        t, f"cannot reach the prefill bootstrap server {addr}: {payload}", 503
                    )
            elif kind == "dead":
                for t in waiting:
                    if t.state == KVPoll.Success:
                        continue  # its KV is all here: it decodes without prefill
                    self._fail(
                        t,
                        f"prefill at {addr} stopped answering its bootstrap /health",
                        502,
                        prefill_gone=True,
                    )
                self.quarantine.prefill_dead(payload)

    def _wait_for_memory(self, t: Transfer) -> None:
        """Waiting for a row and pages is queueing, not a transfer: no deadline runs (the
        queue is bounded instead), and prefill is kept from timing the room out by
        _keep_waiting_rooms. The waiting deadline starts when the destinations go out."""
        if t.state < KVPoll.WaitingForInput:  # a second lookup answer must not touch later ones
            t.state = advance(t.state, KVPoll.WaitingForInput)
            t.deadline = float("inf")

    @property
    def queued(self) -> int:
        return len(self.transfers)

    def report(self, stats: SchedulerStats) -> None:
        states = [t.state for t in self.transfers.values()]
        stats.num_decode_prealloc_queue_reqs = sum(s < KVPoll.Transferring for s in states)
        stats.num_decode_transfer_queue_reqs = sum(s == KVPoll.Transferring for s in states)
        stats.num_bootstrap_failed_reqs_total = self.bootstrap_failed
        stats.num_transfer_failed_reqs_total = self.transfer_failed

    def _preallocate(self) -> None:
        waiting = [t for t in self.transfers.values() if t.state == KVPoll.WaitingForInput]
        for t in waiting:
            if t.scores_only:  # needs no memory: its destination goes out at once
                self._send_destination(t)
        wanted = [t for t in waiting if not t.scores_only]
        ready = wanted[: self.scheduler.preallocate([t.req for t in wanted])]
        if ready:
            # Hazard: a follower resets a fresh row when it replays rank 0's journal; had it
            # not done so before prefill's writes land, the reset would wipe the request state.
            self.fanout.ask_role([])
        for t in ready:
            self._send_destination(t)

    def _send_destination(self, t: Transfer) -> None:
        t.rank = self.link.rank(t.bootstrap)
        self.link.register(t.rank)
        dest = t.destination(self.endpoint.engine.session_id, self.endpoint.addr)
        # stamped before the send: prefill's stages start when the destinations arrive, and a
        # thread paused between the send and the stamp would end this span inside them (on a
        # loaded host decode's kv_transfer_time came out shorter than prefill's parts of it)
        t.dest_sent_at = time.monotonic()
        self.endpoint.send(t.rank, dest)
        t.state = advance(t.state, KVPoll.Transferring)
        t.deadline = t.dest_sent_at + self.timeouts.waiting
        # finding prefill and waiting for a row and pages (req.queued_at: its arrival here)
        t.req.stages["decode_prealloc_time"] = t.dest_sent_at - t.req.queued_at

    def _on_status(self, msg: Status) -> None:
        t = self.transfers.get(msg.room)
        if t is None:
            return
        if msg.status != KVPoll.Success:
            why = f"prefill failed the handoff: {msg.message or 'no reason'}"
            return self._fail(t, why, 502, prefill_gone=True)
        try:
            t.succeeded(msg)
        except ValueError as e:  # everything landed: nothing of the room is in flight
            self._fail(t, f"prefill's success message: {e}", 502, prefill_gone=True)

    def _adopt_landed(self) -> None:
        """Transfers that landed (Success) enter the running batch, oldest first, as slots free
        up."""
        landed = False
        for t in list(self.transfers.values()):
            if t.state != KVPoll.Success:
                continue
            if t.scores_only:
                self._finish_scored(t)
                continue
            if self.scheduler.free_running_slots <= 0:
                continue  # every later one waits too: FIFO
            req = t.req
            room, first, cached, logprobs = t.first_token(self.pool.aux)
            if room != t.room:
                self._fail(
                    t, f"handoff corrupted: aux row holds room {room}, expected {t.room}", 500
                )
                continue
            del self.transfers[t.room]
            del self.by_rid[req.rid]
            if not landed:  # the steps that read its pages and row come after Mooncake's copies
                landed_writes(self.pool.device)
                landed = True
            self.scheduler.adopt(req, first, logprobs, cached, t.input_logprobs)

    def _finish_scored(self, t: Transfer) -> None:
        """A scoring-only request is answered with prefill's scores and no output token."""
        del self.transfers[t.room]
        del self.by_rid[t.req.rid]
        self.scheduler.finish_scored(t.req, t.input_logprobs)

    # ---- failure ----
    def _fail(
        self,
        t: Transfer,
        message: str,
        status: int,
        tell_prefill: bool = False,
        prefill_gone: bool = False,
    ) -> None:
        """Report `t` failed. Its memory is freed now, unless prefill may still write into it.
        Counted by where it failed: before its destinations went out (finding prefill, the
        handshake, waiting for memory) or after; a client's abort (499) is no failure."""
        log.warning("room %d (%s) failed: %s", t.room, t.req.rid, message)
        if status != 499 and t.state < KVPoll.Transferring:
            self.bootstrap_failed += 1
        elif status != 499:
            self.transfer_failed += 1
        self.transfers.pop(t.room, None)
        self.by_rid.pop(t.req.rid, None)
        req = t.req
        exposed = t.state >= KVPoll.Transferring and not prefill_gone
        if exposed and tell_prefill and t.rank is not None:
            self.link.abort(t.rank, t.room)
        if req.row is not None and exposed:
            self.quarantine.hold(t)
        elif req.row is not None:
            self.scheduler.free(req)
        self.scheduler.fail_request(req, message, status)

    # ---- scheduler hooks ----
    def owned(self) -> list[Req]:
        held = [t.req for t in self.transfers.values() if t.req.row is not None]
        return held + self.quarantine.holders()

    @property
    def busy(self) -> bool:
        return bool(self.transfers)

    def sockets(self) -> list:
        return [self.endpoint.pull]

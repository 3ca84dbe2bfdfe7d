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
their row resets are applied before the destinations go out (RankFanout.ask_role). A simulated rank
(--simulate-rank) registers its one rank and pairs only with a prefill simulating the same rank.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass

from serving.distributed import state
from serving.engine.request import Req
from serving.engine.role import Role
from serving.executor.fanout import Fanout
from serving.executor.streams import landed_writes
from serving.memory.pool import MemoryPool
from serving.protocol import (
    FAKE_BOOTSTRAP_HOST,
    GenerateRequest,
    SchedulerStats,
    TokenLogprob,
)
from serving.server_args import ServerArgs
from workers.kv_endpoint import KVEndpoint
from workers.kv_layout import (
    layout_mismatch,
    model_fingerprint,
    simulation_mismatch,
    tp_mismatch,
)
from workers.messages import (
    NO_ROW,
    PREFILL_STAGES,
    Abort,
    AbortAck,
    Destination,
    KVPoll,
    Register,
    Status,
    Waiting,
    advance,
    decode_logprobs,
)
from workers.prefill_directory import PrefillDirectory
from workers.rank_transfer import DESCRIBE
from workers.timeouts import Timeouts
from workers.transfer_engine import advertise_host

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


@dataclass
class Quarantined:
    """Memory of a failed room that a late write could still reach."""

    holder: Req
    rank: str | None
    deadline: float


class DecodeRole(Role):
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.timeouts = Timeouts.from_env()
        self.transfers: dict[int, Transfer] = {}  # by room, in arrival order
        self.by_rid: dict[str, int] = {}
        self.prefills: dict[str, dict] = {}  # bootstrap addr -> cluster info + rank
        self.registered: set[str] = set()  # prefill ranks we sent our buffers to
        self.quarantine: dict[int, Quarantined] = {}
        self._next_keepalive = 0.0
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
        self.tp_size = ps.tp_size
        self.simulated_rank = ps.rank if ps.simulated else None
        # entry r: decode rank r's memory
        self.memory = [self.endpoint.memory, *fanout.ask_role(DESCRIBE)]
        self.directory = PrefillDirectory(self.timeouts, self.args.api_key)
        self.directory.start()

    # ---- intake ----
    def submit(self, request: GenerateRequest) -> None:
        if request.bootstrap_host == FAKE_BOOTSTRAP_HOST:
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
        if addr in self.prefills:
            self._wait_for_memory(t)
        else:
            self.directory.lookups.put(addr)

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
                    self._on_abort_ack(msg)
                case _:
                    log.warning("unexpected control message at decode: %s", msg)
        self._preallocate()
        self._adopt_landed()
        now = time.monotonic()
        self._keep_waiting_rooms(now)
        for t in list(self.transfers.values()):
            if t.state < KVPoll.Success and now > t.deadline:
                self._fail(
                    t,
                    f"no KV from prefill {t.bootstrap} within {self.timeouts.waiting:.0f} s",
                    504,
                    tell_prefill=True,
                )
        for room, q in list(self.quarantine.items()):
            if now > q.deadline:
                log.warning("room %d: no abort ack from prefill; reusing its memory", room)
                self.scheduler.free(self.quarantine.pop(room).holder)

    def _directory_events(self) -> None:
        while True:
            try:
                kind, addr, payload = self.directory.events.get_nowait()
            except queue.Empty:
                return
            waiting = [t for t in self.transfers.values() if t.bootstrap == addr]
            if kind == "found":
                mismatch = self._handshake_problem(payload)
                if mismatch is None:
                    self.prefills[addr] = payload
                    self.directory.watched.add(addr)
                for t in waiting:
                    if mismatch is not None:
                        # prefill's request for the room fails at once with the reason too
                        refusal = Abort(t.room, self.endpoint.addr, mismatch)
                        self.endpoint.send(payload["rank"], refusal)
                        self._fail(t, f"prefill/decode mismatch: {mismatch}", 502)
                    else:
                        self._wait_for_memory(t)
            elif kind == "unreachable":
                for t in waiting:
                    self._fail(
                        t, f"cannot reach the prefill bootstrap server {addr}: {payload}", 503
                    )
            elif kind == "dead":
                rank = (self.prefills.pop(addr, None) or {}).get("rank")
                for t in waiting:
                    if t.state == KVPoll.Success:
                        continue  # its KV is all here: it decodes without prefill
                    self._fail(
                        t,
                        f"prefill at {addr} stopped answering its bootstrap /health",
                        502,
                        prefill_gone=True,
                    )
                for room, q in list(self.quarantine.items()):
                    if q.rank == rank:  # a dead prefill writes nothing more
                        self.scheduler.free(self.quarantine.pop(room).holder)

    def _wait_for_memory(self, t: Transfer) -> None:
        """Waiting for a row and pages is queueing, not a transfer: no deadline runs (the
        queue is bounded instead), and prefill is kept from timing the room out by
        _keep_waiting_rooms. The waiting deadline starts when the destinations go out."""
        if t.state < KVPoll.WaitingForInput:  # a second lookup answer must not touch later ones
            t.state = advance(t.state, KVPoll.WaitingForInput)
            t.deadline = float("inf")

    def _keep_waiting_rooms(self, now: float) -> None:
        """Tell each prefill rank which of its rooms still wait here for memory, every
        heartbeat interval; prefill extends their bootstrap deadline (a dead decode stops
        sending, and prefill's timeout then frees the room)."""
        if now < self._next_keepalive:
            return
        self._next_keepalive = now + self.timeouts.heartbeat_interval
        by_rank: dict[str, list[int]] = {}
        for t in self.transfers.values():
            if t.state == KVPoll.WaitingForInput and t.bootstrap in self.prefills:
                by_rank.setdefault(self.prefills[t.bootstrap]["rank"], []).append(t.room)
        for rank, rooms in by_rank.items():
            self.endpoint.send(rank, Waiting(rooms))

    @property
    def queued(self) -> int:
        return len(self.transfers)

    def report(self, stats: SchedulerStats) -> None:
        states = [t.state for t in self.transfers.values()]
        stats.num_decode_prealloc_queue_reqs = sum(s < KVPoll.Transferring for s in states)
        stats.num_decode_transfer_queue_reqs = sum(s == KVPoll.Transferring for s in states)
        stats.num_bootstrap_failed_reqs_total = self.bootstrap_failed
        stats.num_transfer_failed_reqs_total = self.transfer_failed

    def _handshake_problem(self, info: dict) -> str | None:
        tp = tp_mismatch(info.get("attn_tp_size"), self.tp_size)
        if tp is not None:
            return tp
        simulated = simulation_mismatch(info.get("simulated_rank"), self.simulated_rank)
        if simulated is not None:
            return simulated
        if info.get("model") != model_fingerprint(self.pool.config):
            return (
                f"model config differs: prefill serves {info.get('model_path')}, decode "
                f"{self.args.model_path}"
            )
        if info.get("page_size") != self.args.page_size:
            return f"page size: prefill {info.get('page_size')}, decode {self.args.page_size}"
        return layout_mismatch(self.endpoint.layout, info.get("layout") or [])

    def _preallocate(self) -> None:
        waiting = [t for t in self.transfers.values() if t.state == KVPoll.WaitingForInput]
        for t in waiting:
            if t.scores_only:  # needs no memory: its destination goes out at once
                self._send_destination(t)
        ready: list[Transfer] = []
        for t in waiting:
            if t.scores_only:
                continue
            if not self.scheduler.preallocate(t.req):
                break  # FIFO: later requests wait behind this one
            ready.append(t)
        if ready:
            # Hazard: a follower resets a fresh row when it replays rank 0's journal; had it
            # not done so before prefill's writes land, the reset would wipe the request state.
            self.fanout.ask_role([])
        for t in ready:
            self._send_destination(t)

    def _send_destination(self, t: Transfer) -> None:
        req = t.req
        info = self.prefills[t.bootstrap]
        t.rank = info["rank"]
        if t.rank not in self.registered:
            register = Register(
                decode_addr=self.endpoint.addr,
                tp_size=self.tp_size,
                sessions=[m.session for m in self.memory],
                page_addrs=[m.page_addrs for m in self.memory],
                row_addrs=[m.row_addrs for m in self.memory],
                layout=self.endpoint.layout,
            )
            self.endpoint.send(t.rank, register)
            self.registered.add(t.rank)
        dest = Destination(
            room=t.room,
            session=self.endpoint.engine.session_id,
            decode_addr=self.endpoint.addr,
            pages=req.pages,
            row=NO_ROW if t.scores_only else req.row,
            prompt_len=len(req.input_ids),
        )
        # stamped before the send: prefill's stages start when the destinations arrive, and a
        # thread paused between the send and the stamp would end this span inside them (on a
        # loaded host decode's kv_transfer_time came out shorter than prefill's parts of it)
        t.dest_sent_at = time.monotonic()
        self.endpoint.send(t.rank, dest)
        t.state = advance(t.state, KVPoll.Transferring)
        t.deadline = t.dest_sent_at + self.timeouts.waiting
        # finding prefill and waiting for a row and pages (req.queued_at: its arrival here)
        req.stages["decode_prealloc_time"] = t.dest_sent_at - req.queued_at

    def _on_status(self, msg: Status) -> None:
        t = self.transfers.get(msg.room)
        if t is None:
            return
        if msg.status == KVPoll.Success:
            try:
                t.input_logprobs = decode_logprobs(msg.input_logprobs)
            except ValueError as e:  # everything landed: nothing of the room is in flight
                return self._fail(t, f"prefill's success message: {e}", 502, prefill_gone=True)
            t.state = advance(t.state, KVPoll.Success)
            t.req.queued_at = time.monotonic()  # from here it waits for a running slot
            self._prefill_stages(t, msg.stage_times)
        else:
            self._fail(
                t,
                f"prefill failed the handoff: {msg.message or 'no reason'}",
                502,
                prefill_gone=True,
            )

    def _prefill_stages(self, t: Transfer, prefill: dict[str, float]) -> None:
        """Prefill's stages join the request's; the KV transfer is the rest of the time from
        the destinations going out to Success (prefill's wait for the writes, the writes, and
        the control messages' way), so the TTFT parts add up to the time to first token.
        kv_ship_wait_time and kv_write_time are parts of kv_transfer_time, not more of it."""
        stages = t.req.stages
        for name in PREFILL_STAGES:
            stages[name] = float(prefill.get(name, 0.0))
        waited = t.req.queued_at - t.dest_sent_at
        before = ("prefill_arrival_wait_time", "queue_time", "prefill_forward_time")
        stages["kv_transfer_time"] = max(0.0, waited - sum(stages[k] for k in before))

    def _on_abort_ack(self, msg: AbortAck) -> None:
        q = self.quarantine.pop(msg.room, None)
        if q is not None:
            self.scheduler.free(q.holder)

    def _adopt_landed(self) -> None:
        """Transfers that landed (Success) enter the running batch, oldest first, as slots free
        up."""
        aux, landed = self.pool.aux, False
        for t in list(self.transfers.values()):
            if t.state != KVPoll.Success:
                continue
            if t.scores_only:
                self._finish_scored(t)
                continue
            if self.scheduler.free_running_slots <= 0:
                continue  # every later one waits too: FIFO
            req = t.req
            # host memory (AuxRows): no wait for the step in flight
            room, first, cached, ntop = aux.ints[req.row].tolist()
            if room != t.room:
                self._fail(
                    t, f"handoff corrupted: aux row holds room {room}, expected {t.room}", 500
                )
                continue
            logprobs = None
            if req.return_logprob:
                floats = aux.floats[req.row].tolist()
                ids = aux.top_ids[req.row, :ntop].tolist()
                logprobs = [TokenLogprob(first, floats[0], list(zip(ids, floats[1 : 1 + ntop])))]
            aux.ints[req.row] = 0  # a later handoff into this row must write its own room
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
            self.endpoint.send(t.rank, Abort(t.room, self.endpoint.addr))
        if req.row is not None:
            if exposed:
                holder = Req(
                    f"{req.rid}#quarantined", [], req.sampling, row=req.row, pages=list(req.pages)
                )
                self.quarantine[t.room] = Quarantined(
                    holder, t.rank, time.monotonic() + self.timeouts.abort_ack
                )
                req.row, req.pages = None, []
            else:
                self.scheduler.free(req)
        self.scheduler.fail_request(req, message, status)

    # ---- scheduler hooks ----
    def owned(self) -> list[Req]:
        return [t.req for t in self.transfers.values() if t.req.row is not None] + [
            q.holder for q in self.quarantine.values()
        ]

    @property
    def busy(self) -> bool:
        return bool(self.transfers)

    def sockets(self) -> list:
        return [self.endpoint.pull]

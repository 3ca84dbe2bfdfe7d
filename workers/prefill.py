"""The prefill worker's role: wait for decode's destinations, prefill in chunks, ship each chunk's
KV pages as it completes, then the request state rows and the aux row, and answer the HTTP
request (one token) only after the transfer succeeded.

Per room (SGLang's KVPoll, forward only):
    Bootstrapping     the HTTP request is here; decode's destinations are not
    WaitingForInput   destinations arrived; the request is queued in the scheduler
    Transferring      at least one chunk is on its way
    Success | Failed  decode is told; the request's memory is released and reported

Under TP/EP every rank writes its own share (workers/rank_transfer.py); this role runs on rank 0
only and orders the other ranks' writes through the step fanout. A room reaches Success only
once every rank has reported its writes done. A simulated rank R (--simulate-rank) is the only
process: it writes rank R's share to a decode worker simulating the same rank R (checked at the
handshake).
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import dataclass

import httpx
import torch

from serving.distributed import state
from serving.engine.request import Req
from serving.engine.role import Role
from serving.executor.fanout import Fanout
from serving.memory.pool import MemoryPool
from serving.protocol import FAKE_BOOTSTRAP_HOST, GenerateRequest, SamplingParams, SchedulerStats
from serving.server_args import ServerArgs
from workers.kv_endpoint import KVEndpoint
from workers.kv_layout import layout_mismatch, model_fingerprint, tp_mismatch
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
    encode_logprobs,
)
from workers.rank_transfer import JobDone, PeerMemory, RankMemory, RankSender, Ship
from workers.timeouts import Timeouts
from workers.transfer_engine import advertise_host

log = logging.getLogger(__name__)

# While followers still owe writes, rank 0 asks them at most this often (a broadcast + gather).
RANK_POLL_S = 0.01


@dataclass
class Room:
    request: GenerateRequest
    deadline: float
    state: KVPoll = KVPoll.Bootstrapping
    dest: Destination | None = None
    req: Req | None = None
    sent_pages: int = 0
    computed: int = 0  # prompt tokens whose KV the device has finished (chunk_prefilled)
    in_flight: int = 0  # transfer jobs queued or running
    failure: str | None = None
    abort_from: str | None = None  # decode asked to abort: ack once nothing is in flight
    nbytes: int = 0  # written so far, all ranks
    write_s: float = 0.0  # time its writes ran (per job: the slowest rank's)
    final_at: float = 0.0  # when its last write was ordered (its prefill had finished)
    # how long decode's destinations waited here for the request itself (they came first)
    arrival_wait: float = 0.0

    @property
    def scores_only(self) -> bool:
        """max_new_tokens 0 with prompt logprobs: the prompt is scored here and the scores go
        to decode with Success; no KV moves (decode holds no memory for it)."""
        return self.request.sampling.max_new_tokens == 0


@dataclass
class Job:
    """One Ship order: done when no rank is left that still owes its writes."""

    room: int
    final: bool
    left: set[int]  # ranks that have not reported it
    error: str | None = None
    nbytes: int = 0  # written, all ranks so far
    seconds: float = 0.0  # the slowest rank's write time (the ranks write at once)


class PrefillRole(Role):
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.timeouts = Timeouts.from_env()
        self.rooms: dict[int, Room] = {}
        self.by_rid: dict[str, int] = {}
        # decode's destinations or abort that beat the HTTP request, by room
        self.early: dict[int, tuple[float, Destination | Abort]] = {}
        # decode workers that registered (by control address) -> their handshake error (TP size
        # or layout mismatch: every room from that peer fails with it), or None
        self.peers: dict[str, str | None] = {}
        self.to_ship: list[tuple[int, bool]] = []  # (room, final) recorded during the step
        self.orders: list[PeerMemory | Ship] = []  # for every rank, at the end of this poll
        self.jobs: dict[int, Job] = {}
        self.job_ids = itertools.count(1)
        self.last_ask = 0.0
        # for /metrics (report): failed rooms (not client aborts) by where they failed, and the
        # last successful room's transfer
        self.bootstrap_failed = 0
        self.transfer_failed = 0
        self.last_transfer = (0.0, 0.0, 0.0)  # latency ms, speed GB/s, total MB

    def attach(self, scheduler, pool: MemoryPool, fanout: Fanout) -> None:
        super().attach(scheduler, pool, fanout)
        self.pool, self.fanout = pool, fanout
        host = advertise_host(self.args.host)
        self.endpoint = KVEndpoint(pool, host, self.args.disaggregation_ib_device)
        ps = state()
        # the rank processes that write (one when simulated: rank R's share only)
        self.world, self.tp_size = ps.processes, ps.tp_size
        self.simulated_rank = ps.rank if ps.simulated else None
        self.sender = RankSender(
            self.endpoint.engine,
            self.endpoint.page_buffers,
            self.endpoint.row_buffers,
            0,
            self.world,
        )
        self.sender.start()
        self._register_with_bootstrap(host)

    def _register_with_bootstrap(self, host: str) -> None:
        info = {
            "rank_ip": host,
            "rank_port": self.endpoint.port,
            "dp_rank": 0,
            "cp_rank": 0,
            "tp_rank": 0,
            "pp_rank": 0,
            "attn_tp_size": self.tp_size,
            "simulated_rank": self.simulated_rank,
            "attn_cp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "page_size": self.args.page_size,
            "kv_cache_dtype": self.args.kv_cache_dtype,
            "model": model_fingerprint(self.pool.config),
            "model_path": self.args.model_path,
            "layout": self.endpoint.layout,
            "prefill_http_port": self.args.port,
        }
        # the bootstrap server listens on --host (all interfaces when 0.0.0.0)
        bind = self.args.host if self.args.host not in ("", "0.0.0.0", "::") else "127.0.0.1"
        url = f"http://{bind}:{self.args.disaggregation_bootstrap_port}/route"
        body = json.dumps(info).encode()
        for attempt in range(50):
            try:
                headers = {"content-type": "application/json"}
                if self.args.api_key:
                    headers["authorization"] = f"Bearer {self.args.api_key}"
                httpx.put(url, content=body, headers=headers, timeout=5).raise_for_status()
                return
            except httpx.HTTPError as exc:
                if attempt == 49:
                    raise RuntimeError(f"cannot register with the bootstrap server {url}") from exc
                time.sleep(0.1)

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
        room = request.bootstrap_room
        if room is None:
            return self.scheduler.fail_request(
                request, "bootstrap_room is required in PD mode", 400
            )
        if room in self.rooms:
            return self.scheduler.fail_request(
                request, f"bootstrap_room {room} is already in use", 400
            )
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
        self._ship_pending()
        for msg in self.endpoint.receive():
            match msg:
                case Register():
                    self._on_register(msg)
                case Destination():
                    self._on_dest(msg)
                case Abort():
                    self._on_abort(msg)
                case Waiting():
                    self._on_waiting(msg)
                case _:
                    log.warning("unexpected control message at prefill: %s", msg)
        self._drive_ranks()
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

    def _on_register(self, msg: Register) -> None:
        ranks = [RankMemory(*m) for m in zip(msg.sessions, msg.page_addrs, msg.row_addrs)]
        pages, rows = len(self.endpoint.page_buffers), len(self.endpoint.row_buffers)
        error = tp_mismatch(self.tp_size, msg.tp_size) or layout_mismatch(
            self.endpoint.layout, msg.layout
        )
        if not error and (
            not ranks
            or len({len(msg.sessions), len(msg.page_addrs), len(msg.row_addrs)}) != 1
            or any(len(r.page_addrs) != pages or len(r.row_addrs) != rows for r in ranks)
        ):
            error = "the registration's per-rank addresses do not match its layout"
        if error:
            log.error("decode %s refused at handshake: %s", msg.decode_addr, error)
        else:
            self.orders.append(PeerMemory(msg.decode_addr, ranks))
        self.peers[msg.decode_addr] = error

    @property
    def queued(self) -> int:
        return sum(room.state == KVPoll.Bootstrapping for room in self.rooms.values())

    def report(self, stats: SchedulerStats) -> None:
        stats.num_prefill_prealloc_queue_reqs = self.queued
        stats.num_prefill_inflight_queue_reqs = len(self.owned())
        stats.num_bootstrap_failed_reqs_total = self.bootstrap_failed
        stats.num_transfer_failed_reqs_total = self.transfer_failed
        (stats.kv_transfer_latency_ms, stats.kv_transfer_speed_gb_s,
         stats.kv_transfer_total_mb) = self.last_transfer  # fmt: skip

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
        n = len(room.request.input_ids)
        if msg.decode_addr not in self.peers:
            return self._fail(room_id, "decode sent destinations before registering", 502)
        if error := self.peers[msg.decode_addr]:
            return self._fail(room_id, f"prefill/decode mismatch: {error}", 502)
        if msg.prompt_len != n:
            return self._fail(
                room_id,
                f"prompt length differs: prefill has {n} tokens, decode "
                f"{msg.prompt_len} (different tokenizer or chat template?)",
                502,
            )
        if (msg.row == NO_ROW) != room.scores_only or (msg.row == NO_ROW and msg.pages):
            return self._fail(
                room_id,
                "prefill and decode disagree on max_new_tokens: a scoring-only request "
                "(max_new_tokens 0) has no destination memory, any other one has",
                502,
            )
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
                self.to_ship.append((room_id, False))

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
            room.state = advance(room.state, KVPoll.Success)
            scored = encode_logprobs(req.input_logprobs)
            self.endpoint.send(
                room.dest.decode_addr, Status(room_id, int(KVPoll.Success), input_logprobs=scored)
            )
            self._forget(room_id)
            return False
        self.to_ship.append((room_id, True))
        return True

    def _ship_pending(self) -> None:
        pending, self.to_ship = self.to_ship, []
        for room_id, final in pending:
            room = self.rooms.get(room_id)
            if room is None or room.failure is not None:
                continue
            req = room.req
            end = len(req.pages) if final else room.computed // self.pool.plan.page_size
            if end <= room.sent_pages and not final:
                continue
            src, dst = req.pages[room.sent_pages : end], room.dest.pages[room.sent_pages : end]
            room.sent_pages = end
            if final:
                self._write_aux(req, room)
            rows = (req.row, room.dest.row) if final else None
            self._ship(room_id, room, src, dst, rows, final)

    def owned(self) -> list[Req]:
        """Finished requests held until their transfer ends."""
        return [
            r.req
            for r in self.rooms.values()
            if r.req is not None and r.req.finish_reason is not None and r.req.row is not None
        ]

    @property
    def busy(self) -> bool:
        return bool(self.to_ship) or any(r.in_flight for r in self.rooms.values())

    def sockets(self) -> list:
        return [self.endpoint.pull]

    # ---- transfer ----
    def _write_aux(self, req: Req, room: Room) -> None:
        """Host writes into the host part of the aux row: complete when this returns, so before
        the transfer that carries them is posted. EAGLE's proposal and hidden are already
        current on the device (Eagle.extend_draft)."""
        aux = self.pool.aux
        lp = req.last_logprob
        top = lp.top if lp is not None else []
        aux.ints[req.row] = torch.tensor(
            [room.request.bootstrap_room, req.output_ids[-1], req.cached_tokens or 0, len(top)]
        )
        floats = [lp.logprob if lp is not None else 0.0] + [v for _, v in top]
        aux.floats[req.row, : len(floats)] = torch.tensor(floats)
        if top:
            aux.top_ids[req.row, : len(top)] = torch.tensor([t for t, _ in top])

    def _ship(
        self,
        room_id: int,
        room: Room,
        src: list[int],
        dst: list[int],
        rows: tuple[int, int] | None,
        final: bool,
    ) -> None:
        room.state = advance(room.state, KVPoll.Transferring)
        room.in_flight += 1
        if final:
            room.final_at = time.monotonic()
        job = next(self.job_ids)
        self.jobs[job] = Job(room_id, final, set(range(self.world)))
        self.orders.append(Ship(job, room.dest.decode_addr, src, dst, rows))

    def _drive_ranks(self) -> None:
        """Hand this poll's orders to every rank (rank 0's own sender, the followers through the
        fanout) and collect what each rank finished. Followers with writes still owed are asked
        again at most every RANK_POLL_S, with no orders."""
        orders, self.orders = self.orders, []
        # Ships come from processed steps: each was synchronised before its hooks ran. With a
        # later step in flight (overlap) nothing launched since writes a shipped page or row
        # (the prefill worker never decodes; a next chunk writes only later pages, and rows ship
        # with the last chunk), so no event is needed. Without one, process-time device work
        # (EAGLE's draft extend) may still be queued: the sender records an event.
        self.sender.apply(orders, written=self.scheduler.inflight is not None)
        done: list[tuple[int, JobDone]] = [(0, d) for d in self.sender.done()]
        now = time.monotonic()
        owed = any(job.left - {0} for job in self.jobs.values())
        if orders or (owed and now - self.last_ask >= RANK_POLL_S):
            self.last_ask = now
            for rank, finished in enumerate(self.fanout.ask_role(orders), 1):
                done += [(rank, d) for d in finished]
        for rank, d in done:
            job = self.jobs.get(d.job)
            if job is None:
                continue
            job.left.discard(rank)
            job.nbytes += d.nbytes
            job.seconds = max(job.seconds, d.seconds)
            if d.error and job.error is None:
                job.error = f"rank {rank}: {d.error}" if self.world > 1 else d.error
            if not job.left:
                del self.jobs[d.job]
                self._on_job_done(job)

    def _on_job_done(self, job: Job) -> None:
        room = self.rooms.get(job.room)
        if room is None:
            return
        room.in_flight -= 1
        room.nbytes += job.nbytes
        room.write_s += job.seconds
        if job.error and room.failure is None:
            room.failure = f"KV transfer to decode failed: {job.error}"
            log.error("room %d: %s", job.room, room.failure)
            self._notify_failed(job.room, room, 502)
        if job.final and room.failure is None:
            room.state = advance(room.state, KVPoll.Success)
            self.last_transfer = (
                (time.monotonic() - room.final_at) * 1e3,
                room.nbytes / room.write_s / 1e9 if room.write_s > 0 else 0.0,
                room.nbytes / 1e6,
            )
            scored = encode_logprobs(room.req.input_logprobs)
            req = room.req
            now = time.monotonic()
            req.stages["prefill_arrival_wait_time"] = room.arrival_wait
            # the last write ordered -> done: behind other requests' writes, then its own
            req.stages["kv_ship_wait_time"] = max(0.0, now - room.final_at - job.seconds)
            req.stages["kv_write_time"] = job.seconds  # the last write: after the prefill
            stages = {k: req.stages[k] for k in PREFILL_STAGES if k in req.stages}
            success = Status(
                job.room, int(KVPoll.Success), input_logprobs=scored, stage_times=stages
            )
            self.endpoint.send(room.dest.decode_addr, success)
            req.stages["kv_transfer_time"] = now - (req.first_token_at or 0.0)
            self.scheduler.release_held(req, logprobs=_as_list(req.last_logprob))
            self._forget(job.room)
        elif room.failure is not None and room.in_flight == 0 and room.req is not None:
            if room.req.finish_reason is not None:  # held by finished(): report the failure now
                self.scheduler.release_held(room.req, error=room.failure, status=502)
                self._forget(job.room)
            else:  # still in the scheduler: aborting it releases through finished()
                self.scheduler.abort(room.request.rid, room.failure, status=502)

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


def _as_list(lp):
    return [lp] if lp is not None else None

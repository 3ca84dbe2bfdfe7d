"""Prefill's KV shipping: a room's prompt KV goes to decode's destinations as it is computed:
its full pages after every chunk, then the rest of its pages, its request's state rows and its
aux row after the last one. Pages decode's prefix cache holds already (the destination's
decode_prefix_len) are never sent: only the delta past them moves.

The scheduler's hooks only record what to ship (record(): the step's device work is complete
when they run); the role's poll() then turns the records into orders (order()) and hands them
to every rank (drive(): rank 0's own RankSender, the followers through the step fanout), which
returns the jobs every rank has reported done. A room stays in Transferring while any of its
jobs is in flight, and its memory is released only once none is (workers/prefill.py).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from serving.engine.request import Req
from serving.executor.fanout import Fanout
from serving.memory.pool import MemoryPool
from serving.protocol import GenerateRequest
from workers.kv_endpoint import KVEndpoint
from workers.kv_layout import layout_mismatch, tp_mismatch
from workers.messages import NO_ROW, PREFILL_STAGES, Destination, KVPoll, Register, advance
from workers.rank_transfer import JobDone, PeerMemory, RankMemory, RankSender, Ship

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


class Shipping:
    """Rank 0's shipping, for every rank of the worker: decode's memory (registrations, each
    room's destinations) and the writes into it (records, orders, jobs in flight)."""

    def __init__(
        self, endpoint: KVEndpoint, pool: MemoryPool, world: int, tp_size: int, fanout: Fanout
    ) -> None:
        self.endpoint, self.pool, self.fanout = endpoint, pool, fanout
        self.world, self.tp_size = world, tp_size
        self.sender = RankSender(
            endpoint.engine, endpoint.page_buffers, endpoint.row_buffers, 0, world
        )
        self.sender.start()
        # decode workers that registered (by control address) -> their handshake error (TP size
        # or layout mismatch: every room from that peer fails with it), or None
        self.peers: dict[str, str | None] = {}
        self.to_ship: list[tuple[int, bool]] = []  # (room, final) recorded during the step
        self.orders: list[PeerMemory | Ship] = []  # for every rank, at the end of this poll
        self.jobs: dict[int, Job] = {}
        self.job_ids = itertools.count(1)
        self.last_ask = 0.0
        self.last_transfer = (0.0, 0.0, 0.0)  # the last room's: latency ms, GB/s, total MB

    def register(self, msg: Register) -> None:
        """A decode worker registered: every rank learns where its memory is, unless the
        handshake refuses it (the reason is kept: each room from it fails with it)."""
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

    def destination_problem(self, room: Room, msg: Destination) -> str | None:
        """Why the room's KV cannot go to these destinations, or None."""
        n = len(room.request.input_ids)
        if msg.decode_addr not in self.peers:
            return "decode sent destinations before registering"
        if error := self.peers[msg.decode_addr]:
            return f"prefill/decode mismatch: {error}"
        if msg.prompt_len != n:
            return (
                f"prompt length differs: prefill has {n} tokens, decode "
                f"{msg.prompt_len} (different tokenizer or chat template?)"
            )
        page = self.pool.plan.page_size
        held = msg.decode_prefix_len
        if held < 0 or held % page or held > n or held // page > len(msg.pages):
            return (
                f"decode_prefix_len {held} is not whole pages of the prompt ({n} tokens, "
                f"{len(msg.pages)} destination pages of {page})"
            )
        if (msg.row == NO_ROW) != room.scores_only or (msg.row == NO_ROW and (msg.pages or held)):
            return (
                "prefill and decode disagree on max_new_tokens: a scoring-only request "
                "(max_new_tokens 0) has no destination memory, any other one has"
            )
        return None

    def record(self, room_id: int, final: bool) -> None:
        """From a scheduler hook: the room's KV computed so far (final: all of it) is to go."""
        self.to_ship.append((room_id, final))

    @property
    def busy(self) -> bool:
        return bool(self.to_ship)

    def order(self, rooms: dict[int, Room]) -> None:
        """Turn the records into Ship orders: each room's pages not sent yet and not held by
        decode's cache (after the last chunk with its rows, the aux row written first; a last
        order may have no pages)."""
        pending, self.to_ship = self.to_ship, []
        page = self.pool.plan.page_size
        for room_id, final in pending:
            room = rooms.get(room_id)
            if room is None or room.failure is not None:
                continue
            req = room.req
            # decode's cache holds the first pages already (destination_problem: whole pages)
            start = max(room.sent_pages, room.dest.decode_prefix_len // page)
            end = len(req.pages) if final else room.computed // page
            if end <= start and not final:
                continue
            src, dst = req.pages[start:end], room.dest.pages[start:end]
            room.sent_pages = max(start, end)
            if final:
                self._write_aux(req, room)
            rows = (req.row, room.dest.row) if final else None
            self._ship(room_id, room, src, dst, rows, final)

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

    def settle(self, room: Room, job: Job) -> bool:
        """Count a job of `room` that every rank has finished; True when it fails the room."""
        room.in_flight -= 1
        room.nbytes += job.nbytes
        room.write_s += job.seconds
        if job.error and room.failure is None:
            room.failure = f"KV transfer to decode failed: {job.error}"
            return True
        return False

    def landed(self, room: Room, job: Job) -> dict[str, float]:
        """The room's last job is done: its transfer's figures (last_transfer, for /metrics),
        and the stage times of its request that decode adds to its own (PREFILL_STAGES)."""
        self.last_transfer = (
            (time.monotonic() - room.final_at) * 1e3,
            room.nbytes / room.write_s / 1e9 if room.write_s > 0 else 0.0,
            room.nbytes / 1e6,
        )
        req, now = room.req, time.monotonic()
        req.stages["prefill_arrival_wait_time"] = room.arrival_wait
        # the last write ordered -> done: behind other requests' writes, then its own
        req.stages["kv_ship_wait_time"] = max(0.0, now - room.final_at - job.seconds)
        req.stages["kv_write_time"] = job.seconds  # the last write: after the prefill
        req.stages["kv_transfer_time"] = now - (req.first_token_at or 0.0)  # prefill's own view
        return {k: req.stages[k] for k in PREFILL_STAGES if k in req.stages}

    def drive(self, written: bool) -> list[Job]:
        """Hand this poll's orders to every rank (rank 0's own sender, the followers through the
        fanout); the jobs every rank has now finished. Followers with writes still owed are
        asked again at most every RANK_POLL_S, with no orders. `written`: see
        RankSender.apply."""
        orders, self.orders = self.orders, []
        self.sender.apply(orders, written=written)
        done: list[tuple[int, JobDone]] = [(0, d) for d in self.sender.done()]
        now = time.monotonic()
        owed = any(job.left - {0} for job in self.jobs.values())
        if orders or (owed and now - self.last_ask >= RANK_POLL_S):
            self.last_ask = now
            for rank, finished in enumerate(self.fanout.ask_role(orders), 1):
                done += [(rank, d) for d in finished]
        finished_jobs = []
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
                finished_jobs.append(job)
        return finished_jobs

"""One rank's share of a PD handoff under TP/EP: its own Mooncake engine and buffers, and the
writes rank 0 orders it to make.

Who sends what (equal --tp-size on both sides, checked at the handshake): decode rank d is fed
by prefill rank d % P (P prefill ranks, D decode ranks). Each prefill rank writes everything it
holds for the request (its KV pages, its state rows, its aux row) into the matching buffers of
the decode ranks it feeds, so
- head-sharded state (KDA conv and recurrent states) goes from TP rank r to TP rank r (with tp > 1
  both sides have P == D ranks, and rank r holds the same heads on both);
- replicated data (MLA latents, pooled index keys, compression tails, aux rows) reaches every
  decode rank from its own peer: every decode rank ends up with the same bytes, because every
  prefill rank holds the same bytes (they come out of all-reduces; serving/distributed.py), and
  the N copies travel over N rank links at once instead of one (on GPU hosts, N NICs);
- with tp 1 every rank holds everything, so P and D may differ (EP sizes are free).
Only rank 0's aux row holds the host-written columns (room, first token, logprobs); only decode
rank 0 reads them.

Followers never decide: rank 0 broadcasts orders (PeerMemory, then Ship) through the step
fanout (serving/engine/tp_worker.RankFanout.ask_role; workers/shipping.py), every rank turns them
into writes against its own buffers and its decode peers' addresses, and replies with the jobs
it has finished since it was last asked. A job is done when every rank reported it; only then
does prefill say Success.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from serving.distributed import state
from serving.memory.pool import MemoryPool
from serving.server_args import ServerArgs
from workers.kv_layout import Buffer, Writes, page_buffers, page_writes, row_buffers, row_writes
from workers.transfer_engine import MooncakeEngine, TransferError, advertise_host

log = logging.getLogger(__name__)

DESCRIBE = "describe"  # rank 0 asks each follower for its RankMemory (decode, at start-up)


@dataclass(frozen=True)
class RankMemory:
    """What a peer needs to write into one rank: its Mooncake session and buffer bases."""

    session: str
    page_addrs: list[int]
    row_addrs: list[int]


@dataclass(frozen=True)
class PeerMemory:
    """Order: decode worker `key` (its control address) registered; entry d is decode rank d."""

    key: str
    ranks: list[RankMemory]


@dataclass(frozen=True)
class Ship:
    """Order: job `job` writes pages src_pages -> dst_pages of every page buffer to peer `peer`,
    and with `rows` = (src row, dst row) every request-row buffer's row too."""

    job: int
    peer: str
    src_pages: list[int]
    dst_pages: list[int]
    rows: tuple[int, int] | None


def fed_ranks(rank: int, world: int, decode_world: int) -> list[int]:
    """The decode ranks prefill rank `rank` of `world` writes to."""
    return list(range(rank, decode_world, world))


@dataclass(frozen=True)
class JobDone:
    """One rank's report of a Ship order: its error (None: written), the bytes it wrote and
    the seconds its writes ran."""

    job: int
    error: str | None
    nbytes: int
    seconds: float


class RankSender(threading.Thread):
    """This rank's writer: turns orders into Mooncake writes, runs them off the caller's thread
    in order (a room's chunks stay ordered), and reports a JobDone once each is done."""

    def __init__(
        self, engine: MooncakeEngine, pages: list[Buffer], rows: list[Buffer], rank: int, world: int
    ) -> None:
        super().__init__(daemon=True, name="kv-sender")
        self.engine, self.pages, self.rows = engine, pages, rows
        self.rank, self.world = rank, world
        self.peers: dict[str, list[RankMemory]] = {}
        self.jobs: queue.Queue[tuple[int, list[tuple[str, Writes]], torch.cuda.Event | None]] = (
            queue.Queue()
        )
        self.results: queue.Queue[JobDone] = queue.Queue()

    def apply(self, orders: list[PeerMemory | Ship], written: bool = False) -> None:
        """`written`: the caller knows the device work that wrote the shipped pages and rows is
        complete (rank 0 under the overlap scheduler: they come from steps it has synchronised,
        and a step launched after them is in flight, which an event recorded now would also
        wait for)."""
        ready = None
        if not written and any(isinstance(o, Ship) for o in orders) and torch.cuda.is_available():
            # The forward that wrote these pages must be done before Mooncake reads them. The
            # sender thread waits for this event, not the scheduler: a host sync here would idle
            # the GPU once per shipped chunk. Every step runs on this thread's current stream
            # (graphs replay on it too), so an event recorded there after the launches covers
            # the writes, and whatever was launched after them.
            ready = torch.cuda.Event()
            ready.record()
        for order in orders:
            if isinstance(order, PeerMemory):
                self.peers[order.key] = order.ranks
                continue
            targets = self.peers[order.peer]
            writes = []
            for d in fed_ranks(self.rank, self.world, len(targets)):
                target = targets[d]
                w = page_writes(self.pages, target.page_addrs, order.src_pages, order.dst_pages)
                if order.rows is not None:
                    r = row_writes(self.rows, target.row_addrs, *order.rows)
                    w = tuple(a + b for a, b in zip(w, r))
                writes.append((target.session, w))
            self.jobs.put((order.job, writes, ready))

    def run(self) -> None:
        while True:
            job, writes, ready = self.jobs.get()
            error = None
            if ready is not None:
                ready.synchronize()
            t0 = time.perf_counter()
            try:
                for session, w in writes:
                    self.engine.write(session, *w)
            except TransferError as exc:
                error = str(exc)
            nbytes = sum(sum(lens) for _, (_, _, lens) in writes)
            self.results.put(JobDone(job, error, nbytes, time.perf_counter() - t0))

    def done(self) -> list[JobDone]:
        out = []
        while True:
            try:
                out.append(self.results.get_nowait())
            except queue.Empty:
                return out


class FollowerKV:
    """A PD worker's rank > 0: registers its own pool with its own Mooncake engine, describes
    that memory to rank 0 when asked, and makes the writes rank 0 orders. It decides nothing."""

    def __init__(self, args: ServerArgs, pool: MemoryPool) -> None:
        engine = MooncakeEngine(advertise_host(args.host), args.disaggregation_ib_device)
        pages, rows = page_buffers(pool), row_buffers(pool)
        engine.register([(b.addr, b.nbytes) for b in pages + rows])
        self.memory = RankMemory(engine.session_id, [b.addr for b in pages], [b.addr for b in rows])
        ps = state()
        self.sender = RankSender(engine, pages, rows, ps.rank, ps.world)
        self.sender.start()

    def handle(self, payload: str | list) -> RankMemory | list[JobDone]:
        if payload == DESCRIBE:
            return self.memory
        self.sender.apply(payload)
        return self.sender.done()

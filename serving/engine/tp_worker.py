"""What makes N rank processes one worker: rendezvous, rank 0 fanning each step out, and the
followers running it.

Rank 0 runs the Scheduler; before each forward it broadcasts the batch description (request
rows, start positions, token ids, logits mode) and the pool journal (row resets, page maps since
the last forward), never text. With EAGLE it also sends the host inputs of each speculative
program (draft extend, draft+verify, then the committed tokens for roll-back and catch-up).
Followers (Follower below, run by the scheduler process's run_follower) replay the journal into
their own request table and run the same programs; rank 0 samples. Under the overlap
scheduler rank 0 also broadcasts each step's sampled tokens (device to device, Publish), since
the next forward's inputs may name them (FUTURE) before any host has seen them.

Hazard: every rank must enter the same collectives in the same order. So all forwards go
through ModelRunner.forward or Eagle's programs (the fanout points), and a follower never
decides anything itself.
A PD role drives the other ranks' KV transfers the same way (RankFanout.ask_role): rank 0 sends
the role's orders, every follower hands them to its role plug and all of them answer in one
gather, so rank 0 learns what the followers have done without a follower ever acting on its own.
When rank 0 idles, it broadcasts a keepalive every KEEPALIVE_S, so the followers' wait never
reaches the group timeout; a dead peer breaks the gloo connection and every rank exits.
A simulated rank (--simulate-rank) has no followers and no RankFanout: it is the driver alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from serving.distributed import (
    ParallelState,
    broadcast_object,
    broadcast_tensor,
    gather_object,
    init_parallel,
    init_simulated,
)
from serving.engine.profiler import RankProfiler
from serving.executor.fanout import Fanout
from serving.executor.model_runner import ImageRows, ModelRunner, StepInput
from serving.executor.streams import landed_writes
from serving.memory.pool import MemoryPool
from serving.server_args import ServerArgs
from serving.speculative.eagle import Eagle, PendingStep

KEEPALIVE_S = 5.0


# ---- what rank 0 broadcasts: Stop, Keepalive, or a Step (the journal, then one body) ----
@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Keepalive:
    pass


@dataclass(frozen=True)
class Forward:
    items: list[StepInput]
    logits: str | list[bool]
    image_positions: list[int] | None = None  # their rows follow as a tensor broadcast


@dataclass(frozen=True)
class Publish:
    rows: list[int]  # rank 0's sampled tokens for these rows follow as a tensor broadcast


@dataclass(frozen=True)
class ExtendDraft:
    rows: list[int]
    starts: list[int]
    next_tokens: list[list[int]]  # the target hiddens follow as a tensor broadcast
    image_positions: list[int] | None = None  # then their rows, as Forward's


@dataclass(frozen=True)
class Verify:
    host: torch.Tensor  # [3, B] on the host: y, n, rows


@dataclass(frozen=True)
class RollBack:
    padded: list[list[int]]  # the committed tokens per request, padded to N+1
    last: list[int]  # the index of each request's bonus token
    captures: list[tuple[int, int, int]]  # state snapshots the accepted runs crossed


@dataclass(frozen=True)
class RoleOrders:
    payload: object  # the PD role's orders for its follower plug; answered in a gather


@dataclass(frozen=True)
class ProfileOrder:
    order: tuple  # ("start", StartProfile) | ("stop",) | ("cancel",); answered in a gather


Body = Forward | Publish | ExtendDraft | Verify | RollBack | RoleOrders | ProfileOrder


@dataclass(frozen=True)
class Step:
    journal: list[tuple]
    body: Body


class RankFanout(Fanout):
    """Rank 0's fanout under TP/EP. Records the pool's journal from now on."""

    def __init__(self, pool: MemoryPool, followers: int) -> None:
        self.pool, self.followers = pool, followers
        pool.journal = []
        self.last = time.monotonic()

    def send(self, body: Body) -> None:
        broadcast_object(Step(self.pool.take_journal(), body))
        self.last = time.monotonic()

    def forward(
        self, items: list[StepInput], logits: str | list[bool], images: ImageRows | None = None
    ) -> None:
        """Image rows: rank 0 alone runs the vision tower and broadcasts the embeddings it
        made, rather than every rank running its own replica on the same pixel values. A
        follower then keeps no per-request image state (ImagePrefill's held embeddings,
        their frees on abort or retraction: decisions a follower never makes), loads no tower
        and reserves no activations; the pixel values of an image are about as many bytes as
        its embeddings, so sending pixels instead would save no traffic, and would send them
        through the host (a pickled message) rather than device to device. The tower's time
        is rank 0's either way, since replicas would run side by side."""
        self.send(Forward(items, logits, _positions(images)))
        _send_rows(images)

    def publish(self, rows: list[int], tokens: torch.Tensor) -> None:
        self.send(Publish(rows))
        broadcast_tensor(tokens.to(torch.int64).contiguous())

    def extend_draft(
        self,
        rows: list[int],
        starts: list[int],
        next_tokens: list[list[int]],
        hidden: torch.Tensor,
        images: ImageRows | None = None,
    ) -> None:
        self.send(ExtendDraft(rows, starts, next_tokens, _positions(images)))
        broadcast_tensor(hidden)  # followers hold the same hiddens; one copy is simpler
        _send_rows(images)

    def verify(self, host: torch.Tensor) -> None:
        self.send(Verify(host))

    def roll_back(
        self, padded: list[list[int]], last: list[int], captures: list[tuple[int, int, int]]
    ) -> None:
        self.send(RollBack(padded, last, captures))

    def ask_role(self, orders: object) -> list:
        """The journal goes first, so a follower has applied every row reset and page map rank
        0 made before it answers (decode relies on this before it sends destinations out)."""
        return self._ask(RoleOrders(orders))

    def ask_profilers(self, order: tuple) -> list:
        return self._ask(ProfileOrder(order))

    def _ask(self, body: RoleOrders | ProfileOrder) -> list:
        self.send(body)
        return gather_object(None)[1:]

    def keepalive(self) -> None:
        if time.monotonic() - self.last > KEEPALIVE_S:
            broadcast_object(Keepalive())
            self.last = time.monotonic()

    def stop(self) -> None:
        broadcast_object(Stop())


class Follower:
    """A rank > 0: runs each step rank 0 broadcasts on its own shard, pool and programs; its
    role plug (`role`: workers/rank_transfer.FollowerKV on a PD worker, else None) and profiler
    answer rank 0's asks. It decides nothing."""

    def __init__(
        self,
        runner: ModelRunner,
        spec: Eagle | None,
        role,
        profiler: RankProfiler,
        hidden_size: int,
        dtype: torch.dtype,
        decode: bool,
    ) -> None:
        self.runner, self.spec, self.role, self.profiler = runner, spec, role, profiler
        self.pool = runner.pool
        self.hidden_size, self.dtype, self.decode = hidden_size, dtype, decode
        self.pending: PendingStep | None = None  # a verified step waiting for its RollBack

    def follow(self) -> None:
        """Run rank 0's steps until it says stop."""
        while True:
            match broadcast_object():
                case Stop():
                    return
                case Keepalive():
                    continue
                case Step(journal, body):
                    self.pool.replay(journal)
                    self.run(body)

    def run(self, body: Body) -> None:
        device = self.pool.device
        match body:
            case Forward(items, logits, positions):
                if self.decode:
                    landed_writes(device)  # this rank's pool may hold a handoff just adopted
                self.runner.forward(items, logits, self._rows(positions))
            case Publish(rows):
                tokens = torch.empty(len(rows), dtype=torch.int64, device=device)
                self.runner.publish(rows, broadcast_tensor(tokens))
            case ExtendDraft(rows, starts, next_tokens, positions):
                n = sum(len(t) for t in next_tokens)
                hidden = torch.empty(n, self.hidden_size, dtype=self.dtype, device=device)
                hidden = broadcast_tensor(hidden)
                self.spec.extend_draft(rows, starts, next_tokens, hidden, self._rows(positions))
            case Verify(host):
                self.pending = self.spec.verify(host)
            case RollBack(padded, last, captures):
                self.spec.roll_back(self.pending, padded, last, captures)
                self.pending = None
            case RoleOrders(payload):
                gather_object(self.role.handle(payload))
            case ProfileOrder(order):
                gather_object(self.profiler.handle(order))

    def _rows(self, positions: list[int] | None) -> ImageRows | None:
        """Rank 0's image rows at these batch positions (its broadcast, after the message's)."""
        if positions is None:
            return None
        shape = (len(positions), self.hidden_size)
        rows = torch.empty(shape, dtype=self.dtype, device=self.pool.device)
        return ImageRows(positions, broadcast_tensor(rows))


def _positions(images: ImageRows | None) -> list[int] | None:
    return None if images is None else images.positions


def _send_rows(images: ImageRows | None) -> None:
    if images is not None:
        broadcast_tensor(images.embeds.contiguous())


def join_group(args: ServerArgs, rank: int) -> ParallelState:
    """Pick this rank's GPU (--base-gpu-id + local rank) and join the worker's group. With
    --simulate-rank R this process is rank R alone (fake backend), on --base-gpu-id."""
    device = args.resolved_device()
    if device == "cuda":
        torch.cuda.set_device(args.base_gpu_id + rank % args.ranks_per_node)
    if args.simulate_rank is not None:
        return init_simulated(args.simulate_rank, args.tp_size, args.ep_size)
    return init_parallel(
        rank,
        args.tp_size,
        args.ep_size,
        args.dist_init_method(),
        device,
        timeout_s=max(args.watchdog_timeout, 60.0),
    )

"""What makes N rank processes one worker: rendezvous, and rank 0 fanning each forward out.

Rank 0 runs the Scheduler; before each forward it broadcasts the batch description (request
rows, start positions, token ids, logits mode) and the pool journal (row resets, page maps since
the last forward), never text. With EAGLE it also sends the host inputs of each speculative
program (draft extend, draft+verify, then the committed tokens for roll-back and catch-up).
Followers (serving/engine/scheduler_process.run_follower) replay the journal into their own
request table and run the same programs; rank 0 samples. Under the overlap scheduler rank 0
also broadcasts each step's sampled tokens (device to device, "publish"), since the next
forward's inputs may name them (FUTURE) before any host has seen them.

Hazard: every rank must enter the same collectives in the same order. So all forwards go
through ModelRunner.forward or Eagle's programs (the fanout points), and a follower never
decides anything itself.
A PD role drives the other ranks' KV transfers the same way (RankFanout.ask): rank 0 sends the
role's orders, every follower hands them to its role plug and all of them answer in one gather,
so rank 0 learns what the followers have done without a follower ever acting on its own.
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
from serving.executor.model_runner import StepInput
from serving.memory.pool import MemoryPool
from serving.server_args import ServerArgs

KEEPALIVE_S = 5.0
STOP = "stop"
KEEPALIVE = "keepalive"


@dataclass(frozen=True)
class StepMessage:
    """kind: "forward" (payload (items, logits)), "publish" (request rows; rank 0's sampled
    tokens for them follow as a tensor broadcast: the overlap scheduler's FUTURE inputs), or
    one of EAGLE's programs: "extend_draft" ((rows, starts, next tokens); the target hiddens
    follow as a tensor broadcast), "spec_verify" (host [3, B] tensor), "spec_commit" ((padded,
    last, state captures)), "role" (the PD role's orders for its follower plug) or "profile"
    (/start_profile and /stop_profile orders, serving/engine/profiler.py); every follower
    answers those two in a gather."""

    kind: str
    journal: list[tuple]
    payload: object


class RankFanout:
    """Rank 0's end: ModelRunner.fanout. Records the pool's journal from now on."""

    def __init__(self, pool: MemoryPool) -> None:
        self.pool = pool
        pool.journal = []
        self.last = time.monotonic()

    def __call__(self, items: list[StepInput], logits: str | list[bool]) -> None:
        self.send("forward", (items, logits))

    def send(self, kind: str, payload: object) -> None:
        broadcast_object(StepMessage(kind, self.pool.take_journal(), payload))
        self.last = time.monotonic()

    def publish(self, rows: list[int], tokens: torch.Tensor) -> None:
        self.send("publish", rows)
        broadcast_tensor(tokens.to(torch.int64).contiguous())

    def ask(self, payload: object, kind: str = "role") -> list:
        """The followers' answers (ranks 1..N-1, in order) to `payload` (the role's, or a
        profiler order with kind "profile"). The journal
        goes first, so a follower has applied every row reset and page map rank 0 made before
        it answers (decode relies on this before it sends destinations out)."""
        self.send(kind, payload)
        return gather_object(None)[1:]

    def keepalive(self) -> None:
        if time.monotonic() - self.last > KEEPALIVE_S:
            broadcast_object(KEEPALIVE)
            self.last = time.monotonic()

    def stop(self) -> None:
        broadcast_object(STOP)


def join_group(args: ServerArgs, rank: int) -> ParallelState:
    """Pick this rank's GPU (--base-gpu-id + local rank) and join the worker's group. With
    --simulate-rank R this process is rank R alone (fake backend), on --base-gpu-id."""
    device = args.resolved_device()
    if device == "cuda":
        import torch

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

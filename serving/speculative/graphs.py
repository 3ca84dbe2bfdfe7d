"""EAGLE's two device programs per step captured per batch size of the decode ladder: (draft steps
+ verify) and (KDA roll-back + draft catch-up), with the acceptance in between (on the host, or
on the device for an overlapped step). Padding entries use request row 0 and token slot 0, as in
serving/executor/cuda_graph.py."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from serving.executor.cuda_graph import batch_ladder, capture
from serving.forward_batch import ForwardBatch, resolve_future, upload
from serving.memory.pool import MemoryPool

log = logging.getLogger(__name__)


@dataclass
class Verified:
    """What the draft-and-verify program leaves on the device (graph outputs under CUDA graphs)."""

    chains: torch.Tensor  # [B, N] draft tokens d1..dN
    logits: torch.Tensor  # [B*(N+1), V] target logits at positions n..n+N
    hidden: torch.Tensor  # [B*(N+1), Hd] target hiddens there (the draft's catch-up input)
    kda_history: dict[int, list[torch.Tensor]]
    batch: ForwardBatch  # the verify's: the draft's catch-up runs over the same positions
    # the fast path's roll-back table (kernels/triton/kda_roll_back.py), made at the first
    # roll-back from these outputs (a captured program's: in its warm-up)
    kda_table: tuple | None = None


class SpecGraphs:
    """Eagle.draft_and_verify and Eagle.roll_back_and_catch_up (passed in as `verify` and
    `catch_up`, with the same signatures) captured per batch size.

    The second program reads the first's outputs (verify hiddens, KDA history) in place, so a
    step replays both graphs of one size back to back."""

    def __init__(
        self,
        verify: Callable[..., Verified],
        catch_up: Callable[..., None],
        pool: MemoryPool,
        steps: int,
        max_bs: int,
    ) -> None:
        self.verify, self.catch_up = verify, catch_up
        self.sizes = batch_ladder(max_bs, pool.device, steps + 1)
        self.max_seq_len = pool.plan.max_context
        n, width = self.sizes[-1], steps + 1
        self.inputs = torch.zeros(3, n, dtype=torch.int64, device=pool.device)  # y, n, row
        self.committed = torch.zeros(n, width, dtype=torch.int64, device=pool.device)
        self.last = torch.zeros(n, dtype=torch.int64, device=pool.device)
        self.bs = 0  # the size draft_and_verify replayed; roll_back_and_catch_up follows it
        self.graphs: dict[int, tuple] = {}
        pool_handle = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):  # largest first: later ones reuse its memory
            self.graphs[bs] = self._capture(bs, pool_handle)
        log.info("captured EAGLE draft/verify CUDA graphs for batch sizes %s", self.sizes)

    def _capture(self, bs: int, pool_handle):
        tokens, positions, rows = (t[:bs] for t in self.inputs)
        verify_graph, verified = capture(
            lambda: self.verify(tokens, positions, rows, self.max_seq_len),
            pool_handle,
        )
        catch_up_graph, _ = capture(
            lambda: self.catch_up(verified, rows, self.committed[:bs], self.last[:bs]),
            pool_handle,
        )
        return verify_graph, verified, catch_up_graph

    def fits(self, bs: int) -> bool:
        return bs <= self.sizes[-1]

    def _size(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def draft_and_verify(
        self, host: torch.Tensor, future: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[Verified, torch.Tensor, torch.Tensor]:
        """host: [3, n] int64 (y, position, row); padding entries are zeros (row 0). FUTURE
        entries of y and position are read from future = (tokens, positions) by request row.
        Returns the outputs and the device's positions and rows [n] (views of the inputs: valid
        until the next replay)."""
        n = host.shape[1]
        self.bs = self._size(n)
        padded = torch.zeros(3, self.bs, dtype=torch.int64)
        padded[:, :n] = host
        inputs = self.inputs[:, : self.bs]
        inputs.copy_(upload(padded, self.inputs.device))
        if future is not None:
            for i, known in enumerate(future):
                resolve_future(inputs[i], inputs[2], known)
        graph, verified, _ = self.graphs[self.bs]
        graph.replay()
        return verified, inputs[1, :n], inputs[2, :n]

    def roll_back_and_catch_up(self, committed: torch.Tensor, last: torch.Tensor) -> None:
        """committed [n, N+1], last [n] on the device, for the n entries draft_and_verify just
        replayed; the padding entries get zeros."""
        n = last.shape[0]
        self.committed[:n].copy_(committed)
        self.last[:n].copy_(last)
        self.committed[n : self.bs].zero_()
        self.last[n : self.bs].zero_()
        _, _, graph = self.graphs[self.bs]
        graph.replay()

"""CUDA graphs for decode: captured programs per batch size of a ladder.

DecodeGraphs: one target decode forward. SpecGraphs: EAGLE's two device programs per step
(draft steps + verify; KDA roll-back + draft catch-up), with host-side acceptance in between.
Static buffers hold the batch metadata; a batch of n requests replays the graphs of the
smallest captured size >= n. Padding entries point at request row 0 and token slot 0, which the
pools never hand out, so whatever the padding writes lands in reserved memory.
"""

from __future__ import annotations

import logging

import torch

from serving.forward_batch import ForwardBatch
from serving.memory.pool import MemoryPool
from serving.models.glm5_next import ForwardOutput, Glm5NextForCausalLM
from serving.models.layers import DENSE_EXPERTS_MAX_TOKENS
from serving.speculative import Eagle, Verified

log = logging.getLogger(__name__)


def batch_ladder(max_bs: int, tokens_per_req: int = 1) -> list[int]:
    """Captured batch sizes up to max_bs, each holding at most DENSE_EXPERTS_MAX_TOKENS tokens."""
    max_bs = max(1, min(max_bs, DENSE_EXPERTS_MAX_TOKENS // tokens_per_req))
    sizes = [1, 2, 4, 8] + list(range(16, max_bs + 1, 8))
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


def capture(fn, pool_handle):
    """Warm fn up twice on a side stream, then capture it; returns (graph, fn's outputs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up allocator and kernels outside the graph
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool_handle):
        out = fn()
    return graph, out


class DecodeGraphs:
    def __init__(self, model: Glm5NextForCausalLM, pool: MemoryPool, max_bs: int) -> None:
        self.model, self.pool = model, pool
        self.sizes = batch_ladder(max_bs)
        device = pool.device
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.token_slots = torch.zeros(n, dtype=torch.int64, device=device)
        self.req_rows = torch.zeros(n, dtype=torch.int64, device=device)
        self.arange = torch.arange(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, ForwardOutput]] = {}
        pool_handle = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):  # largest first: later ones reuse its memory
            self.graphs[bs] = self._capture(bs, pool_handle)
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def _batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            token_slots=self.token_slots[:bs],
            req_rows=self.req_rows[:bs],
            token_req=self.arange[:bs],
            logit_index=self.arange[:bs],
            starts_cpu=[0] * bs,
            lens_cpu=[1] * bs,
            req_to_token=self.pool.req_to_token,
            max_seq_len=self.pool.plan.max_context,
        )

    def _capture(self, bs: int, pool_handle) -> tuple[torch.cuda.CUDAGraph, ForwardOutput]:
        batch = self._batch(bs)
        return capture(lambda: self.model(batch, self.pool.target), pool_handle)

    def fits(self, bs: int) -> bool:
        return bs <= self.sizes[-1]

    def replay(self, items) -> ForwardOutput:
        n = len(items)
        bs = next(s for s in self.sizes if s >= n)
        pad = bs - n
        rows = [it.row for it in items] + [0] * pad
        starts = [it.start for it in items] + [0] * pad
        host = torch.tensor(
            [[it.token_ids[0] for it in items] + [0] * pad, starts, rows], dtype=torch.int64
        ).to(self.pool.device, non_blocking=True)
        self.input_ids[:bs].copy_(host[0])
        self.positions[:bs].copy_(host[1])
        self.req_rows[:bs].copy_(host[2])
        self.token_slots[:bs].copy_(self.pool.req_to_token[host[2], host[1]])
        graph, out = self.graphs[bs]
        graph.replay()
        return ForwardOutput(logits=out.logits[:n].clone(), hidden=out.hidden[:n].clone())


class SpecGraphs:
    """Eagle.draft_and_verify and Eagle.roll_back_and_catch_up captured per batch size.

    The second program reads the first's outputs (verify hiddens, KDA history) in place, so a
    step replays both graphs of one size back to back."""

    def __init__(self, eagle: Eagle, max_bs: int) -> None:
        self.eagle = eagle
        pool = eagle.pool
        self.sizes = batch_ladder(max_bs, eagle.steps + 1)
        self.max_seq_len = pool.plan.max_context
        n, width = self.sizes[-1], eagle.steps + 1
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
            lambda: self.eagle.draft_and_verify(tokens, positions, rows, self.max_seq_len),
            pool_handle,
        )
        catch_up_graph, _ = capture(
            lambda: self.eagle.roll_back_and_catch_up(
                verified, rows, positions, self.committed[:bs], self.last[:bs], self.max_seq_len
            ),
            pool_handle,
        )
        return verify_graph, verified, catch_up_graph

    def fits(self, bs: int) -> bool:
        return bs <= self.sizes[-1]

    def _size(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def draft_and_verify(self, host: torch.Tensor) -> Verified:
        """host: [3, n] int64 (y, position, row); padding entries are zeros (row 0)."""
        n = host.shape[1]
        self.bs = self._size(n)
        padded = torch.zeros(3, self.bs, dtype=torch.int64)
        padded[:, :n] = host
        self.inputs[:, : self.bs].copy_(padded, non_blocking=True)
        graph, verified, _ = self.graphs[self.bs]
        graph.replay()
        return verified

    def roll_back_and_catch_up(self, committed: list[list[int]], last: list[int]) -> None:
        host = torch.zeros(self.bs, len(committed[0]) + 1, dtype=torch.int64)
        host[: len(last)] = torch.tensor([row + [a] for row, a in zip(committed, last)])
        self.committed[: self.bs].copy_(host[:, :-1], non_blocking=True)
        self.last[: self.bs].copy_(host[:, -1], non_blocking=True)
        _, _, graph = self.graphs[self.bs]
        graph.replay()

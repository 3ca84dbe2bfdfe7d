"""CUDA graphs for decode: captured programs per batch size of a ladder.

DecodeGraphs: one target decode forward (EAGLE's programs: serving/speculative/graphs.py).
Static buffers hold the batch metadata; a batch of n requests replays the graphs of the
smallest captured size >= n. Padding entries point at request row 0 and token slot 0, which the
pools never hand out, so whatever the padding writes lands in reserved memory.
"""

from __future__ import annotations

import logging

import torch

from serving.forward_batch import ForwardBatch, resolve_future, to_device
from serving.layers.mlp import max_captured_tokens
from serving.memory.pool import MemoryPool
from serving.models.glm5_next import ForwardOutput, Glm5NextForCausalLM

log = logging.getLogger(__name__)


def batch_ladder(max_bs: int, device: torch.device, tokens_per_req: int = 1) -> list[int]:
    """Captured batch sizes up to max_bs, each within max_captured_tokens(device)."""
    limit = max_captured_tokens(device)
    if limit is not None:
        max_bs = max(1, min(max_bs, limit // tokens_per_req))
    sizes = [1, 2, 4, 8] + list(range(16, max_bs + 1, 8))
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


def capture(fn, pool_handle, warmups: int = 2, error_mode: str = "global"):
    """Warm fn up on a side stream, then capture it; returns (graph, fn's outputs).
    torch.cuda.graph synchronizes the device and empties the allocator's cache before it
    captures (the warm-ups' blocks go back). error_mode: its capture_error_mode; "thread_local"
    for a capture while the server runs, when other threads (Mooncake's) may call CUDA: under
    "global" their unsafe calls would fail and invalidate the capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):  # warm up allocator and kernels outside the graph
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool_handle, capture_error_mode=error_mode):
        out = fn()
    return graph, out


class DecodeGraphs:
    def __init__(self, model: Glm5NextForCausalLM, pool: MemoryPool, max_bs: int) -> None:
        self.model, self.pool = model, pool
        self.sizes = batch_ladder(max_bs, pool.device)
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
            rows_cpu=[0] * bs,
            req_to_token=self.pool.req_to_token,
            max_seq_len=self.pool.plan.max_context,
        )

    def _capture(self, bs: int, pool_handle) -> tuple[torch.cuda.CUDAGraph, ForwardOutput]:
        batch = self._batch(bs)
        return capture(lambda: self.model(batch, self.pool.target), pool_handle)

    def fits(self, bs: int) -> bool:
        return bs <= self.sizes[-1]

    def replay(self, items, next_tokens: torch.Tensor | None = None) -> ForwardOutput:
        """next_tokens: ModelRunner.next_tokens when some token ids are FUTURE."""
        n = len(items)
        bs = next(s for s in self.sizes if s >= n)
        pad = bs - n
        rows = [it.row for it in items] + [0] * pad
        starts = [it.start for it in items] + [0] * pad
        host = to_device(
            [[it.token_ids[0] for it in items] + [0] * pad, starts, rows],
            torch.int64,
            self.pool.device,
        )
        self.req_rows[:bs].copy_(host[2])
        self.input_ids[:bs].copy_(host[0])
        if next_tokens is not None:
            resolve_future(self.input_ids[:bs], self.req_rows[:bs], next_tokens)
        self.positions[:bs].copy_(host[1])
        self.token_slots[:bs].copy_(self.pool.req_to_token[host[2], host[1]])
        graph, out = self.graphs[bs]
        graph.replay()
        return ForwardOutput(logits=out.logits[:n].clone(), hidden=out.hidden[:n].clone())

"""Turns scheduled work into one model forward: batch metadata from the pools, then the model.

Decode batches (one token per request) replay a captured CUDA graph when one fits
(serving/executor/cuda_graph.py); everything else runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

from serving.forward_batch import ForwardBatch
from serving.memory.pool import MemoryPool
from serving.models.glm5_next import ForwardOutput, Glm5NextForCausalLM


@dataclass
class StepInput:
    """One request's share of a forward: `token_ids` at positions start.. in request row `row`.
    saves: (n, slot) = snapshot the row's KDA state after its first n tokens into state slot
    `slot` (the prefix cache's), n ascending."""

    row: int
    start: int
    token_ids: list[int]
    saves: tuple[tuple[int, int], ...] = ()


class ModelRunner:
    def __init__(self, model: Glm5NextForCausalLM, pool: MemoryPool) -> None:
        self.model, self.pool = model, pool
        self.graphs = None  # set by enable_decode_graphs
        # TP rank 0: called with (items, logits) before every forward, so the other ranks run
        # the same forward (serving/engine/tp_worker.py). Followers leave it None.
        self.fanout = None

    def enable_decode_graphs(self, max_bs: int) -> None:
        from serving.executor.cuda_graph import DecodeGraphs

        self.graphs = DecodeGraphs(self.model, self.pool, max_bs)

    def build_batch(
        self, items: list[StepInput], logits: str | list[bool] = "last"
    ) -> ForwardBatch:
        ids = [t for item in items for t in item.token_ids]
        saves = [list(item.saves) for item in items]
        return ForwardBatch.build(
            ids,
            [item.row for item in items],
            [item.start for item in items],
            [len(item.token_ids) for item in items],
            self.pool.req_to_token,
            logits=logits,
            saves=saves if any(saves) else None,
        )

    def forward(self, items: list[StepInput], logits: str | list[bool] = "last") -> ForwardOutput:
        if self.fanout is not None:
            self.fanout(items, logits)
        if (
            self.graphs is not None
            and logits == "last"
            and all(len(item.token_ids) == 1 and not item.saves for item in items)
            and self.graphs.fits(len(items))
        ):
            return self.graphs.replay(items)
        return self.model(self.build_batch(items, logits), self.pool.target)

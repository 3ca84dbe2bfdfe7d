"""Turns scheduled work into one model forward: batch metadata from the pools, then the model.

Decode batches (one token per request) replay a captured CUDA graph when one fits
(serving/executor/cuda_graph.py); everything else runs eagerly.

The overlap scheduler launches step N+1 before step N's sampled tokens reach the host. Such a
token is FUTURE in the StepInput; publish() left it in `next_tokens` (by request row) on the
device, and the forward reads it from there (resolve_future), so nothing waits for the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serving.executor.fanout import ONE_RANK, Fanout
from serving.forward_batch import FUTURE, ForwardBatch, resolve_future, to_device
from serving.memory.cache import request_rows, save_kda_states
from serving.memory.pool import MemoryPool
from serving.models.glm5_next import ForwardOutput, Glm5NextForCausalLM
from serving.models.vision import VisionTower


@dataclass
class StepInput:
    """One request's share of a forward: `token_ids` at positions start.. in request row `row`.
    saves: (n, slot) = snapshot the row's KDA state after its first n tokens into state slot
    `slot` (the prefix cache's), n ascending."""

    row: int
    start: int
    token_ids: list[int]
    saves: tuple[tuple[int, int], ...] = ()


@dataclass
class ImageRun:
    """Image embeddings one item of a forward takes in place of its tokens' embeddings (its
    <|image|> tokens), rows in order from `offset` tokens into the item."""

    item: int  # the StepInput's index in the forward
    offset: int
    embeds: torch.Tensor  # [rows, hidden] on the model's device


@dataclass
class ImageRows:
    """What a forward (the target's, or the draft's over a prefill chunk) takes in place of some
    token embeddings: the batch's token indices (host ints, ascending; they travel to TP
    followers in the step message) and one row each, in the model dtype (followers receive
    them by a tensor broadcast of that dtype)."""

    positions: list[int]
    embeds: torch.Tensor  # [len(positions), hidden]

    def on(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        return to_device(self.positions, torch.int64, device), self.embeds


def image_rows(lengths: list[int], runs: list[ImageRun], dtype: torch.dtype) -> ImageRows | None:
    """The runs of a batch whose items hold `lengths` tokens each, as batch token indices."""
    if not runs:
        return None
    first = [0]
    for n in lengths:
        first.append(first[-1] + n)
    positions = [
        p
        for run in runs
        for p in range(first[run.item] + run.offset, first[run.item] + run.offset + len(run.embeds))
    ]
    return ImageRows(positions, torch.cat([r.embeds for r in runs]).to(dtype))


class ModelRunner:
    def __init__(
        self,
        model: Glm5NextForCausalLM,
        pool: MemoryPool,
        fanout: Fanout = ONE_RANK,
        vision: VisionTower | None = None,
    ) -> None:
        """fanout: TP rank 0's, told every forward first, so the other ranks run the same
        (serving/engine/tp_worker.py). vision: the tower a prefill step's images run through
        (serving/engine/image_prefill.py), on rank 0 only: the fanout sends its rows to the
        followers (tp_worker.RankFanout.forward says why)."""
        self.model, self.pool, self.fanout, self.vision = model, pool, fanout, vision
        self.graphs = None  # set by enable_decode_graphs
        self.vision_graphs = None  # set by enable_vision_graphs
        # The last token sampled for each request row, on the device (the overlap scheduler's
        # futures). Hazard: a row's entry is valid only until its request's next step samples
        # again; the scheduler keeps at most one step in flight, so a FUTURE always refers to
        # the step launched just before the one that reads it.
        self.next_tokens = torch.zeros(
            request_rows(pool.req_to_token), dtype=torch.int64, device=pool.device
        )

    def publish(self, rows: list[int], tokens: torch.Tensor) -> None:
        """The tokens just sampled (device [len(rows)]) for these request rows, for the next
        step's FUTURE inputs; under TP the other ranks get them too (one broadcast)."""
        if not rows:
            return
        self.fanout.publish(rows, tokens)
        index = to_device(rows, torch.int64, self.pool.device)
        self.next_tokens[index] = tokens.to(torch.int64)

    def mark_step(self) -> torch.cuda.Event | None:
        """An event behind everything launched so far (None off CUDA, where each op has
        finished when it returns): once it is reached, the step's pages and rows are written."""
        if not self.pool.req_to_token.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def enable_decode_graphs(self, max_bs: int) -> None:
        from serving.executor.cuda_graph import DecodeGraphs

        self.graphs = DecodeGraphs(self.model, self.pool, max_bs)

    def enable_vision_graphs(self, max_shapes: int, max_tokens: int) -> None:
        """The tower's images through CUDA graphs, one per image grid, captured on first use
        (max_tokens: one image's most tokens, which sizes the graphs' buffers)."""
        from serving.executor.vision_graphs import VisionGraphs

        assert self.vision is not None, "no vision tower on this rank"
        self.vision_graphs = VisionGraphs(self.vision, max_shapes, max_tokens)

    def build_batch(
        self, items: list[StepInput], logits: str | list[bool], saves: list[list[tuple[int, int]]]
    ) -> ForwardBatch:
        """saves: per item, the snapshots its KDA layers take inside the forward."""
        ids = [t for item in items for t in item.token_ids]
        return ForwardBatch.build(
            ids,
            [item.row for item in items],
            [item.start for item in items],
            [len(item.token_ids) for item in items],
            self.pool.req_to_token,
            logits=logits,
            saves=saves if any(saves) else None,
        )

    def forward(
        self,
        items: list[StepInput],
        logits: str | list[bool] = "last",
        images: ImageRows | None = None,
    ) -> ForwardOutput:
        """images: embeddings that replace some items' token embeddings (a prefill step's)."""
        self.fanout.forward(items, logits, images)
        future = any(FUTURE in item.token_ids for item in items)
        if (
            self.graphs is not None
            and images is None  # a 1-token chunk may be an image token: the graphs take no rows
            and logits == "last"
            and all(len(item.token_ids) == 1 and not item.saves for item in items)
            and self.graphs.fits(len(items))
        ):
            return self.graphs.replay(items, self.next_tokens if future else None)
        # A chunk's snapshot at its end (a miss's only one) is taken once the whole forward is
        # launched, as row copies: inside the KDA layers its host cost delayed the layers'
        # launches (about 1 ms of a 4,096-token miss on the H200). Every rank takes its own
        # (not journaled). An item with a snapshot inside its tokens keeps all of them inside.
        at_end = [all(n == len(item.token_ids) for n, _ in item.saves) for item in items]
        inside = [[] if end else list(item.saves) for item, end in zip(items, at_end)]
        batch = self.build_batch(items, logits, inside)
        if future:
            resolve_future(batch.input_ids, batch.req_rows[batch.token_req], self.next_tokens)
        rows = None if images is None else images.on(self.pool.req_to_token.device)
        out = self.model(batch, self.pool.target, rows)
        after = [
            (item.row, slot) for item, end in zip(items, at_end) if end for _, slot in item.saves
        ]
        if after:
            rows, slots = zip(*after)
            save_kda_states(self.pool.target, list(rows), list(slots))
        return out

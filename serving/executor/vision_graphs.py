"""CUDA graphs for the vision tower: one captured program per image grid.

An image's tower run is launch-bound (~30 ops a block x 24 blocks for ~1 TFLOP at 448x448), and
everything it launches (the shapes, the RoPE tables, the attention segments) is a function of
its grid (t, h, w) alone. VisionGraphs.encode runs one image through its grid's graph, captured
the first time that grid is seen (one eager warm-up, then capture and instantiate) and kept in
an LRU of at most max_shapes grids.

Memory: every graph shares one pool (its own handle, apart from the decode graphs'): the graphs
replay one at a time on the compute stream, so each capture reuses the blocks the others freed.
The graphs read one static pixel buffer and write one static embedding buffer, sized for the
largest grid seen and grown when a grid with more patches comes; growing drops every graph
(recaptured on demand), which frees the pool, so a pool's first capture is its largest (as
DecodeGraphs captures largest first) and the pool holds about that grid's activation peak.
What stays resident is counted as held in the memory plan (vision.graph_bytes); the front
bounds an image's tokens, so the largest grid is bounded too.

Hazards: a capture synchronizes the device and empties the allocator's cache (torch.cuda.graph
does both), so a new image size stalls the step that meets it once; it captures in
"thread_local" mode because the server's other threads may call CUDA meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import torch

from serving.executor.cuda_graph import capture
from serving.models.vision import Grid, VisionTower, num_tokens

log = logging.getLogger(__name__)


class VisionGraphs:
    def __init__(self, tower: VisionTower, max_shapes: int) -> None:
        if max_shapes < 1:
            raise ValueError(f"max_shapes {max_shapes}: must be >= 1")
        self.tower, self.max_shapes = tower, max_shapes
        cfg = tower.config
        self.merge = cfg.spatial_merge_size
        weight = tower.patch_embed.proj.weight
        self.pixel_width = weight[0].numel()  # C * T * P * P
        self.pixels = weight.new_empty(0, self.pixel_width)  # in the tower's dtype
        self.embeds = weight.new_empty(0, cfg.out_hidden_size)
        self.pool_handle = torch.cuda.graph_pool_handle()
        self.graphs: OrderedDict[Grid, torch.cuda.CUDAGraph] = OrderedDict()  # oldest use first
        self.captures = 0  # graphs captured so far (evictions and growth recapture), for tests

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, grid: Grid) -> torch.Tensor:
        """One image's pixel values [t * h * w, C * T * P * P] on the device -> its embeddings
        [num_tokens(grid), out_hidden], as tower(pixel_values, [grid]) computes them. The
        result is a copy of the static output (the caller holds it across steps, and the next
        replay overwrites the buffer). The pixels enter the static buffer through copy_, the
        same cast to the tower's dtype that its patch embedding makes."""
        t, h, w = grid
        patches, rows = t * h * w, num_tokens(grid, self.merge)
        if pixel_values.shape != (patches, self.pixel_width):
            raise ValueError(
                f"grid {grid}: pixel values {tuple(pixel_values.shape)}, expected "
                f"({patches}, {self.pixel_width})"
            )
        self._fit(patches, rows)
        self.pixels[:patches].copy_(pixel_values)  # before a capture: its warm-up reads them
        graph = self.graphs.get(grid)
        if graph is None:
            graph = self._capture(grid, patches, rows)
        else:
            self.graphs.move_to_end(grid)
        graph.replay()
        return self.embeds[:rows].clone()

    def _fit(self, patches: int, rows: int) -> None:
        """Static buffers large enough for this grid; growing them drops every graph (each
        reads and writes the old ones)."""
        if patches <= self.pixels.shape[0]:
            return
        self.graphs.clear()
        self.pixels = self.pixels.new_empty(patches, self.pixel_width)
        self.embeds = self.embeds.new_empty(rows, self.embeds.shape[1])

    def _capture(self, grid: Grid, patches: int, rows: int) -> torch.cuda.CUDAGraph:
        if len(self.graphs) >= self.max_shapes:
            self.graphs.popitem(last=False)  # its pool blocks go to the next capture
        pixels, embeds = self.pixels[:patches], self.embeds[:rows]

        def run() -> None:
            # the tower's own output is freed after the capture: only the static buffers
            # outlive it, so the pool's blocks stay shared among the graphs
            embeds.copy_(self.tower(pixels, [grid]))

        started = time.monotonic()
        graph, _ = capture(run, self.pool_handle, warmups=1, error_mode="thread_local")
        self.graphs[grid] = graph
        self.captures += 1
        log.info(
            "captured the vision tower's CUDA graph for grid %s (%d patches) in %.0f ms; "
            "%d grid(s) held",
            grid,
            patches,
            1000 * (time.monotonic() - started),
            len(self.graphs),
        )
        return graph

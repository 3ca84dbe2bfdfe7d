"""CUDA graphs for the vision tower: one captured program per image grid.

An image's tower run is launch-bound eagerly (~9 kernels a block with the fused elementwise
kernels, ~30 on the torch path, x 24 blocks, for ~1 TFLOP at 448x448), and everything it
launches (the shapes, the RoPE tables, the attention segments) is a function of its grid
(t, h, w) alone. VisionGraphs.encode runs one image through its grid's graph, captured
the first time that grid is seen (one eager warm-up, then capture and instantiate) and kept in
an LRU of at most max_shapes grids.

Memory: every graph shares one pool (its own handle, apart from the decode graphs'), taken
once and kept for the server's life: the graphs replay one at a time on the compute stream, so
each capture reuses the blocks the others freed. The graphs read one static pixel buffer and
write one static embedding buffer, both allocated up front for the largest image the front
admits (max_tokens: the plan's vision_graph_tokens), so no graph ever has to be dropped for a
larger one. What stays resident is counted as held in the memory plan (vision.graph_bytes).
Hazard: captures of growing sizes leave the pool above the largest image's peak (a smaller
image's segments are not reused whole by a larger one's capture): 106 MB over that peak and the
buffers at 1280x720 after 448x448 on the H200, which the plan's CAPTURE_WORKSPACE_BYTES covers.

Hazards: a capture synchronizes the device and empties the allocator's cache (torch.cuda.graph
does both), so a new image size stalls the step that meets it once; it captures in
"thread_local" mode because the server's other threads may call CUDA meanwhile. A pool whose
graphs have all been destroyed cannot be captured into again while it still holds a block
(torch asserts its use count; the H200 hit it when growing buffers dropped every graph: a
library workspace made under the first capture stays in the pool), so eviction keeps at least
one graph: max_shapes >= 2.
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
    def __init__(self, tower: VisionTower, max_shapes: int, max_tokens: int) -> None:
        """max_tokens: the most merged tokens of one image (the front refuses larger images)."""
        if max_shapes < 2:
            raise ValueError(f"max_shapes {max_shapes}: must be >= 2 (the module says why)")
        self.tower, self.max_shapes = tower, max_shapes
        cfg = tower.config
        self.merge = cfg.spatial_merge_size
        weight = tower.patch_embed.proj.weight
        self.pixel_width = weight[0].numel()  # C * T * P * P
        # in the tower's dtype; the largest image's rows, for good
        self.pixels = weight.new_empty(max_tokens * self.merge**2, self.pixel_width)
        self.embeds = weight.new_empty(max_tokens, cfg.out_hidden_size)
        self.pool_handle = torch.cuda.graph_pool_handle()
        self.graphs: OrderedDict[Grid, torch.cuda.CUDAGraph] = OrderedDict()  # oldest use first
        self.captures = 0  # graphs captured so far (evictions recapture), for tests

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
        if rows > self.embeds.shape[0]:
            raise ValueError(
                f"grid {grid}: {rows} image tokens, more than the {self.embeds.shape[0]} the "
                "vision graphs were sized for (the front's --max-image-tokens)"
            )
        self.pixels[:patches].copy_(pixel_values)  # before a capture: its warm-up reads them
        graph = self.graphs.get(grid)
        if graph is None:
            graph = self._capture(grid, patches, rows)
        else:
            self.graphs.move_to_end(grid)
        graph.replay()
        return self.embeds[:rows].clone()

    def _capture(self, grid: Grid, patches: int, rows: int) -> torch.cuda.CUDAGraph:
        if len(self.graphs) >= self.max_shapes:
            self.graphs.popitem(last=False)  # its blocks go to the next capture; >= 1 stays
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

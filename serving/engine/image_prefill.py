"""The vision tower's part of a prefill step: which images a step's chunks need, encoded once
per request in one batch, and the rows each chunk scatters into its input embeddings.

A chunk covers prompt positions [cached, cached + n) of its request; an image covers [start,
start + num_tokens). Chunked prefill may cut through an image: its first chunk encodes it whole
(the tower's attention spans the image) and places the rows that fall inside the chunk; the
embeddings are held until the chunk holding the image's last token has been launched, then
dropped (the forward already read them: stream order keeps the memory alive until it ran).
A request that ends before that (abort, finish, failure) drops them in `free`; a retracted
request re-prefilled later encodes again (nothing is held across a retraction).

With an EAGLE draft (`lookahead` 1) the draft's extend over a chunk [cached, cached + n) takes
the embeddings of positions cached + 1 .. cached + n (each position's next token: nextn.py),
so a chunk also encodes an image that starts just past it, and the embeddings of an image are
held until the draft, too, has read its last row (the extend runs in the step that prefills
that row, before `launched`).

Invariant: `held` has an entry only for a request part-way through an image's run, so it is
empty whenever no request is prefilling (tests check this after every kind of ending).

The images of one step are encoded on the compute stream, before the text model's forward:
with the tower's CUDA graphs (serving/executor/vision_graphs.py; CUDA only) image by image,
each replaying its grid's graph; without them (the CPU, or the graphs off) by one tower call
(patches concatenated; attention stays within each image). A PD prefill worker runs this same
engine, so it encodes the same way; decode never sees images. Under TP/EP only rank 0 encodes
(its fanout sends the rows).
"""

from __future__ import annotations

import numpy as np
import torch

from serving.engine.request import Req
from serving.executor.model_runner import ImageRun
from serving.executor.vision_graphs import VisionGraphs
from serving.models.vision import Grid, VisionTower, num_tokens


class ImagePrefill:
    def __init__(
        self, tower: VisionTower, lookahead: int = 0, graphs: VisionGraphs | None = None
    ) -> None:
        """lookahead: positions past a chunk whose embeddings its step needs (1 with a draft).
        graphs: the tower's CUDA graphs (None: the tower runs eagerly, one call a step)."""
        self.tower, self.lookahead, self.graphs = tower, lookahead, graphs
        self.held: dict[Req, dict[int, torch.Tensor]] = {}  # request -> image index -> embeds
        self.encoded_images = 0  # tower work done, for tests and logs

    def runs(self, plan: list[tuple[Req, int]]) -> list[ImageRun]:
        """The image rows of this step's chunks (plan: request and chunk length, the chunk
        starting at req.cached), encoding the images first seen here in one batch."""
        reach = self.lookahead
        missing = [
            (req, i)
            for req, n in plan
            for i, image in enumerate(req.images)
            if _overlap(req.cached, n + reach, image.start, image.num_tokens)
            and i not in self._of(req)
        ]
        if missing:
            self._encode(missing)
        return [
            run
            for item, (req, n) in enumerate(plan)
            for run in self.rows(item, req, req.cached, req.cached + n)
        ]

    def rows(self, item: int, req: Req, lo: int, hi: int) -> list[ImageRun]:
        """The held image rows of req's prompt positions [lo, hi), as runs of batch item
        `item` whose first token is position lo (encoded by runs() of this step or before)."""
        out = []
        for i, image in enumerate(req.images):
            a, b = max(lo, image.start), min(hi, image.start + image.num_tokens)
            if a < b:
                rows = self.held[req][i][a - image.start : b - image.start]
                out.append(ImageRun(item, a - lo, rows))
        return out

    def launched(self, plan: list[tuple[Req, int]]) -> None:
        """After the step's forward and draft extend were launched (req.cached already
        advanced past it): drop the images whose last token is now prefilled. An image whose
        last token is at req.cached (the draft's lookahead row) stays for the next chunk."""
        for req, _ in plan:
            held = self.held.get(req)
            if held is None:
                continue
            for i in [
                i for i in held if req.images[i].start + req.images[i].num_tokens <= req.cached
            ]:
                del held[i]
            if not held:
                del self.held[req]

    def free(self, req: Req) -> None:
        """The request ended (or left prefill): whatever it holds goes."""
        self.held.pop(req, None)

    def _of(self, req: Req) -> dict[int, torch.Tensor]:
        return self.held.get(req, {})

    @torch.inference_mode()
    def _encode(self, images: list[tuple[Req, int]]) -> None:
        device = self.tower.post_layernorm.weight.device
        inputs = [req.images[i] for req, i in images]
        pixels = np.concatenate([image.pixel_values for image in inputs])
        pixels = torch.from_numpy(pixels).to(device, non_blocking=True)
        grids = [tuple(image.grid_thw) for image in inputs]
        if self.graphs is not None:
            # Attention never crosses images, so each image's rows are the same function of its
            # pixels as in the batched call; but per-image and batched GEMMs (other row counts,
            # other kernels) may round differently in bf16. Each result is a fresh tensor.
            patches = [image.pixel_values.shape[0] for image in inputs]
            parts = [self.graphs.encode(x, g) for x, g in zip(pixels.split(patches), grids)]
        else:
            parts = self._batched(pixels, grids)
        made, rows = [p.shape[0] for p in parts], [image.num_tokens for image in inputs]
        if made != rows:
            raise ValueError(f"the tower made {made} rows for images of {rows} tokens")
        for (req, i), part in zip(images, parts):
            self.held.setdefault(req, {})[i] = part
        self.encoded_images += len(images)

    def _batched(self, pixels: torch.Tensor, grids: list[Grid]) -> list[torch.Tensor]:
        """One tower call over the images' patches concatenated, split image by image."""
        embeds = self.tower(pixels, grids)
        if len(grids) == 1:
            return [embeds]
        m = self.tower.config.spatial_merge_size
        # a view would keep the whole batch's rows alive as long as any one is held
        return [p.clone() for p in embeds.split([num_tokens(g, m) for g in grids])]


def _overlap(cached: int, n: int, start: int, length: int) -> bool:
    return max(cached, start) < min(cached + n, start + length)

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

The images of one step are encoded by one tower call (patches concatenated; attention stays
within each image), on the compute stream, before the text model's forward. A PD prefill
worker runs this same engine, so it encodes the same way; decode never sees images.
"""

from __future__ import annotations

import numpy as np
import torch

from serving.engine.request import Req
from serving.executor.model_runner import ImageRun
from serving.models.vision import VisionTower


class ImagePrefill:
    def __init__(self, tower: VisionTower, lookahead: int = 0) -> None:
        """lookahead: positions past a chunk whose embeddings its step needs (1 with a draft)."""
        self.tower, self.lookahead = tower, lookahead
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
        tower = self.tower
        device = tower.post_layernorm.weight.device
        pixels = np.concatenate([req.images[i].pixel_values for req, i in images])
        grids = [req.images[i].grid_thw for req, i in images]
        embeds = tower(torch.from_numpy(pixels).to(device, non_blocking=True), grids)
        rows = [req.images[i].num_tokens for req, i in images]
        if embeds.shape[0] != sum(rows):
            raise ValueError(f"the tower made {embeds.shape[0]} rows for {sum(rows)} image tokens")
        parts = embeds.split(rows)
        for (req, i), part in zip(images, parts):
            # a view would keep the whole batch's rows alive as long as any one is held
            self.held.setdefault(req, {})[i] = part.clone() if len(parts) > 1 else part
        self.encoded_images += len(images)


def _overlap(cached: int, n: int, start: int, length: int) -> bool:
    return max(cached, start) < min(cached + n, start + length)

"""prepare_kernels: at start-up, run the prefill shapes a worker can meet, so that every Triton
kernel variant they use is compiled, and fla-core's autotuned kernels tuned, before the first
user's request. A variant first met under a request costs that request (and its whole batch)
seconds: the prefix cache's first H200 run showed 10-12 s TTFTs
(docs/notebook/2026-11-29_2026-12-03.md).

What makes a variant: a kernel's constexprs (block sizes picked from the batch: the MoE tile
bucket from tokens per expert, DSA's query block from a request's chunk length, sparse MLA's
split count for short batches), Triton's specialization of integer arguments (== 1, divisible by
16) and fla's autotune keys. The KDA path has one variant per model (kernels/triton/kda.py keeps
its block sizes fixed); the rest varies with token counts. So, through the scheduler as requests
go (the prefix cache on when it is on), with prompts of random tokens:
1. one prompt of a full chunk: fla's chunk kernels autotune at their first call, so they are
   tuned at a full-size prefill, not a tiny one;
2. batches of 2^i and 2^i + 1 tokens, 16 up to --max-prefill-tokens (a batch beyond the chunk
   size is several requests): every size bucket and both integer specializations; from 16 kpool
   tokens up also 2^i + max(16, kpool) (+ 1), whose indexer pool count is not a multiple of 16;
3. several requests at once that hit the cache (1 and G-3 uncached tokens, the state loaded from
   a snapshot), miss with a snapshot inside their chunk (KDA in passes, one pass over a gathered
   token index), branch off a cached prefix (a snapshot at the branch point); one of them
   decodes across a grid position (the tracked snapshot); then hits alone and together, with
   and without a snapshot at their end;
4. with a vision tower and image_tokens (the most tokens the front admits for one image): image
   requests, one of a 448x448 image's grid (or the largest square under the limit), one of an odd
   grid, and one holding both: the tower's kernels are built and, with its CUDA graphs, those
   grids captured (a fresh H200 took 2.3 s over the first 448x448 image, under its request);
then the cache is flushed and the _total counters are zeroed (the warm-up is not traffic).
"""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np

from serving.engine.scheduler import Scheduler
from serving.protocol import FAKE_BOOTSTRAP_HOST, GenerateRequest, ImageInput
from serving.sampling_params import SamplingParams

MAX_STEPS = 100_000  # a warm-up that does not finish is a bug: fail start-up, do not hang
TOKEN_IDS = 1000  # prompt ids are below this (and the vocabulary)


def prepare_kernels(sched: Scheduler, image_tokens: int = 0) -> int:
    """Run the warm-up requests; returns how many ran. image_tokens: one image's most tokens
    (ServerArgs.image_token_limit), 0 for no image requests."""
    cfg = sched.cfg
    rng = random.Random(0)
    vocab = min(TOKEN_IDS, sched.sampler.vocab_size)

    def ids(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    longest = cfg.context_length - 2  # room for the 2 output tokens
    waves: list[list[tuple[list[int], int]]] = []
    waves.append([(ids(min(cfg.chunked_prefill_size, cfg.max_prefill_tokens, longest)), 2)])
    kpool = sched.pool.config.index_kpool
    size = 16
    while size <= cfg.max_prefill_tokens:
        # The indexer's pool count (longest sequence // kpool) is an integer argument too: at
        # 2^i >= 16 kpool tokens it is always divisible by 16, so 2^i + max(16, kpool) (+ 1)
        # tokens give the other case (kpool a power of two), at both parities of the token
        # count. Hits on a long cached prefix meet it first (4,096 cached + 64 new: 260 pools;
        # the notebook's third prefix-cache run, docs/notebook/2026-11-29_2026-12-03.md).
        more = size + max(16, kpool)
        odd_pools = (more, more + 1) if size >= 16 * kpool else ()
        for n in (size, size + 1, *odd_pools):
            parts = -(-n // cfg.chunked_prefill_size)
            if n <= cfg.max_prefill_tokens and parts <= cfg.max_running_requests:
                cut = [n // parts + (i < n % parts) for i in range(parts)]
                waves.append([(ids(k), 2) for k in cut if k <= longest])
        size *= 2
    grid = sched.admission.grid or 64
    if 4 * grid <= longest and cfg.max_running_requests >= 5:
        base = ids(2 * grid + grid // 2)  # a miss, snapshot at 2G inside its chunk: two passes
        waves.append([(base, 2)])
        waves.append(
            [
                (base[: 2 * grid] + ids(1), 2),  # a hit, one uncached token
                (base[: 2 * grid] + ids(grid - 3), 5),  # a hit; decodes across 3G
                (ids(grid + 33), 2),  # misses with snapshots inside: passes, a gathered one
                (ids(2 * grid + 5), 2),
                (base[:grid] + ids(grid + 7), 2),  # branches off base at G: a snapshot there
            ]
        )
        waves.append([(base[: 2 * grid] + ids(grid), 2)])  # a hit, a snapshot at its end
        waves.append([(base[: 2 * grid] + ids(9), 2)])  # a hit, no snapshot
        waves.append([(base[: 2 * grid] + ids(3), 2), (base[: 2 * grid] + ids(5), 2)])
    text = [
        [_request(f"warmup-{i}-{j}", prompt, n) for j, (prompt, n) in enumerate(wave)]
        for i, wave in enumerate(waves)
    ]
    return _run(sched, text + _image_waves(sched, image_tokens, rng))


def _request(rid: str, prompt: list[int], n: int, images=()) -> GenerateRequest:
    return GenerateRequest(
        rid,
        prompt,
        SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True),
        bootstrap_host=FAKE_BOOTSTRAP_HOST,  # local only, as a health check
        images=list(images),
    )


def _image_waves(
    sched: Scheduler, image_tokens: int, rng: random.Random
) -> list[list[GenerateRequest]]:
    """One request per grid, then one holding every grid (a step's several images)."""
    images = sched.prefill.images
    if images is None or image_tokens <= 0:
        return []
    vision, image_token = images.tower.config, sched.pool.config.image_token_id
    merge = vision.spatial_merge_size
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    side = min(16, math.isqrt(image_tokens))  # 16 x 16 merged tokens: a 448x448 image
    grids = [(1, side * merge, side * merge)]
    if image_tokens >= 15:
        grids.append((1, 3 * merge, 5 * merge))  # 60 patches a merge of 2: not a multiple of 16

    def image(grid: tuple[int, int, int], start: int) -> ImageInput:
        patches = grid[0] * grid[1] * grid[2]
        pixels = np.random.default_rng(rng.getrandbits(32)).standard_normal((patches, width))
        tokens = patches // merge**2
        return ImageInput(pixels.astype(np.float32), grid, start, tokens, rng.getrandbits(63))

    waves = []
    for index, group in enumerate([[grid] for grid in grids] + [grids]):
        prompt, inputs = [5, 6, 7], []
        for grid in group:
            inputs.append(image(grid, len(prompt)))
            prompt += [image_token] * inputs[-1].num_tokens + [8, 9]
        waves.append([_request(f"warmup-image-{index}", prompt, 2, inputs)])
    return waves


def _run(sched: Scheduler, waves: list[list[GenerateRequest]]) -> int:
    """Runs the waves one after another (what fits the pool), then leaves nothing behind: no
    request, no cached page, no counter (the warm-up is not traffic)."""
    count = 0
    for wave in waves:
        for request in wave:
            if sched.admission_problem(request) is None:  # a small pool: what fits
                sched.add(request)
                count += 1
        for _ in range(MAX_STEPS):
            if not sched.has_work:
                break
            for out in sched.step():
                if out.finished and out.finish_reason.kind == "abort":
                    raise RuntimeError(f"warm-up request failed: {out.finish_reason.message}")
        else:
            raise RuntimeError("the kernel warm-up did not finish")
    refused = sched.flush_cache()
    if refused is not None:
        raise RuntimeError(f"the kernel warm-up left work behind: {refused}")
    stats = sched.stats
    for f in dataclasses.fields(stats):
        if f.name.endswith("_total"):
            setattr(stats, f.name, f.default)
    if sched.prefill.images is not None:
        sched.prefill.images.encoded_images = 0
    sched.refresh_stats()
    sched.batch_log.rebase()
    return count

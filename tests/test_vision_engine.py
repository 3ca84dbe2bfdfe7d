"""The tiny --vision checkpoint (transformers loads it whole), the tower's loading and memory
plan, and the engine's image prefill in-process (CPU, float32): each image encoded once however
the chunks cut it, its embeddings dropped once its tokens are prefilled or its request ends, and
no prefix-cache hit reaching an image's tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import serving.engine.scheduler as scheduler_mod
from serving.config import ModelConfig
from serving.engine.build import build_engine
from serving.front.api.image_request import content_hash
from serving.front.images import (
    ImageProcessorConfig,
    decode_image,
    expand_image_token_ids,
    preprocess,
)
from serving.models.rank_plan import predict_rank
from serving.models.vision import VisionTower
from serving.protocol import GenerateRequest, ImageInput
from serving.sampling_params import SamplingParams
from serving.server_args import ServerArgs
from serving.tools.tokenizer_build import SPECIAL_TOKENS, VISION_TOKENS
from tests.vision_images import IMAGE_A, IMAGE_B, png

SPECIALS = SPECIAL_TOKENS + VISION_TOKENS  # the last ids of the tiny vision vocabulary


@pytest.fixture(autouse=True)
def check_every_step(monkeypatch):
    monkeypatch.setattr(scheduler_mod, "CHECK_INVARIANTS", True)


def test_the_plan_counts_the_tower_and_its_activations(tiny_vision_ckpt) -> None:
    config = ModelConfig.from_pretrained(tiny_vision_ckpt)
    text_only = ModelConfig.from_dict(
        {
            k: v
            for k, v in json.loads((tiny_vision_ckpt / "config.json").read_text()).items()
            if k != "vision_config"
        }
    )
    sizes = dict(
        tp_size=1, ep_size=1, dtype=torch.bfloat16, context=512, running=4, extra=0,
        speculative_steps=0, page_size=16, mem_fraction_static=0.5, total_memory=2**30,
    )  # fmt: skip
    with_tower = predict_rank(config, **sizes, vision_tokens=8192 + 8000)
    without = predict_rank(text_only, **sizes, vision_tokens=8192 + 8000)
    tower = VisionTower(config.vision, torch.bfloat16)
    assert with_tower.params - without.params == sum(p.numel() for p in tower.parameters())
    assert with_tower.weight_bytes - without.weight_bytes == 2 * sum(
        p.numel() for p in tower.parameters()
    )
    assert with_tower.vision_peak > 0 and without.vision_peak == 0
    assert with_tower.kv_tokens() < without.kv_tokens()
    assert any("vision activations" in line for line in with_tower.lines("x"))


def engine(path, *flags: str):
    args = ServerArgs.from_cli(
        ["--model-path", str(path), "--page-size", "16", "--context-length", "512",
         "--chunked-prefill-size", "16", "--skip-server-warmup", *flags]
    )  # fmt: skip
    args.validate()
    return build_engine(args)[0]


def image_request(
    rid: str, config: ModelConfig, images: list[bytes], n: int = 4, text: int = 3
) -> GenerateRequest:
    """`text` tokens, then per image its placeholder run between its begin/end tokens and
    `text` tokens more."""
    processor = ImageProcessorConfig(min_image_tokens=4, max_image_tokens=64)  # the tiny one's
    done = [preprocess(decode_image(d), processor) for d in images]
    specials = {t: config.vocab_size - len(SPECIALS) + i for i, t in enumerate(SPECIALS)}
    words = [5 + i % 300 for i in range(text)]
    ids = list(words)
    for _ in images:
        ids += [specials["<|begin_of_image|>"], config.image_token_id]
        ids += [specials["<|end_of_image|>"], *words]
    ids, starts = expand_image_token_ids(ids, [d.num_tokens for d in done], config.image_token_id)
    inputs = [
        ImageInput(d.pixel_values, d.grid_thw, s, d.num_tokens, content_hash(data))
        for d, s, data in zip(done, starts, images)
    ]
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    return GenerateRequest(rid, ids, params, images=inputs)


def drain(sched) -> dict[str, tuple[list[int], int]]:
    out: dict[str, tuple[list[int], int]] = {}
    while sched.has_work:
        for o in sched.step():
            tokens, _ = out.get(o.rid, ([], 0))
            out[o.rid] = (tokens + list(o.new_token_ids), o.cached_tokens)
    return out


def test_images_encoded_once_and_dropped_when_prefilled_or_ended(tiny_vision_ckpt) -> None:
    sched = engine(tiny_vision_ckpt)
    images = sched.prefill.images
    config = sched.pool.config
    two = image_request("two", config, [IMAGE_A, IMAGE_B])
    assert all(im.num_tokens > 16 for im in two.images)  # every image spans chunks
    sched.add(two)
    sched.step()
    assert images.encoded_images == 1 and len(images.held) == 1  # only the first chunk's image
    while sched.prefill.queued:
        sched.step()
    assert images.encoded_images == 2 and not images.held  # prefilled: nothing held
    drain(sched)

    sched.add(image_request("aborted", config, [IMAGE_A], n=8))
    sched.step()
    assert len(images.held) == 1
    sched.abort("aborted")
    drain(sched)
    assert not images.held
    sched.check_invariants()


def test_the_prefix_cache_keys_images_by_content(tiny_vision_ckpt) -> None:
    """Two requests whose ids are equal but whose images differ, 70 text tokens before the
    image and 70 after, in chunks of 64 (the grid: the first request caches states at 64 and 128,
    past its image): the second's hit stops at the grid position before its image, with the
    tokens it gets alone; the first's image again hits past the image, with its cold tokens."""
    sched = engine(tiny_vision_ckpt, "--chunked-prefill-size", "64")
    config = sched.pool.config
    other = png(90, 120, 7)

    def request(rid: str, image: bytes) -> GenerateRequest:
        return image_request(rid, config, [image], text=70)

    assert len(request("b", other).input_ids) > 128 and request("b", other).images[0].start < 128
    assert request("b", other).input_ids == request("a", IMAGE_A).input_ids
    alone = drain_one(sched, request("b", other))
    sched.admission.flush()
    cold = drain_one(sched, request("a", IMAGE_A))
    assert cold[1] == 0
    tokens, cached = drain_one(sched, request("b", other))
    assert cached == 64 and tokens == alone[0] != cold[0]
    tokens, cached = drain_one(sched, request("a2", IMAGE_A))
    assert cached == 128 and tokens == cold[0]
    sched.check_invariants()


def test_the_kernel_warmup_encodes_images_and_leaves_nothing(tiny_vision_ckpt, monkeypatch):
    """With a vision tower, the start-up warm-up (engine/kernel_warmup.py, on CUDA: the tower's
    kernels built and its graphs captured before a user's image) runs one image per grid, then
    both in one request, under the front's image token limit; it leaves no row, page, held
    embedding or counter behind, and an image served after it gets a fresh engine's tokens."""
    from serving.engine.kernel_warmup import prepare_kernels

    flags = ("--max-prefill-tokens", "64", "--max-running-requests", "4")
    fresh = engine(tiny_vision_ckpt, *flags)
    served = drain_one(fresh, image_request("a", fresh.pool.config, [IMAGE_A]))
    sched = engine(tiny_vision_ckpt, *flags)
    images = sched.prefill.images
    grids: list[list] = []
    encode = VisionTower.forward

    def recording(self, pixel_values, grid_thw):
        grids.append([tuple(g) for g in grid_thw])
        return encode(self, pixel_values, grid_thw)

    monkeypatch.setattr(VisionTower, "forward", recording)
    assert prepare_kernels(sched, image_tokens=64) > 3
    assert sorted({g for call in grids for g in call}) == [(1, 6, 10), (1, 16, 16)]
    assert images.encoded_images == 0 and not images.held
    assert sched.stats.prompt_tokens_total == 0 and sched.stats.images_encoded_total == 0
    pool = sched.pool
    assert not pool.rows.used and not pool.pages.used and not pool.state_slots.used
    assert drain_one(sched, image_request("a", sched.pool.config, [IMAGE_A])) == served
    sched.check_invariants()
    before = len(grids)
    assert prepare_kernels(sched, image_tokens=0) > 0 and len(grids) == before  # no images


def drain_one(sched, request: GenerateRequest) -> tuple[list[int], int]:
    sched.add(request)
    return drain(sched)[request.rid]


def test_a_text_only_model_refuses_images(tmp_path) -> None:
    import asyncio

    from serving.front.api.errors import APIError
    from serving.front.api.image_request import load_images

    with pytest.raises(APIError, match="does not take images"):
        asyncio.run(load_images(None, ["data:image/png;base64,AAAA"], "messages"))
    assert np.asarray(decode_image(IMAGE_A)).shape == (90, 120, 3)


@pytest.mark.gpu
def test_image_prefill_on_cuda_in_bf16(tiny_vision_ckpt) -> None:
    """The worker's image path on CUDA in bf16 (the tower in the model dtype, decode graphs
    on): a two-image request cut into 16-token chunks beside a text request; each image is
    encoded once, nothing is held after, every output token is a real token."""
    # --max-total-tokens: the suite's GPU tests share one GPU (xdist); sizing the KV pool
    # from free memory took 48 GiB beside them and ran out.
    sched = engine(
        tiny_vision_ckpt, "--device", "cuda", "--dtype", "bfloat16", "--max-total-tokens", "4096"
    )
    images = sched.prefill.images
    assert images.tower.merger.proj.weight.dtype == torch.bfloat16
    assert images.tower.merger.proj.weight.is_cuda
    config = sched.pool.config
    sched.add(image_request("two", config, [IMAGE_A, IMAGE_B], n=8))
    text = GenerateRequest(
        "text",
        list(range(5, 45)),
        SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True),
    )
    sched.add(text)
    out = drain(sched)
    assert images.encoded_images == 2 and not images.held
    for rid in ("two", "text"):
        tokens, _ = out[rid]
        assert len(tokens) == 8 and all(0 <= t < config.vocab_size for t in tokens)
    sched.check_invariants()


@pytest.mark.gpu
def test_vision_graphs_keep_the_greedy_tokens(tiny_vision_ckpt) -> None:
    """The engine on CUDA in bf16 with the tower's CUDA graphs on and off: the same greedy
    tokens for three one-image requests run one after the other (one image a step, so the eager
    path's batched call is the per-image call the graphs replay, bit for bit), each image size
    captured once."""
    import gc

    from tests.vision_images import png

    image_c = png(120, 90, 2)  # IMAGE_A's size turned: another grid
    tokens = {}
    for mode in ("full", "disabled"):
        sched = engine(
            tiny_vision_ckpt,
            *("--device", "cuda", "--dtype", "bfloat16", "--max-total-tokens", "4096"),
            *("--cuda-graph-backend-vision", mode, "--cuda-graph-max-bs-decode", "4"),
        )
        images, config = sched.prefill.images, sched.pool.config
        assert (images.graphs is not None) == (mode == "full")
        got = []
        # a2: A's grid replayed; one more text token first, so no prefix-cache hit skips it
        for rid, image, text in (("a", IMAGE_A, 3), ("c", image_c, 3), ("a2", IMAGE_A, 4)):
            sched.add(image_request(rid, config, [image], n=8, text=text))
            got.append(drain(sched)[rid][0])
        assert images.encoded_images == 3 and not images.held
        if mode == "full":
            assert images.graphs.captures == 2 and len(images.graphs.graphs) == 2
        assert all(len(t) == 8 and all(0 <= x < config.vocab_size for x in t) for t in got)
        tokens[mode] = got
        sched.check_invariants()
        del sched, images
        gc.collect()
        torch.cuda.empty_cache()
    assert tokens["full"] == tokens["disabled"]


@pytest.mark.gpu
def test_the_kernel_warmup_captures_the_common_grids_on_cuda(tiny_vision_ckpt) -> None:
    """On CUDA with the tower's graphs, the start-up warm-up captures its two grids (448x448's
    and an odd one) with the front's limit, and an image of that grid served next replays the
    graph (no capture under the request) with nothing held after."""
    from serving.engine.kernel_warmup import prepare_kernels

    sched = engine(
        tiny_vision_ckpt,
        *("--device", "cuda", "--dtype", "bfloat16", "--max-total-tokens", "4096"),
        *("--cuda-graph-backend-vision", "full", "--cuda-graph-max-bs-decode", "4"),
    )
    graphs = sched.prefill.images.graphs
    assert prepare_kernels(sched, image_tokens=64) > 3
    assert set(graphs.graphs) == {(1, 16, 16), (1, 6, 10)} and graphs.captures == 2
    assert not sched.pool.rows.used and not sched.pool.pages.used
    config = sched.pool.config
    pixels = np.random.default_rng(5).standard_normal((256, graphs.pixel_width), np.float32)
    image = ImageInput(pixels, (1, 16, 16), 3, 64, 12345)
    ids = [5, 6, 7] + [config.image_token_id] * 64 + [8, 9]
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    tokens, _ = drain_one(sched, GenerateRequest("r", ids, params, images=[image]))
    assert graphs.captures == 2 and len(tokens) == 4 and not sched.prefill.images.held
    sched.check_invariants()

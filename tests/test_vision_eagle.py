"""EAGLE on image prompts (issue 45 point 6), in-process on the tiny --vision checkpoint (CPU,
float32, prefill chunks of 16 tokens cutting through every image).

The NextN draft's input at a position is the next token's input embedding: at a position whose
next token is one of a prompt's <|image|> tokens, that image's row as the target took it
(serving/models/nextn.py says why; transformers 5.17 builds no MTP layer for glm5_next, so the
check is against the input embeddings transformers' Glm5NextModel hands its text model, shifted
by one). Greedy tokens with EAGLE (1 and 3 steps, the draft distilled so that drafts are
accepted) equal those without, and nothing is held after."""

from __future__ import annotations

import pytest
import torch

import serving.engine.scheduler as scheduler_mod
from serving.models.nextn import NextNDraft
from tests.server_proc import eagle_flags
from tests.test_vision_engine import drain, engine, image_request
from tests.vision_images import IMAGE_A, IMAGE_B


@pytest.fixture(autouse=True)
def check_every_step(monkeypatch):
    monkeypatch.setattr(scheduler_mod, "CHECK_INVARIANTS", True)


def requests(config) -> list:
    return [
        image_request("one", config, [IMAGE_A], n=10),
        image_request("two", config, [IMAGE_A, IMAGE_B], n=10),
    ]


@pytest.fixture(scope="module")
def plain(distilled_vision_ckpt) -> dict[str, list[int]]:
    sched = engine(distilled_vision_ckpt)
    for r in requests(sched.pool.config):
        sched.add(r)
    return {rid: tokens for rid, (tokens, _) in drain(sched).items()}


@pytest.mark.parametrize("steps", [1, 3])
def test_greedy_with_eagle_equals_without_on_image_prompts(distilled_vision_ckpt, plain, steps):
    """Both requests together (one prefill step encodes images of both), then each alone; the
    draft is distilled, so drafts are accepted."""
    sched = engine(distilled_vision_ckpt, *eagle_flags(steps))
    config = sched.pool.config
    for r in requests(config):
        sched.add(r)
    assert {rid: tokens for rid, (tokens, _) in drain(sched).items()} == plain
    for r in requests(config):
        sched.add(r)
        assert drain(sched)[r.rid][0] == plain[r.rid]
    assert sched.stats.spec_committed_tokens > sched.stats.spec_verify_steps
    assert not sched.prefill.images.held
    sched.check_invariants()


def hf_input_embeds(tiny_vision_ckpt, request) -> torch.Tensor:
    """The input embeddings transformers' Glm5NextModel gives its text model for the request's
    ids and images (image features scattered into the <|image|> rows) [L, H]."""
    from transformers import Glm5NextForConditionalGeneration

    model = Glm5NextForConditionalGeneration.from_pretrained(tiny_vision_ckpt, dtype=torch.float32)
    seen = []
    model.model.language_model.register_forward_pre_hook(
        lambda _, args, kwargs: seen.append(kwargs["inputs_embeds"]), with_kwargs=True
    )
    pixels = torch.cat([torch.from_numpy(im.pixel_values) for im in request.images])
    grids = torch.tensor([im.grid_thw for im in request.images])
    with torch.no_grad():
        model(
            input_ids=torch.tensor([request.input_ids]), pixel_values=pixels, image_grid_thw=grids
        )
    return seen[0][0]


def test_the_draft_sees_the_image_rows_transformers_scatters(tiny_vision_ckpt, monkeypatch):
    """Every prompt position's draft input, recorded over a chunked prefill with two images
    (chunk ends inside the runs, and one just before an image's first token, which that chunk's
    draft extend reads while the target's next chunk takes the image), equals
    transformers' input embedding of the next position; at the last position it is the
    embedding of the first sampled token. At image positions that is not embed(<|image|>)."""
    sched = engine(tiny_vision_ckpt, *eagle_flags(2))
    request = image_request("two", sched.pool.config, [IMAGE_A, IMAGE_B], n=3, text=15)
    assert request.images[0].start == 16  # the first chunk ends just before the image
    length = len(request.input_ids)
    rows: dict[int, torch.Tensor] = {}
    original = NextNDraft.next_embeddings

    def recording(self, target, batch, images):
        out = original(self, target, batch, images)
        for p, row in zip(batch.positions.tolist(), out):
            if p < length:  # the prompt's positions: prefill's extends (decode's come after)
                assert p not in rows
                rows[p] = row.clone()
        return out

    monkeypatch.setattr(NextNDraft, "next_embeddings", recording)
    sched.add(request)
    tokens, _ = drain(sched)["two"]
    assert sorted(rows) == list(range(length))
    want = hf_input_embeds(tiny_vision_ckpt, request)
    got = torch.stack([rows[p] for p in range(length - 1)])
    torch.testing.assert_close(got, want[1:], rtol=1e-5, atol=1e-5)
    model = sched.runner.model
    torch.testing.assert_close(rows[length - 1], model.embed(torch.tensor([tokens[0]]))[0])
    placeholder = model.embed(torch.tensor([sched.pool.config.image_token_id]))[0]
    for image in request.images:
        before = image.start - 1  # its next token is the image's first
        assert not torch.allclose(rows[before], placeholder)
        torch.testing.assert_close(rows[before], want[image.start])
    assert not sched.prefill.images.held
    sched.check_invariants()


def test_prefix_cache_hits_with_eagle_on_image_prompts(tiny_vision_ckpt):
    """The draft's KV at a position depends on the next position's row: with the cache's pair
    keys the same image hits past its run with the tokens of a cold run, and another image of
    the same size (the same ids) only up to the grid position before it."""
    from tests.vision_images import png

    sched = engine(tiny_vision_ckpt, "--chunked-prefill-size", "64", *eagle_flags(2))
    config = sched.pool.config

    def run(rid: str, image: bytes) -> tuple[list[int], int]:
        sched.add(image_request(rid, config, [image], n=10, text=70))
        return drain(sched)[rid]

    cold = run("a", IMAGE_A)
    assert cold[1] == 0
    tokens, cached = run("a2", IMAGE_A)
    assert cached == 128 and tokens == cold[0]
    other = run("b", png(90, 120, 7))
    sched.admission.flush()
    assert other[1] == 64 and run("b2", png(90, 120, 7)) == (other[0], 0)
    assert not sched.prefill.images.held
    sched.check_invariants()


@pytest.mark.gpu
def test_eagle_on_image_prompts_on_cuda_in_bf16(tiny_vision_ckpt):
    """The image path with EAGLE on CUDA in bf16 (its graphs captured): a two-image request cut
    into 16-token chunks beside a text request; every image encoded once, the draft extend
    scattering image rows on the device, speculative steps run, every output token a real
    token, nothing held after."""
    from serving.protocol import GenerateRequest
    from serving.sampling_params import SamplingParams

    sched = engine(
        tiny_vision_ckpt,
        "--device", "cuda", "--dtype", "bfloat16", "--max-total-tokens", "4096",
        *eagle_flags(2),
    )  # fmt: skip
    config = sched.pool.config
    sched.add(image_request("two", config, [IMAGE_A, IMAGE_B], n=12))
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    sched.add(GenerateRequest("text", list(range(5, 45)), params))
    out = drain(sched)
    assert sched.prefill.images.encoded_images == 2 and not sched.prefill.images.held
    for rid in ("two", "text"):
        tokens, _ = out[rid]
        assert len(tokens) == 12 and all(0 <= t < config.vocab_size for t in tokens)
    assert sched.stats.spec_verify_steps > 0
    sched.check_invariants()


def test_eagle_retracts_and_recomputes_image_prompts(distilled_vision_ckpt):
    """Out of KV pages, an EAGLE engine retracts image requests and prefills them again: the
    images are encoded again (nothing was held across the retraction), the tokens are plain
    decoding's, nothing is held after."""
    small = ("--max-total-tokens", "224", "--max-running-requests", "4", "--disable-radix-cache")

    def run(*flags: str):
        sched = engine(distilled_vision_ckpt, *small, *flags)
        config = sched.pool.config
        for i in range(4):
            sched.add(image_request(f"r{i}", config, [IMAGE_A, IMAGE_B][: 1 + i % 2], n=24))
        return sched, {rid: tokens for rid, (tokens, _) in drain(sched).items()}

    _, want = run()
    sched, got = run(*eagle_flags(3))
    assert got == want
    assert sched.stats.retractions > 0
    assert sched.prefill.images.encoded_images > 6  # re-encoded after a retraction
    assert not sched.prefill.images.held
    sched.check_invariants()

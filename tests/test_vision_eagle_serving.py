"""EAGLE on image prompts over real HTTP (float32, CPU, prefill chunks of 16 tokens cutting
through every image; the tiny --vision checkpoint with its draft distilled, so drafts are
accepted): a single worker with EAGLE (3 draft steps) and a PD pair with EAGLE on
both sides (3 steps; prefill runs the tower and the draft over the prompt, decode gets the
target's and the draft's KV and states only) serve chats with one image and with two, with the
greedy tokens and prompt token counts of transformers' generate. Decode's drafts accept as the
single worker's do (the same verify steps and committed tokens): the draft KV prefill made at
the image positions is the one decode drafts from. Nothing is held after, and decode never
runs the tower."""

from __future__ import annotations

import pytest
import torch

from tests.server_proc import Server, eagle_flags
from tests.test_vision_pd import conversation
from tests.test_vision_serving import chat, hf_generate, hf_messages
from tests.vision_images import IMAGE_A, IMAGE_B

FLAGS = ("--context-length", "512", "--chunked-prefill-size", "16")
CASES = [[IMAGE_A], [IMAGE_A, IMAGE_B]]


@pytest.fixture(scope="module")
def single(distilled_vision_ckpt, tmp_path_factory):
    srv = Server(
        distilled_vision_ckpt, *FLAGS, *eagle_flags(3), log_dir=tmp_path_factory.mktemp("eagle")
    )
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def pair(distilled_vision_ckpt, tmp_path_factory):
    pytest.importorskip("mooncake.engine")
    from tests.pd_pair import PDPair

    flags = (*FLAGS, *eagle_flags(3))
    pd = PDPair(
        distilled_vision_ckpt,
        tmp_path_factory.mktemp("eagle-pd"),
        prefill_flags=flags,
        decode_flags=flags,
    )
    yield pd
    pd.stop()


@pytest.fixture(scope="module")
def oracle(distilled_vision_ckpt):
    """transformers' model, image processor and tokenizer, as test_vision_serving's hf."""
    from transformers import AutoTokenizer, Glm5NextForConditionalGeneration
    from transformers.models.glm5_next.image_processing_pil_glm5_next import (
        Glm5NextImageProcessorPil,
    )

    path = distilled_vision_ckpt
    model = Glm5NextForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    return (
        model.eval(),
        Glm5NextImageProcessorPil.from_pretrained(path),
        AutoTokenizer.from_pretrained(path),
    )


def expected(oracle, messages: list, images: list[bytes]) -> tuple[int, str]:
    """(prompt tokens, greedy text) of transformers' generate, 8 tokens."""
    _, _, tokenizer = oracle
    text = tokenizer.apply_chat_template(
        hf_messages(messages), tokenize=False, add_generation_prompt=True
    )
    ids, want = hf_generate(oracle, text, images, 8)
    return len(ids), tokenizer.decode(want, skip_special_tokens=True)


SPEC = ("spec_verify_steps", "spec_committed_tokens")
ACCEPTED: dict[int, tuple[int, ...]] = {}  # per case: the single worker's verify steps, tokens


def spec_counts(server) -> tuple[int, ...]:
    stats = server.idle_pool()
    return tuple(stats[k] for k in SPEC)


@pytest.mark.parametrize("images", CASES, ids=["one", "two"])
def test_single_worker_with_eagle_equals_transformers(single, oracle, images) -> None:
    messages = conversation(images)
    before = spec_counts(single)
    out = chat(single.url, messages)
    ACCEPTED[len(images)] = tuple(b - a for a, b in zip(before, spec_counts(single)))
    steps, tokens = ACCEPTED[len(images)]
    assert tokens > steps  # drafts were accepted
    prompt_tokens, text = expected(oracle, messages, images)
    assert out["usage"]["prompt_tokens"] == prompt_tokens
    assert out["choices"][0]["message"]["content"] == text
    stats = single.idle_pool()
    assert stats["spec_num_steps"] == 3 and stats["spec_verify_steps"] > 0, stats
    assert stats["image_embeddings_held"] == 0


@pytest.mark.parametrize("images", CASES, ids=["one", "two"])
def test_pd_pair_with_eagle_equals_transformers(pair, oracle, images) -> None:
    messages = conversation(images)
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    before = spec_counts(pair.decode)
    got, _ = pair.dispatch("/v1/chat/completions", body)
    assert got.status_code == 200, got.text
    prompt_tokens, text = expected(oracle, messages, images)
    assert got.json()["usage"]["prompt_tokens"] == prompt_tokens
    assert got.json()["choices"][0]["message"]["content"] == text
    pair.idle()
    accepted = tuple(b - a for a, b in zip(before, spec_counts(pair.decode)))
    if len(images) in ACCEPTED:  # the single worker's test ran first (file order)
        assert accepted == ACCEPTED[len(images)]
    prefill, decode = pair.prefill.stats(), pair.decode.stats()
    assert decode["spec_verify_steps"] > 0 and decode["images_encoded_total"] == 0
    assert prefill["image_embeddings_held"] == decode["image_embeddings_held"] == 0

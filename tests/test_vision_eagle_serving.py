"""EAGLE on image prompts over real HTTP (float32, CPU, prefill chunks of 16 tokens cutting
through every image): a single worker with EAGLE (3 draft steps) and a PD pair with EAGLE on
both sides (2 steps; prefill runs the tower and the draft over the prompt, decode gets the
target's and the draft's KV and states only) serve chats with one image and with two, with the
greedy tokens and prompt token counts of transformers' generate. Nothing is held after, and
decode never runs the tower."""

from __future__ import annotations

import pytest

from tests.server_proc import Server, eagle_flags
from tests.test_vision_pd import conversation
from tests.test_vision_serving import chat, hf, hf_generate, hf_messages  # noqa: F401 (hf)
from tests.vision_images import IMAGE_A, IMAGE_B

FLAGS = ("--context-length", "512", "--chunked-prefill-size", "16")
CASES = [[IMAGE_A], [IMAGE_A, IMAGE_B]]


@pytest.fixture(scope="module")
def single(tiny_vision_ckpt, tmp_path_factory):
    srv = Server(
        tiny_vision_ckpt, *FLAGS, *eagle_flags(3), log_dir=tmp_path_factory.mktemp("eagle")
    )
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def pair(tiny_vision_ckpt, tmp_path_factory):
    pytest.importorskip("mooncake.engine")
    from tests.pd_pair import PDPair

    flags = (*FLAGS, *eagle_flags(2))
    pd = PDPair(
        tiny_vision_ckpt,
        tmp_path_factory.mktemp("eagle-pd"),
        prefill_flags=flags,
        decode_flags=flags,
    )
    yield pd
    pd.stop()


def expected(request, messages: list, images: list[bytes]) -> tuple[int, str]:
    """(prompt tokens, greedy text) of transformers' generate, 8 tokens."""
    oracle = request.getfixturevalue("hf")  # test_vision_serving's fixture, loaded once
    _, _, tokenizer = oracle
    text = tokenizer.apply_chat_template(
        hf_messages(messages), tokenize=False, add_generation_prompt=True
    )
    ids, want = hf_generate(oracle, text, images, 8)
    return len(ids), tokenizer.decode(want, skip_special_tokens=True)


@pytest.mark.parametrize("images", CASES, ids=["one", "two"])
def test_single_worker_with_eagle_equals_transformers(single, request, images) -> None:
    messages = conversation(images)
    out = chat(single.url, messages)
    prompt_tokens, text = expected(request, messages, images)
    assert out["usage"]["prompt_tokens"] == prompt_tokens
    assert out["choices"][0]["message"]["content"] == text
    stats = single.idle_pool()
    assert stats["spec_num_steps"] == 3 and stats["spec_verify_steps"] > 0, stats
    assert stats["image_embeddings_held"] == 0


@pytest.mark.parametrize("images", CASES, ids=["one", "two"])
def test_pd_pair_with_eagle_equals_transformers(pair, request, images) -> None:
    messages = conversation(images)
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    got, first = pair.dispatch("/v1/chat/completions", body)
    assert got.status_code == 200, got.text
    prompt_tokens, text = expected(request, messages, images)
    assert got.json()["usage"]["prompt_tokens"] == prompt_tokens
    assert got.json()["choices"][0]["message"]["content"] == text
    pair.idle()
    prefill, decode = pair.prefill.stats(), pair.decode.stats()
    assert decode["spec_verify_steps"] > 0 and decode["images_encoded_total"] == 0
    assert prefill["image_embeddings_held"] == decode["image_embeddings_held"] == 0

"""Images on a TP/EP worker over real HTTP (2 gloo rank processes, CPU, float32, the tiny
--vision checkpoint, prefill chunks of 16 tokens cutting through every image): rank 0 runs the
vision tower and broadcasts the embeddings (serving/engine/tp_worker.py says why), the
followers build no tower. Chats with one image and with two give transformers' greedy tokens
and prompt token counts (the single-rank worker's: tests/test_vision_serving.py), with EAGLE
under TP2 (the draft's image rows go to the followers too) and without under EP2; nothing is
held after."""

from __future__ import annotations

import httpx
import pytest

from tests.server_proc import Server, eagle_flags
from tests.test_vision_eagle_serving import CASES, expected
from tests.test_vision_pd import conversation
from tests.test_vision_serving import chat, hf  # noqa: F401 (hf: the oracle's fixture)

FLAGS = ("--context-length", "512", "--chunked-prefill-size", "16")
WORKERS = {"tp2_eagle": ("--tp-size", "2", *eagle_flags(2)), "ep2": ("--ep-size", "2")}


@pytest.fixture(scope="module", params=list(WORKERS))
def worker(request, tiny_vision_ckpt, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp(request.param)
    srv = Server(tiny_vision_ckpt, *FLAGS, *WORKERS[request.param], log_dir=log_dir)
    yield srv
    assert srv.stop() == 0


@pytest.mark.parametrize("images", CASES, ids=["one", "two"])
def test_image_chat_on_a_tp_worker_equals_one_rank(worker, request, images) -> None:
    messages = conversation(images)
    out = chat(worker.url, messages)
    prompt_tokens, text = expected(request.getfixturevalue("hf"), messages, images)
    assert out["usage"]["prompt_tokens"] == prompt_tokens
    assert out["choices"][0]["message"]["content"] == text
    stats = worker.idle_pool()
    assert stats["image_embeddings_held"] == 0 and stats["images_encoded_total"] > 0


def test_tp2_eagle_drafts_accept_as_one_rank(distilled_vision_ckpt, tmp_path) -> None:
    """The draft's image rows reach the followers: with a distilled draft (drafts accepted), a
    TP2 EAGLE worker's greedy tokens, verify steps and committed tokens for /generate with two
    images equal the one-rank engine's. A follower whose draft took embed(<|image|>) instead
    changes the sharded draft's proposals after this prompt: 15 tokens committed, not 17."""
    from serving.tools.tokenizer_build import SPECIAL_TOKENS, VISION_TOKENS
    from tests.test_vision_eagle_serving import SPEC
    from tests.test_vision_engine import drain, engine, image_request
    from tests.vision_images import IMAGE_A, IMAGE_B, data_url

    one = engine(distilled_vision_ckpt, "--context-length", "512", *eagle_flags(3))
    config = one.pool.config
    want = image_request("r", config, [IMAGE_A, IMAGE_B], n=16, text=20)
    one.add(want)
    tokens, _ = drain(one)["r"]
    counts = tuple(getattr(one.stats, k) for k in SPEC)
    assert counts[1] > counts[0]  # drafts were accepted

    specials = SPECIAL_TOKENS + VISION_TOKENS
    first = config.vocab_size - len(specials)  # as image_request: the last ids
    image = [first + specials.index(t) for t in ("<|begin_of_image|>", "<|end_of_image|>")]
    image.insert(1, config.image_token_id)
    words = [5 + i for i in range(20)]
    ids = words + image + words + image + words
    srv = Server(distilled_vision_ckpt, *FLAGS, "--tp-size", "2", *eagle_flags(3), log_dir=tmp_path)
    try:
        before = srv.idle_pool()  # after the start-up warm-up's requests
        body = {
            "input_ids": ids,
            "image_data": [data_url(IMAGE_A), data_url(IMAGE_B)],
            "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True},
        }
        r = httpx.post(srv.url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["prompt_tokens"] == len(want.input_ids)
        assert r.json()["output_ids"] == tokens
        stats = srv.idle_pool()
        assert tuple(stats[k] - before[k] for k in SPEC) == counts
        assert stats["image_embeddings_held"] == 0
    finally:
        assert srv.stop() == 0


def test_image_chat_through_a_tp2_pd_pair(tiny_vision_ckpt, request, tmp_path) -> None:
    """PD with both workers TP2 (4 rank processes): prefill's rank 0 encodes, decode's ranks
    build no tower; a two-image chat gives transformers' tokens; nothing is held after."""
    pytest.importorskip("mooncake.engine")
    from tests.pd_pair import PDPair

    images = CASES[1]
    pair = PDPair(
        tiny_vision_ckpt,
        tmp_path,
        prefill_flags=(*FLAGS, "--tp-size", "2"),
        decode_flags=(*FLAGS, "--tp-size", "2"),
    )
    try:
        messages = conversation(images)
        body = {"messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        got, _ = pair.dispatch("/v1/chat/completions", body)
        assert got.status_code == 200, got.text
        prompt_tokens, text = expected(request.getfixturevalue("hf"), messages, images)
        assert got.json()["usage"]["prompt_tokens"] == prompt_tokens
        assert got.json()["choices"][0]["message"]["content"] == text
        pair.idle()
        prefill, decode = pair.prefill.stats(), pair.decode.stats()
        assert prefill["images_encoded_total"] == 2 and decode["images_encoded_total"] == 0
        assert prefill["image_embeddings_held"] == decode["image_embeddings_held"] == 0
    finally:
        pair.stop()

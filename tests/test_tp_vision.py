"""Images on a TP/EP worker over real HTTP (2 gloo rank processes, CPU, float32, the tiny
--vision checkpoint, prefill chunks of 16 tokens cutting through every image): rank 0 runs the
vision tower and broadcasts the embeddings (serving/engine/tp_worker.py says why), the
followers build no tower. Chats with one image and with two give transformers' greedy tokens
and prompt token counts (the single-rank worker's: tests/test_vision_serving.py), with EAGLE
under TP2 (the draft's image rows go to the followers too) and without under EP2; nothing is
held after."""

from __future__ import annotations

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
    prompt_tokens, text = expected(request, messages, images)
    assert out["usage"]["prompt_tokens"] == prompt_tokens
    assert out["choices"][0]["message"]["content"] == text
    stats = worker.idle_pool()
    assert stats["image_embeddings_held"] == 0 and stats["images_encoded_total"] > 0

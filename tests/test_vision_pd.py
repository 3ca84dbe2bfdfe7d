"""Images through a PD pair behind our router (Mooncake over loopback, float32, CPU): a chat
with one image and with two gives the single worker's greedy tokens and prompt token counts.
Prefill runs the tower; decode's front only counts each image's tokens (from the image's
header: no pixels decoded, nothing preprocessed) and its scheduler receives KV and states
only: it builds no tower, encodes no image and holds no embeddings. Nothing leaks on either
worker. The prefill worker's prefix cache keys images by content."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from serving.front.api.image_request import VisionSetup, _process
from serving.front.images import ImageError, ImageProcessorConfig
from serving.front.media import MediaPolicy
from tests.server_proc import Server
from tests.test_vision import IMAGES
from tests.test_vision_serving import chat, image_part
from tests.vision_images import IMAGE_A, IMAGE_B, png

FLAGS = ("--context-length", "512", "--chunked-prefill-size", "16")


def test_decode_front_counts_what_prefill_preprocesses() -> None:
    """Decode's front: the same grid and token count as the full preprocessing (EXIF rotation,
    a GIF's first frame, odd sizes), the same over-the-limit refusal, and no pixels."""
    full = VisionSetup(ImageProcessorConfig(), 1, None, 4, 8000, MediaPolicy.of(None, None, 1.0))
    counts = dataclasses.replace(full, counts_only=True)
    for data in (f() for f in IMAGES.values()):
        want, got = _process(data, full), _process(data, counts)
        assert (got.grid_thw, got.num_tokens) == (want.grid_thw, want.num_tokens)
        assert got.pixel_values is None and want.pixel_values is not None
    limited = dataclasses.replace(counts, max_tokens=16)
    with pytest.raises(ImageError, match="over the limit of 16 per image"):
        _process(IMAGES["png_1280x720"](), limited)


@pytest.fixture(scope="module")
def single(tiny_vision_ckpt, tmp_path_factory):
    srv = Server(tiny_vision_ckpt, *FLAGS, log_dir=tmp_path_factory.mktemp("single"))
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def stack(tiny_vision_ckpt, tmp_path_factory):
    pytest.importorskip("mooncake.engine")
    from tests.pd_pair import PDPair
    from tests.router_proc import RouterProc

    logs = tmp_path_factory.mktemp("vision-pd")
    pair = PDPair(tiny_vision_ckpt, logs, prefill_flags=FLAGS, decode_flags=FLAGS)
    try:
        router = RouterProc(
            "--pd-disaggregation",
            "--prefill", pair.prefill.url, str(pair.bootstrap_port),
            "--decode", pair.decode.url,
            "--health-check-interval-secs", "0.2",
            "--health-success-threshold", "1",
            log_dir=logs,
        )  # fmt: skip
    except Exception:
        pair.stop()
        raise
    try:
        router.wait_ready()
        yield router, pair
    finally:
        code = router.stop()
        pair.stop()
    assert code == 0


def conversation(images: list[bytes]) -> list[dict]:
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}]}]
    messages[0]["content"].append(image_part(images[0]))
    if len(images) > 1:
        messages += [
            {"role": "assistant", "content": "A picture."},
            {"role": "user", "content": [image_part(images[1]), {"type": "text", "text": "And?"}]},
        ]
    return messages


@pytest.mark.parametrize("images", [[IMAGE_A], [IMAGE_A, IMAGE_B]], ids=["one", "two"])
def test_pd_chat_equals_the_single_worker(stack, single, images) -> None:
    router, pair = stack
    messages = conversation(images)
    encoded = pair.prefill.stats()["images_encoded_total"]
    want = chat(single.url, messages)
    got = chat(router.url, messages)
    assert got["usage"] == want["usage"]
    assert got["choices"][0]["message"] == want["choices"][0]["message"]
    pair.idle()
    prefill, decode = pair.prefill.stats(), pair.decode.stats()
    assert prefill["images_encoded_total"] == encoded + len(images)
    assert decode["images_encoded_total"] == 0  # decode never runs the tower
    assert prefill["image_embeddings_held"] == decode["image_embeddings_held"] == 0


def test_pd_generate_image_data_equals_the_single_worker(stack, single) -> None:
    """/generate's image_data through the router; then decode alone (SGLang's fake bootstrap
    host: it would prefill locally) refuses images: its front kept no pixels to encode."""
    router, pair = stack
    text = "<|user|>look <|begin_of_image|><|image|><|end_of_image|><|assistant|>"
    body = {
        "text": text,
        "image_data": [image_part(IMAGE_B)["image_url"]["url"]],
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
    }
    want = httpx.post(single.url + "/generate", json=body, timeout=60).json()
    got = httpx.post(router.url + "/generate", json=body, timeout=60)
    assert got.status_code == 200, got.text
    assert got.json()["output_ids"] == want["output_ids"]
    assert got.json()["meta_info"]["prompt_tokens"] == want["meta_info"]["prompt_tokens"]
    alone = {**body, "bootstrap_host": "2.2.2.2", "bootstrap_room": 0}
    r = httpx.post(pair.decode.url + "/generate", json=alone, timeout=60)
    assert r.status_code == 400 and "PD decode prefills no images" in r.text, r.text
    pair.idle()


def test_pd_prefill_hits_the_same_image_past_it(stack, tiny_vision_ckpt) -> None:
    """Prefill's prefix cache keys images by content: the same image again hits past its run
    (prefill encodes nothing; decode reports the hit) with the first run's tokens; another
    image of the same size (the same ids) hits only the text before it."""
    from transformers import AutoTokenizer

    router, pair = stack
    tok = AutoTokenizer.from_pretrained(tiny_vision_ckpt)
    names = ("<|begin_of_image|>", "<|image|>", "<|end_of_image|>")
    text = [100 + (7 * i) % 900 for i in range(140)]
    ids = text[:70] + [tok.convert_tokens_to_ids(n) for n in names] + text[70:]

    def generate(image: bytes) -> dict:
        body = {
            "input_ids": ids,
            "image_data": image_part(image)["image_url"]["url"],
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        }
        r = httpx.post(router.url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    httpx.post(pair.prefill.url + "/flush_cache", timeout=30)
    first = generate(IMAGE_A)
    encoded = pair.prefill.stats()["images_encoded_total"]
    again = generate(IMAGE_A)
    assert again["meta_info"]["cached_tokens"] == 128  # the image's run is [71, 91)
    assert again["output_ids"] == first["output_ids"]
    assert pair.prefill.stats()["images_encoded_total"] == encoded  # served from the cache
    other = generate(png(90, 120, 7))
    assert other["meta_info"]["cached_tokens"] == 64
    pair.idle()


def test_decode_builds_no_tower(stack) -> None:
    """Decode loads no tower weights and keeps no activation reserve: its memory plan has no
    vision line, and it matches what was built (no warning)."""
    _, pair = stack
    prefill, decode = pair.prefill.log_path.read_text(), pair.decode.log_path.read_text()
    assert "vision activations" in prefill and "vision activations" not in decode
    assert "the plan predicts" not in decode

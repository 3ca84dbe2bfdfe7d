"""Images served end to end on the single worker, over real HTTP (float32, CPU): the tiny
--vision checkpoint's greedy tokens and prompt token counts, with one image and with two, equal
transformers 5.17's generate on its own processing of the same images (its image processor,
its chat template rendering, the placeholder expansion as Glm5NextProcessor does it). Prefill
chunks of 16 tokens cut through every image's tokens. Then every refusal is a 400 naming the
problem, the server keeps serving, and no image embeddings outlive their request."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import torch

from tests.server_proc import Server
from tests.vision_images import IMAGE_A, IMAGE_B, data_url, png

CHUNK = 16  # prefill chunk: smaller than every image's run, so chunks cut through images
MAX_IMAGE_TOKENS = 48


class _Media(BaseHTTPRequestHandler):
    """/a.png answers at once, /slow.png after 5 s (past the server's fetch timeout, 3 s)."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/slow.png":
            time.sleep(5)
        try:
            self.send_response(200)
            self.send_header("content-type", "image/png")
            self.end_headers()
            self.wfile.write(IMAGE_A)
        except BrokenPipeError:  # the server gave up waiting (the timeout under test)
            pass

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def media_host():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Media)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def local_media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "a.png").write_bytes(IMAGE_A)
    return root


@pytest.fixture(scope="module")
def server(tiny_vision_ckpt, local_media, tmp_path_factory):
    srv = Server(
        tiny_vision_ckpt,
        "--context-length", "512",
        "--chunked-prefill-size", str(CHUNK),
        "--max-images-per-request", "3",
        "--max-image-tokens", str(MAX_IMAGE_TOKENS),
        "--allowed-media-domains", "127.0.0.1",
        "--allowed-local-media-path", str(local_media),
        "--media-fetch-timeout", "3",
        log_dir=tmp_path_factory.mktemp("logs"),
    )  # fmt: skip
    yield srv
    assert srv.stop() == 0


@pytest.fixture(autouse=True)
def leak_free(request, server):
    yield
    stats = server.idle_pool()
    assert stats["image_embeddings_held"] == 0


@pytest.fixture(scope="module")
def hf(tiny_vision_ckpt):
    """transformers' model, image processor and tokenizer (with the checkpoint's template)."""
    from transformers import AutoTokenizer, Glm5NextForConditionalGeneration
    from transformers.models.glm5_next.image_processing_pil_glm5_next import (
        Glm5NextImageProcessorPil,
    )

    model = Glm5NextForConditionalGeneration.from_pretrained(tiny_vision_ckpt, dtype=torch.float32)
    return (
        model.eval(),
        Glm5NextImageProcessorPil.from_pretrained(tiny_vision_ckpt),
        AutoTokenizer.from_pretrained(tiny_vision_ckpt),
    )


def hf_generate(hf, text: str, images: list[bytes], n: int) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy output ids): transformers' processing and generate."""
    from transformers import GenerationConfig
    from transformers.image_utils import load_image

    model, processor, tokenizer = hf
    loaded = [load_image(data_url(d)) for d in images]
    pixels = processor(loaded, return_tensors="pt") if images else {}
    for grid in pixels.get("image_grid_thw", []):  # Glm5NextProcessor's replacement, in order
        text = text.replace("<|image|>", "<|placeholder|>" * (int(grid.prod()) // 4), 1)
    text = text.replace("<|placeholder|>", "<|image|>")
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(input_ids=ids, generation_config=config, **pixels)
    return ids[0].tolist(), out[0, ids.shape[1] :].tolist()


def chat(url: str, messages: list, n: int = 8, status: int = 200) -> dict:
    body = {"messages": messages, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


def hf_messages(messages: list) -> list:
    """The same conversation for transformers' template: image parts as {"type": "image"}."""
    return [
        {**m, "content": [p if p["type"] == "text" else {"type": "image"} for p in m["content"]]}
        if isinstance(m["content"], list)
        else m
        for m in messages
    ]


# ---- equal to transformers ----


@pytest.mark.parametrize("images", [[IMAGE_A], [IMAGE_A, IMAGE_B]], ids=["one", "two"])
def test_chat_equals_transformers(server, hf, images) -> None:
    """One image; two, one per user turn of a conversation (the second turn before its text)."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}]}]
    messages[0]["content"].append(image_part(images[0]))
    if len(images) > 1:
        messages += [
            {"role": "assistant", "content": "A picture."},
            {"role": "user", "content": [image_part(images[1]), {"type": "text", "text": "And?"}]},
        ]
    out = chat(server.url, messages)
    _, _, tokenizer = hf
    text = tokenizer.apply_chat_template(
        hf_messages(messages), tokenize=False, add_generation_prompt=True
    )
    ids, want = hf_generate(hf, text, images, 8)
    assert out["usage"]["prompt_tokens"] == len(ids)
    image_tokens = sum(1 for t in ids if t == tokenizer.convert_tokens_to_ids("<|image|>"))
    assert out["usage"]["prompt_tokens_details"]["image_tokens"] == image_tokens
    assert image_tokens > CHUNK  # the chunks cut through the images
    assert out["choices"][0]["message"]["content"] == tokenizer.decode(
        want, skip_special_tokens=True
    )


def test_generate_image_data_equals_transformers(server, hf) -> None:
    """SGLang's /generate with image_data: a batch of two prompts (one with two images, one
    with another image; both in one prefill step, their images encoded in one tower call),
    token for token."""
    text = "<|user|>first <|begin_of_image|><|image|><|end_of_image|> then "
    text += "<|begin_of_image|><|image|><|end_of_image|><|assistant|>"
    cases = [(text, [IMAGE_A, IMAGE_B]), (text.split(" then ")[0] + "<|assistant|>", [IMAGE_B])]
    body = {
        "text": [prompt for prompt, _ in cases],
        "image_data": [[data_url(d) for d in images] for _, images in cases],
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
    }
    r = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    for result, (prompt, images) in zip(r.json(), cases):
        ids, want = hf_generate(hf, prompt, images, 8)
        assert result["output_ids"] == want
        assert result["meta_info"]["prompt_tokens"] == len(ids)


def test_http_and_local_images_equal_the_data_url(server, media_host, local_media) -> None:
    want = chat(server.url, [{"role": "user", "content": [image_part(IMAGE_A)]}])
    for url in (f"{media_host}/a.png", (local_media / "a.png").as_uri()):
        part = {"type": "image_url", "image_url": {"url": url}}
        got = chat(server.url, [{"role": "user", "content": [part]}])
        assert got["choices"][0]["message"] == want["choices"][0]["message"]


# ---- refusals ----


def _refused(server, part: dict, words: str, count: int = 1) -> None:
    out = chat(server.url, [{"role": "user", "content": [part] * count}], status=400)
    assert words in out["error"]["message"], out


def test_bad_images_are_400s_and_the_server_keeps_serving(server, media_host, tmp_path) -> None:
    big = png(448, 448, 3)  # 64 tokens on the tiny processor's canvas, over --max-image-tokens
    outside = tmp_path / "x.png"
    outside.write_bytes(IMAGE_A)
    cases = [
        ({"type": "image_url", "image_url": {"url": data_url(b"no image")}}, "cannot be decoded"),
        (image_part(png(20, 20, 4, "BMP")), "format BMP is not supported"),
        (image_part(big), f"over the limit of {MAX_IMAGE_TOKENS} per image"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}, "base64"),
        ({"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}, "not allowed"),
        ({"type": "image_url", "image_url": {"url": f"{media_host}/slow.png"}}, "timed out"),
        ({"type": "image_url", "image_url": {"url": outside.as_uri()}}, "outside"),
        ({"type": "image_url", "image_url": {"url": "ftp://x/a.png"}}, "scheme 'ftp'"),
        ({"type": "video_url", "video_url": {"url": "x"}}, "video input is not supported"),
    ]
    for part, words in cases:
        _refused(server, part, words)
    _refused(server, image_part(IMAGE_A), "4 images in one request, over the limit of 3", 4)
    typed = {"type": "text", "text": "a typed <|image|> token"}
    _refused(server, typed, "1 image placeholders for 0 images")
    _refused(server, {"type": "text", "text": "<|begin_of_video|>"}, "video input")
    r = httpx.post(
        server.url + "/generate",
        json={"text": "no placeholder", "image_data": data_url(IMAGE_A)},
        timeout=30,
    )
    assert r.status_code == 400 and "0 image placeholders for 1 images" in r.text
    body = {"prompt": "a typed <|image|>", "max_tokens": 1}  # completions take no images
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and "1 image placeholders for 0 images" in r.text
    chat(server.url, [{"role": "user", "content": [image_part(IMAGE_A)]}])  # still serving


def test_a_slow_fetch_delays_no_other_request(server, media_host) -> None:
    part = {"type": "image_url", "image_url": {"url": f"{media_host}/slow.png"}}
    slow = threading.Thread(target=_refused, args=(server, part, "timed out"))
    slow.start()
    time.sleep(0.1)
    chat(server.url, [{"role": "user", "content": "hi"}], n=2)
    assert slow.is_alive()  # answered while the fetch still waits (3 s, its timeout)
    slow.join()

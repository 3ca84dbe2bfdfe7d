"""The front's image inputs without a server: where an image's bytes may come from
(serving/front/media.py), the content parts and placeholders of a request
(serving/front/api/image_request.py), the chat template's image part, the flags."""

from __future__ import annotations

import asyncio
import base64

import pytest

from serving.front.api.errors import APIError
from serving.front.api.image_request import (
    VisionSetup,
    attach_images,
    chat_image_sources,
    load_images,
)
from serving.front.api.openai_protocol import ChatMessage
from serving.front.chat import ChatTemplate, prepare_messages
from serving.front.images import ImageError, ImageProcessorConfig
from serving.front.media import MediaPolicy, image_bytes
from serving.server_args import ArgsError, ServerArgs
from serving.tools.tokenizer_build import CHAT_TEMPLATE_PATH
from tests.vision_images import IMAGE_A, data_url

IMAGE, VIDEO_START = 1022, 1020


def setup(**overrides) -> VisionSetup:
    fields = dict(
        processor=ImageProcessorConfig(min_image_tokens=4, max_image_tokens=64),
        image_token_id=IMAGE,
        video_start_token_id=VIDEO_START,
        max_images=2,
        max_tokens=64,
        policy=MediaPolicy(),
    )
    return VisionSetup(**{**fields, **overrides})


def fetch(source: str, policy: MediaPolicy | None = None) -> bytes:
    return asyncio.run(image_bytes(source, policy or MediaPolicy()))


def test_sources_and_their_refusals(tmp_path) -> None:
    assert fetch(data_url(IMAGE_A)) == IMAGE_A
    assert fetch(base64.b64encode(IMAGE_A).decode()) == IMAGE_A  # SGLang's bare base64
    (tmp_path / "a.png").write_bytes(IMAGE_A)
    local = MediaPolicy(local_root=tmp_path.resolve())
    assert fetch((tmp_path / "a.png").as_uri(), local) == IMAGE_A
    assert fetch(str(tmp_path / "a.png"), local) == IMAGE_A  # SGLang's path
    (tmp_path / "sub").mkdir()
    cases = [
        ("data:image/png,abc", MediaPolicy(), "must be data:<type>;base64"),
        ("data:image/png;base64,!!", MediaPolicy(), "not valid base64"),
        (data_url(IMAGE_A), MediaPolicy(max_bytes=100), "over the limit of 100 bytes"),
        ("https://example.com/a.png", MediaPolicy(), "is not set"),
        ("https://evil.com/a.png", MediaPolicy(frozenset({"ok.com"})), "'evil.com' is not allowed"),
        ((tmp_path / "a.png").as_uri(), MediaPolicy(), "not allowed"),
        (f"file://{tmp_path}/sub/../../a.png", local, "outside"),
        ((tmp_path / "none.png").as_uri(), local, "cannot be read"),
        ("gopher://x", MediaPolicy(), "scheme 'gopher' is not supported"),
    ]
    for source, policy, words in cases:
        with pytest.raises(ImageError, match=words):
            fetch(source, policy)
    policy = MediaPolicy.of("Ok.com, b.org", str(tmp_path), 2.0)
    assert policy.allowed_domains == {"ok.com", "b.org"} and policy.timeout == 2.0


def test_content_parts_in_template_order() -> None:
    messages = [
        ChatMessage(role="system", content="s"),
        ChatMessage(
            role="user",
            content=[
                {"type": "image_url", "image_url": {"url": "u1"}},
                {"type": "text", "text": "t"},
                {"type": "image_url", "image_url": "u2"},
            ],
        ),
        ChatMessage(role="user", content=[{"type": "image_url", "image_url": {"url": "u3"}}]),
    ]
    assert chat_image_sources(messages) == ["u1", "u2", "u3"]
    video = ChatMessage(role="user", content=[{"type": "video_url", "video_url": {"url": "v"}}])
    with pytest.raises(APIError, match="messages.0.content.0: video input is not supported"):
        chat_image_sources([video])

    template = ChatTemplate(CHAT_TEMPLATE_PATH.read_text(encoding="utf-8"))
    rendered = template.render([m.model_dump(exclude_none=True) for m in messages])
    one = "<|begin_of_image|><|image|><|end_of_image|>"
    assert f"<|user|>{one}t{one}<|user|>{one}<|assistant|>" in rendered
    with pytest.raises(Exception, match="content type 'input_audio' is not supported"):
        prepare_messages([{"role": "user", "content": [{"type": "input_audio"}]}])


def test_limits_and_placeholders() -> None:
    with pytest.raises(APIError, match="3 images in one request, over the limit of 2"):
        asyncio.run(load_images(setup(), ["a", "b", "c"], "messages"))
    with pytest.raises(APIError, match="image 0: image cannot be decoded"):
        asyncio.run(load_images(setup(), [data_url(b"nope")], "messages"))
    with pytest.raises(APIError, match="image 0: .* over the limit of 8 per image"):
        asyncio.run(load_images(setup(max_tokens=8), [data_url(IMAGE_A)], "messages"))
    (image,) = asyncio.run(load_images(setup(), [data_url(IMAGE_A)], "messages"))
    ids, inputs = attach_images(setup(), [5, IMAGE, 6], [image], "messages")
    assert ids == [5] + [IMAGE] * image.num_tokens + [6]
    assert [(i.start, i.num_tokens, i.grid_thw) for i in inputs] == [
        (1, image.num_tokens, image.grid_thw)
    ]
    with pytest.raises(APIError, match="1 image placeholders for 0 images"):
        attach_images(setup(), [5, IMAGE], [], "messages")
    with pytest.raises(APIError, match="<\\|begin_of_video\\|> in the prompt"):
        attach_images(setup(), [VIDEO_START, IMAGE], [image], "messages")
    assert attach_images(None, [5, IMAGE], [], "messages") == ([5, IMAGE], [])


def test_image_flags(tmp_path) -> None:
    args = ServerArgs.from_cli(
        ["--model-path", str(tmp_path), "--max-images-per-request", "3", "--max-image-tokens",
         "100", "--allowed-media-domains", "a.com", "--allowed-local-media-path", str(tmp_path),
         "--media-fetch-timeout", "2"]
    )  # fmt: skip
    vision = VisionSetup.load(args, {"vision_config": {"depth": 1}, "image_token_id": 7})
    assert (vision.max_images, vision.max_tokens, vision.image_token_id) == (3, 100, 7)
    assert vision.policy.allowed_domains == {"a.com"} and vision.policy.timeout == 2
    assert VisionSetup.load(args, {}) is None
    bad = ServerArgs.from_cli(
        ["--model-path", str(tmp_path), "--allowed-local-media-path", str(tmp_path / "none")]
    )
    with pytest.raises(ArgsError, match="--allowed-local-media-path .*: not a directory"):
        bad.validate()

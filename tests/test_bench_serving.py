"""bench_serving's image chats (--image-size): a valid OpenAI chat and a valid /generate
request whose one data: URL decodes to the asked size, one image per seed, and the token count
the real processor gives it."""

from __future__ import annotations

import base64
import io

from PIL import Image

from serving.front.api.image_request import VisionSetup, _process
from serving.front.api.native_protocol import GenerateBody
from serving.front.api.openai_protocol import ChatCompletionRequest
from serving.front.images import ImageProcessorConfig
from serving.front.media import MediaPolicy
from serving.tools.bench_serving import GLM_IMAGE_CHAT, IMAGE_QUESTION, drawn_png, image_request


def test_image_chat_is_one_image_of_the_asked_size() -> None:
    png = drawn_png(448, (3, 0))
    body = image_request(png, 64, "chat")
    request = ChatCompletionRequest.model_validate(body)
    assert request.stream and request.stream_options.continuous_usage_stats
    assert request.max_tokens == 64 and request.ignore_eos
    parts = body["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["image_url", "text"]
    native = image_request(png, 64, "generate")
    generate = GenerateBody.model_validate(native)
    assert generate.stream and generate.image_data == [parts[0]["image_url"]["url"]]
    assert native["sampling_params"] == {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
    assert native["text"] == GLM_IMAGE_CHAT.format(IMAGE_QUESTION)
    head, _, payload = parts[0]["image_url"]["url"].partition(",")
    assert head == "data:image/png;base64"
    data = base64.b64decode(payload)
    image = Image.open(io.BytesIO(data))
    assert (image.format, image.mode, image.size) == ("PNG", "RGB", (448, 448))
    # GLM-5.3-Flash's processor (16 to 8,000 tokens): 448 is 16 x 28, so (448/28)^2 tokens
    real = VisionSetup(ImageProcessorConfig(), 1, None, 16, 8000, MediaPolicy.of(None, None, 1.0))
    processed = _process(data, real)
    assert processed.num_tokens == 256 and tuple(processed.grid_thw) == (1, 32, 32)


def test_each_seed_draws_its_own_image() -> None:
    """The prefix cache keys images by their bytes: requests (seeds) must not share one."""
    images = [drawn_png(64, (1, i)) for i in range(4)] + [drawn_png(64, (2, 0))]
    assert len(set(images)) == len(images)
    assert drawn_png(64, (1, 0)) == images[0]  # deterministic


def test_generate_prompt_is_what_the_chat_template_renders(tiny_vision_ckpt) -> None:
    """The /generate image chat is the chat route's prompt: GLM's template, as the tiny --vision
    checkpoint's chat_template renders an image part and a text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_vision_ckpt)
    message = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}
    rendered = tok.apply_chat_template([message], tokenize=False, add_generation_prompt=True)
    assert rendered == GLM_IMAGE_CHAT.format("x")

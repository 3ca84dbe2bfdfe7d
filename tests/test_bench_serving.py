"""bench_serving's image chats (--image-size): a valid OpenAI chat whose one data: URL decodes
to the asked size, one image per seed, and the token count the real processor gives it."""

from __future__ import annotations

import base64
import io

from PIL import Image

from serving.front.api.image_request import VisionSetup, _process
from serving.front.api.openai_protocol import ChatCompletionRequest
from serving.front.images import ImageProcessorConfig
from serving.front.media import MediaPolicy
from serving.tools.bench_serving import drawn_png, image_chat


def test_image_chat_is_one_image_of_the_asked_size() -> None:
    body = image_chat(drawn_png(448, (3, 0)), 64)
    request = ChatCompletionRequest.model_validate(body)
    assert request.stream and request.stream_options.continuous_usage_stats
    assert request.max_tokens == 64 and request.ignore_eos
    parts = body["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["image_url", "text"]
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

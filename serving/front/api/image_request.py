"""A request's images, from its content parts (OpenAI) or image_data (SGLang's /generate) to the
ImageInputs the scheduler takes: each fetched (serving/front/media.py), decoded and preprocessed
(serving/front/images.py) in a worker thread, so neither a slow fetch nor a large image delays
another request; its <|image|> placeholder then expanded in the prompt's token ids.

Every problem is a 400 naming it: a checkpoint without a vision tower, a video part, too many
images, anything ImageError says (undecodable, oversized, a disallowed or timed-out URL), and a
prompt whose <|image|> tokens are not its images' (typed in a message) or that holds
<|begin_of_video|> (transformers would read the images after it as video frames).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import ExifTags

from serving.front.api.errors import APIError
from serving.front.api.openai_protocol import ChatMessage, ImageURL
from serving.front.images import (
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    ImageError,
    ImageProcessorConfig,
    ProcessedImage,
    decode_image,
    expand_image_token_ids,
    image_tokens,
    open_image,
    preprocess,
)
from serving.front.media import MediaPolicy, image_bytes
from serving.protocol import ImageInput
from serving.server_args import ServerArgs

VIDEO_PARTS = ("video_url", "video", "input_video")


@dataclass(frozen=True)
class VisionSetup:
    """The image path of a checkpoint with a vision_config: its preprocessing, its token ids,
    the serving limits (flags) and the media policy. counts_only: a PD decode worker's front,
    which needs only each image's token count (its prompt ids): prefill runs the tower, and
    decode receives KV and states only."""

    processor: ImageProcessorConfig
    image_token_id: int
    video_start_token_id: int | None
    max_images: int
    max_tokens: int
    policy: MediaPolicy
    counts_only: bool = False

    @classmethod
    def load(cls, args: ServerArgs, model_config: dict[str, Any]) -> VisionSetup | None:
        if not model_config.get("vision_config"):
            return None
        path = Path(args.model_path) / "preprocessor_config.json"
        raw = json.loads(path.read_text()) if path.is_file() else {}
        processor = ImageProcessorConfig.from_dict(raw)
        return cls(
            processor,
            int(model_config.get("image_token_id", 154854)),
            model_config.get("video_start_token_id", 154832),
            args.max_images_per_request,
            args.image_token_limit(),
            MediaPolicy.of(
                args.allowed_media_domains, args.allowed_local_media_path, args.media_fetch_timeout
            ),
            args.disaggregation_mode == "decode",
        )


def chat_image_sources(messages: Sequence[ChatMessage]) -> list[str]:
    """The URLs of the messages' image parts, in the order the chat template renders them."""
    sources = []
    for i, message in enumerate(messages):
        if isinstance(message.content, str) or message.content is None:
            continue
        for j, part in enumerate(message.content):
            where = f"messages.{i}.content.{j}"
            if part.type in VIDEO_PARTS:
                raise APIError(400, f"{where}: video input is not supported", "messages")
            if part.type == "image_url":
                url = part.image_url.url if isinstance(part.image_url, ImageURL) else part.image_url
                if not url:
                    raise APIError(400, f"{where}: image_url part without a url", "messages")
                sources.append(url)
    return sources


async def load_images(
    vision: VisionSetup | None, sources: Sequence[str], param: str
) -> list[ProcessedImage]:
    """The sources fetched and preprocessed, concurrently, off the event loop."""
    if not sources:
        return []
    if vision is None:
        raise APIError(
            400, "this model does not take images (its config.json has no vision_config)", param
        )
    if len(sources) > vision.max_images:
        raise APIError(
            400,
            f"{len(sources)} images in one request, over the limit of {vision.max_images} "
            "(--max-images-per-request)",
            param,
        )

    async def one(index: int, source: str) -> ProcessedImage:
        try:
            data = await image_bytes(source, vision.policy)
            return await asyncio.to_thread(_process, data, vision)
        except ImageError as e:
            raise APIError(400, f"image {index}: {e}", param) from None

    return list(await asyncio.gather(*(one(i, s) for i, s in enumerate(sources))))


def _process(data: bytes, vision: VisionSetup) -> ProcessedImage:
    if vision.counts_only:
        image = _count(data, vision)
    else:
        image = preprocess(decode_image(data), vision.processor, vision.max_tokens)
    return dataclasses.replace(image, content_hash=content_hash(data))


def content_hash(data: bytes) -> int:
    """The image's content hash (prefix-cache keys, serving/engine/cache_keys.py): of its bytes,
    so prefill and decode agree and nothing is decoded for it; the same pixels sent as other
    bytes only miss."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _count(data: bytes, vision: VisionSetup) -> ProcessedImage:
    """The image's token count from its size as decode_image gives it (EXIF orientation
    applied), its pixels neither converted, resized nor kept. Hazard: an image whose pixel data
    is broken passes here; prefill refuses it, and decode's room fails with prefill's reason."""
    image = open_image(data, MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS)
    width, height = image.size
    try:
        if image.getexif().get(ExifTags.Base.Orientation) in (5, 6, 7, 8):  # a quarter turn
            width, height = height, width
    except Exception as e:  # broken EXIF, as decode_image words it
        raise ImageError(f"image cannot be decoded: {e}") from None
    grid, tokens = image_tokens(width, height, vision.processor, vision.max_tokens)
    return ProcessedImage(None, grid, tokens)


def attach_images(
    vision: VisionSetup | None, ids: list[int], images: Sequence[ProcessedImage], param: str
) -> tuple[list[int], list[ImageInput]]:
    """The prompt with each image's <|image|> expanded to its tokens, and the images as the
    scheduler takes them. A text-only checkpoint's prompt is returned as it is."""
    if vision is None:
        return ids, []
    if vision.video_start_token_id in ids:
        raise APIError(400, "<|begin_of_video|> in the prompt: video input is not supported", param)
    try:
        expanded, starts = expand_image_token_ids(
            ids, [im.num_tokens for im in images], vision.image_token_id
        )
    except ImageError as e:
        raise APIError(400, str(e), param) from None
    return expanded, [
        ImageInput(im.pixel_values, im.grid_thw, start, im.num_tokens, im.content_hash)
        for im, start in zip(images, starts)
    ]

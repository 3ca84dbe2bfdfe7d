"""Images for the vision tower, prepared in the front: decoded, resized, normalised and cut into
patches as transformers 5.17's Glm5NextImageProcessorPil does, and the prompt's image
placeholders expanded as Glm5NextProcessor does. numpy and Pillow only: the front never imports
torch.

Decoding (decode_image) is transformers' load_image, the path its processor takes for a URL or a
base64 string: the EXIF orientation applied, then convert("RGB") (alpha dropped, not composited
on a background; palette and grey expanded; a GIF's or an animation's first frame).

Preprocessing (preprocess), per image, with factor = patch 14 x merge 2 = 28:
1. The canvas (target_size): multiples of 28 with (H/28)(W/28) between min_image_tokens and
   max_image_tokens (16 and 8,000; a budget of tokens x temporal 2 x 28^2 pixels, the image
   counted twice, as the frame is repeated over temporal_patch_size).
2. The content (content_size): the image scaled to fit the canvas, never enlarged unless it is
   under the minimum budget, resized bicubically on uint8; the canvas is padded with zeros at the
   bottom and right (padded, never cropped, so padding shows up as -mean/std after step 3).
3. x * (1/255) in float64 rounded to float32, then (x - mean) / std in float32 (CLIP's).
4. Patches in block-major order: 2x2 merge blocks row-major, the 4 patches of a block row-major;
   each patch flattened as (channel, temporal, 14, 14) with the frame repeated over temporal 2:
   pixel_values [gh * gw, 3 * 2 * 14 * 14 = 1176], grid_thw (1, gh, gw) with gh = H/14, and
   gh * gw / 4 image tokens (merge 2 x 2 patches into one token).

The prompt (expand_image_placeholders / expand_image_token_ids): the chat template renders an
image as <|begin_of_image|><|image|><|end_of_image|>; the i-th <|image|> then becomes that many
copies of itself as image i has tokens. The model puts image i's embeddings, in order, at
those positions: transformers takes every <|image|> outside a video span; here the expansion
says where each image's run starts, and a prompt with any other <|image|> (typed in a message's
text, say) is refused, so the two agree.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

IMAGE_TOKEN = "<|image|>"
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # Pillow's names; the rest is refused
# Serving limits (flags will set them). 20 MiB: OpenAI's per-image limit. 89,478,485 pixels:
# Pillow's own decompression-bomb threshold (Image.MAX_IMAGE_PIXELS), about 268 MB as RGB.
MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_IMAGE_PIXELS = 89_478_485


class ImageError(ValueError):
    """An image that cannot be served; the message names the problem (becomes an HTTP 400)."""


@dataclass(frozen=True)
class ImageProcessorConfig:
    """Glm5NextImageProcessorPil's settings; the defaults are its class defaults, which
    GLM-5.3-Flash's preprocessor_config.json repeats."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_image_tokens: int = 16
    max_image_tokens: int = 8000
    image_mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255
    resample: int = Image.Resampling.BICUBIC

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ImageProcessorConfig:
        """From preprocessor_config.json; a step it turns off is refused (only the processor's
        full pipeline is implemented)."""
        for step in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if raw.get(step, True) is False:
                raise ValueError(f"preprocessor_config.json: {step}=false is not supported")
        fields = {k: raw[k] for k in cls.__dataclass_fields__ if raw.get(k) is not None}
        for key in ("image_mean", "image_std"):
            if key in fields:
                fields[key] = tuple(fields[key])
        config = cls(**fields)
        if not 1 <= config.min_image_tokens <= config.max_image_tokens:
            raise ValueError(
                "preprocessor_config.json: needs 1 <= min_image_tokens <= max_image_tokens, got "
                f"{config.min_image_tokens} and {config.max_image_tokens}"
            )
        return config

    @property
    def factor(self) -> int:
        """Canvas sides are multiples of this: one merged token covers factor x factor pixels."""
        return self.patch_size * self.merge_size


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: np.ndarray | None  # float32 [t*gh*gw, 3*2*14*14]; None: counted (PD decode)
    grid_thw: tuple[int, int, int]  # (1, gh, gw) in patches
    num_tokens: int  # the <|image|> tokens it takes: t * gh * gw // merge_size**2
    content_hash: int = 0  # of the bytes it came from (set by the front's image_request)


def decode_image(
    data: bytes, max_bytes: int = MAX_IMAGE_BYTES, max_pixels: int = MAX_IMAGE_PIXELS
) -> Image.Image:
    """PNG, JPEG, WebP or GIF bytes -> an RGB image (transformers' load_image)."""
    image = open_image(data, max_bytes, max_pixels)
    try:
        return ImageOps.exif_transpose(image).convert("RGB")
    except Exception as e:  # truncated or corrupt pixel data, broken EXIF
        raise ImageError(f"image cannot be decoded: {e}") from None


def open_image(data: bytes, max_bytes: int, max_pixels: int) -> Image.Image:
    """The image opened, its pixels not decoded yet: the limits are checked first, and only
    those four decoders ever parse the bytes (others are attack surface; EPS runs Ghostscript)."""
    if len(data) > max_bytes:
        raise ImageError(f"image of {len(data)} bytes is over the limit of {max_bytes} bytes")
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError as e:
        raise ImageError(f"image is over the pixel limit: {e}") from None
    except UnidentifiedImageError:  # no allowed decoder took it
        found = _sniffed_format(data)
        if found in IMAGE_FORMATS:
            raise ImageError(f"image cannot be decoded: broken {found} data") from None
        if found is not None:
            raise ImageError(
                f"image format {found} is not supported (PNG, JPEG, WebP, GIF)"
            ) from None
        raise ImageError("image cannot be decoded: not PNG, JPEG, WebP or GIF data") from None
    except Exception as e:  # Pillow on untrusted bytes: whatever it raises, a 400
        raise ImageError(f"image cannot be decoded: {e}") from None
    width, height = image.size
    if width * height > max_pixels:
        raise ImageError(
            f"image of {width}x{height} pixels is over the limit of {max_pixels} pixels"
        )
    if width == 0 or height == 0:
        raise ImageError(f"image of {width}x{height} pixels is empty")
    return image


def _sniffed_format(data: bytes) -> str | None:
    """The format Pillow's signature checks see in the first bytes (no decoder runs)."""
    Image.init()
    for name in Image.ID:
        accept = Image.OPEN[name][1]
        try:
            if accept is not None and accept(data[:16]):
                return name
        except Exception:  # a check reading past short data (Pillow's open skips these too)
            continue
    return None


def target_size(height: int, width: int, config: ImageProcessorConfig) -> tuple[int, int]:
    """The canvas (height, width) for an image of this size: transformers' smart_resize for one
    image (two frames: the image repeated over the temporal patch). Its float arithmetic is
    reproduced step by step: a canvas one multiple off changes every later number."""
    factor, frames = config.factor, config.temporal_patch_size
    per_token = frames * factor**2
    min_pixels = config.min_image_tokens * per_token
    max_pixels = config.max_image_tokens * per_token

    def align(value: int) -> int:
        return math.ceil(value / factor) * factor

    th, tw = align(height), align(width)
    if frames * th * tw < min_pixels:  # too small: scaled up to the minimum budget
        scale = math.sqrt(min_pixels / (frames * height * width))
        th, tw = align(max(1, math.ceil(height * scale))), align(max(1, math.ceil(width * scale)))
    if frames * th * tw <= max_pixels:
        return th, tw

    # too large: the tallest content height (1..height, the width following the aspect ratio)
    # whose aligned canvas fits; the canvas grows with it, so bisect. None fits: one token.
    def fits(content_height: int) -> bool:
        content_width = max(1, math.floor(width * content_height / height))
        return frames * align(content_height) * align(content_width) <= max_pixels

    lo, hi = 0, height  # fits(lo) holds (or lo is 0), fits(hi + 1) does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        return factor, factor
    return align(lo), align(max(1, math.floor(width * lo / height)))


def content_size(
    height: int, width: int, canvas: tuple[int, int], config: ImageProcessorConfig
) -> tuple[int, int]:
    """The size the image is resized to inside its canvas (the rest is padding): the same scale
    on both sides, at most 1 unless the image is under the minimum token budget."""
    th, tw = canvas
    scale = min(th / height, tw / width)
    per_token = config.temporal_patch_size * config.factor**2
    if config.temporal_patch_size * height * width >= per_token * config.min_image_tokens:
        scale = min(1.0, scale)
    return max(1, min(th, math.floor(height * scale))), max(1, min(tw, math.floor(width * scale)))


def image_grid(height: int, width: int, config: ImageProcessorConfig) -> tuple[int, int, int]:
    """grid_thw of an image of this size (in patches), without touching its pixels."""
    th, tw = target_size(height, width, config)
    return 1, th // config.patch_size, tw // config.patch_size


def num_image_tokens(grid_thw: tuple[int, int, int], merge_size: int) -> int:
    t, h, w = grid_thw
    return t * h * w // merge_size**2


def canvas_pixels(image: Image.Image, config: ImageProcessorConfig) -> np.ndarray:
    """The resized, zero-padded RGB canvas, uint8 [H, W, 3] (steps 1 and 2)."""
    width, height = image.size
    th, tw = target_size(height, width, config)
    ch, cw = content_size(height, width, (th, tw), config)
    if (ch, cw) != (height, width):
        image = image.resize((cw, ch), resample=config.resample)
    canvas = np.zeros((th, tw, 3), dtype=np.uint8)
    canvas[:ch, :cw] = np.asarray(image)
    return canvas


def patchify(canvas: np.ndarray, config: ImageProcessorConfig) -> np.ndarray:
    """A uint8 canvas [H, W, 3] -> pixel_values float32 [gh * gw, 3 * temporal * p * p] (steps
    3 and 4). Step 3 maps each (channel, byte) pair through a 3 x 256 table computed with the
    processor's own float ops, so every value is bit-equal to rescaling and normalising the
    whole image, at a fraction of the work."""
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    levels = (np.arange(256, dtype=np.float64) * config.rescale_factor).astype(np.float32)
    mean = np.asarray(config.image_mean, np.float32)[:, None]
    table = (levels - mean) / np.asarray(config.image_std, np.float32)[:, None]
    gh, gw = canvas.shape[0] // p, canvas.shape[1] // p
    # (block row, block col, row in block, col in block, channel, y, x)
    patches = canvas.reshape(gh // m, m, p, gw // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
    patches = patches.reshape(gh * gw, 3, p, p)
    out = np.empty((gh * gw, 3, t, p, p), dtype=np.float32)
    out[:, :, 0] = table[np.arange(3)[:, None, None], patches]
    out[:, :, 1:] = out[:, :, :1]  # the frame repeated over the temporal patch
    return out.reshape(gh * gw, 3 * t * p * p)


def preprocess(
    image: Image.Image, config: ImageProcessorConfig, max_tokens: int | None = None
) -> ProcessedImage:
    """An RGB image -> what the vision tower takes; an image needing more than `max_tokens`
    tokens is refused before it is resized."""
    grid, tokens = image_tokens(*image.size, config, max_tokens)
    return ProcessedImage(patchify(canvas_pixels(image, config), config), grid, tokens)


def image_tokens(
    width: int, height: int, config: ImageProcessorConfig, max_tokens: int | None = None
) -> tuple[tuple[int, int, int], int]:
    """(grid_thw, tokens) of an image of this size; over `max_tokens` tokens is an ImageError."""
    tokens = num_image_tokens(grid := image_grid(height, width, config), config.merge_size)
    if max_tokens is not None and tokens > max_tokens:
        raise ImageError(
            f"image of {width}x{height} pixels takes {tokens} image tokens, over the limit of "
            f"{max_tokens} per image"
        )
    return grid, tokens


def _check_count(found: int, counts: list[int]) -> None:
    if found != len(counts):
        raise ImageError(f"the prompt has {found} image placeholders for {len(counts)} images")


def expand_image_placeholders(text: str, counts: list[int]) -> str:
    """The i-th <|image|> of a rendered prompt repeated counts[i] times (Glm5NextProcessor)."""
    parts = text.split(IMAGE_TOKEN)
    _check_count(len(parts) - 1, counts)
    out = [parts[0]]
    for n, part in zip(counts, parts[1:]):
        out += [IMAGE_TOKEN * n, part]
    return "".join(out)


def expand_image_token_ids(
    ids: list[int], counts: list[int], image_token_id: int
) -> tuple[list[int], list[int]]:
    """expand_image_placeholders on token ids (<|image|> is one special token, so the text
    around it tokenizes the same either way). Returns the ids and where each image's run of
    counts[i] tokens starts."""
    _check_count(ids.count(image_token_id), counts)
    if not counts:  # no placeholder: every text-only prompt of a vision checkpoint
        return list(ids), []
    pending = iter(counts)
    out: list[int] = []
    starts: list[int] = []
    for token in ids:
        if token == image_token_id:
            starts.append(len(out))
            out += [token] * next(pending)
        else:
            out.append(token)
    return out, starts

"""Small drawn images for the vision tests (noise: no two pixels alike, so a wrong resize or a
misplaced patch shows), and the data: URLs a client sends them in."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image


def png(height: int, width: int, seed: int, fmt: str = "PNG") -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


IMAGE_A = png(90, 120, 0)  # 20 tokens on the tiny --vision checkpoint's processor
IMAGE_B = png(150, 70, 1)

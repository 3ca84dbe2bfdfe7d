"""The shipped small model sees (issue 45 point 10): served on a single worker over HTTP, with
EAGLE 1 step as `make run` serves it, it names the colour of a drawn square, greedy. The images
are drawn as training/vision_data.py draws its data, from seeds the training never uses
(vision_data.HELDOUT_SEED and up), and sent as data: URLs."""

from __future__ import annotations

import base64
import io
import random
from pathlib import Path

import httpx
import pytest

from tests.server_proc import Server, eagle_flags
from training import vision_data

SMALL = Path(__file__).resolve().parents[1] / "serving" / "assets" / "small_model"


def square_png(colour: str, seed: int) -> str:
    rng = random.Random(vision_data.HELDOUT_SEED + seed)
    buf = io.BytesIO()
    vision_data.shape_image("square", colour, rng).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(
        SMALL,
        "--served-model-name", "small", "--dtype", "float32", *eagle_flags(1),
        log_dir=tmp_path_factory.mktemp("logs"),
    )  # fmt: skip
    yield srv
    assert srv.stop() == 0


def ask(server: Server, url: str, question: str, **extra) -> str:
    body = {
        "model": "small",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": question},
                ],
            }
        ],
        "temperature": 0,
        "max_tokens": 16,
        **extra,
    }
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("colour", ["red", "blue"])
def test_it_names_the_colour_of_a_drawn_square(server, colour):
    no_think = {"chat_template_kwargs": {"enable_thinking": False}}
    answer = ask(server, square_png(colour, 7), "What colour is the square?", **no_think)
    words = set(answer.lower().replace(".", " ").split())
    assert colour in words, answer
    assert not (words & set(vision_data.COLOURS)) - {colour}, answer

"""Images the project draws itself, with chats about them: the small model's vision training and
held-out data (training/train_vision.py). Everything is a function of the seed: sample(seed)
draws the same image and the same chat on every machine (Pillow's bundled font, no system
fonts; no anti-aliased primitives whose output depends on the platform).

Three kinds of image, each SIZE x SIZE on a plain background:
  shape  one shape in one colour: "What colour is the square?" -> "The square is red.",
         "What shape is this?" -> "It is a red square."
  count  1 to 4 copies of one shape in one colour: "How many circles are there?" ->
         "There are 3 circles."
  word   a short word in capitals in one colour: "What does it say?" -> "It says CAT."
Held-out sets use seeds from HELDOUT_SEED up; training seeds stay below it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from PIL import Image, ImageDraw, ImageFont

SIZE = 112  # 4 x 4 merged tokens of 28 px: 16 image tokens
HELDOUT_SEED = 1_000_000_000

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (30, 60, 220),
    "yellow": (240, 210, 20),
    "orange": (245, 130, 20),
    "purple": (130, 40, 170),
    "black": (15, 15, 15),
}
SHAPES = ("square", "circle", "triangle", "star")
PLURAL = {"square": "squares", "circle": "circles", "triangle": "triangles", "star": "stars"}
NUMBER_WORDS = ("one", "two", "three", "four")
WORDS = ("CAT", "DOG", "SUN", "CAR", "BOX", "RED", "HAT", "CUP", "MAP", "PEN", "BUS", "FOX")
BACKGROUNDS = ((255, 255, 255), (235, 235, 235), (250, 245, 230), (225, 235, 245))


@dataclass(frozen=True)
class Sample:
    image: Image.Image
    question: str
    answer: str
    kind: str  # "shape", "count" or "word"
    colour: str
    subject: str  # the shape, or the word


def _polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    if shape == "square":
        return [(cx - r, cy - r), (cx + r, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "triangle":
        return [(cx, cy - r), (cx + r, cy + r * 0.8), (cx - r, cy + r * 0.8)]
    # a five-pointed star: outer and inner radii alternate from the top
    points = []
    for i in range(10):
        radius = r if i % 2 == 0 else r * 0.45
        angle = math.pi * (i / 5 - 0.5)
        points.append((cx + radius * math.cos(angle), cy + radius * math.sin(angle)))
    return points


def _draw_shape(
    draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, fill
) -> None:
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    else:
        draw.polygon(_polygon(shape, cx, cy, r), fill=fill)


def _canvas(rng: random.Random) -> tuple[Image.Image, ImageDraw.ImageDraw]:
    image = Image.new("RGB", (SIZE, SIZE), rng.choice(BACKGROUNDS))
    return image, ImageDraw.Draw(image)


def shape_image(shape: str, colour: str, rng: random.Random) -> Image.Image:
    image, draw = _canvas(rng)
    r = rng.uniform(16, 34)
    cx, cy = rng.uniform(r + 4, SIZE - r - 4), rng.uniform(r + 4, SIZE - r - 4)
    _draw_shape(draw, shape, cx, cy, r, COLOURS[colour])
    return image


def count_image(shape: str, colour: str, count: int, rng: random.Random) -> Image.Image:
    """`count` copies on a 2 x 2 grid of cells (one per cell, jittered), so they never overlap."""
    image, draw = _canvas(rng)
    cells = rng.sample(range(4), count)
    half = SIZE / 2
    for cell in cells:
        r = rng.uniform(10, 17)
        x0, y0 = (cell % 2) * half, (cell // 2) * half
        cx, cy = x0 + rng.uniform(r + 3, half - r - 3), y0 + rng.uniform(r + 3, half - r - 3)
        _draw_shape(draw, shape, cx, cy, r, COLOURS[colour])
    return image


def word_image(word: str, colour: str, rng: random.Random) -> Image.Image:
    image, draw = _canvas(rng)
    font = ImageFont.load_default(size=rng.choice((26, 30, 34)))
    left, top, right, bottom = draw.textbbox((0, 0), word, font=font)
    w, h = right - left, bottom - top
    x = rng.uniform(2, max(2, SIZE - w - 2)) - left
    y = rng.uniform(2, max(2, SIZE - h - 2)) - top
    draw.text((x, y), word, fill=COLOURS[colour], font=font)
    return image


def sample(seed: int) -> Sample:
    """The image and one question with its answer, a function of `seed` alone."""
    rng = random.Random(seed)
    colour = rng.choice(list(COLOURS))
    kind = rng.choices(("shape", "count", "word"), weights=(6, 2, 2))[0]
    if kind == "shape":
        shape = rng.choice(SHAPES)
        image = shape_image(shape, colour, rng)
        question, answer = rng.choice(
            (
                (f"What colour is the {shape}?", f"The {shape} is {colour}."),
                ("What shape is this?", f"It is a {colour} {shape}."),
                ("What is in the image?", f"A {colour} {shape}."),
                ("Describe the image.", f"A {colour} {shape} on a plain background."),
            )
        )
        return Sample(image, question, answer, kind, colour, shape)
    if kind == "count":
        shape, count = rng.choice(SHAPES), rng.randint(1, 4)
        image = count_image(shape, colour, count, rng)
        noun = shape if count == 1 else PLURAL[shape]
        verb = "is" if count == 1 else "are"
        question, answer = rng.choice(
            (
                (f"How many {PLURAL[shape]} are there?", f"There {verb} {count} {noun}."),
                (f"What colour are the {PLURAL[shape]}?", f"The {PLURAL[shape]} are {colour}."),
            )
        )
        return Sample(image, question, answer, kind, colour, shape)
    word = rng.choice(WORDS)
    image = word_image(word, colour, rng)
    question, answer = rng.choice(
        (
            ("What does it say?", f"It says {word}."),
            ("What word is written?", f"The word is {word}."),
            ("What colour is the text?", f"The text is {colour}."),
        )
    )
    return Sample(image, question, answer, kind, colour, word)


def chat(s: Sample) -> list[dict]:
    """The sample as chat messages (the image part first, as clients usually send it)."""
    return [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": s.question}]},
        {"role": "assistant", "content": s.answer},
    ]

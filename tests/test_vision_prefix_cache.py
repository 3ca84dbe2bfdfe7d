"""Prefix-cache keys with images (serving/engine/cache_keys.py) and the content hash the front
computes for them. The served behaviour (the same image hits past its run with a cold run's
tokens, another image of the same size does not) is test_vision_engine.py's
test_the_prefix_cache_keys_images_by_content."""

from __future__ import annotations

import dataclasses

from serving.engine.cache_keys import cache_keys, image_key
from serving.engine.request import Req
from serving.front.api.image_request import VisionSetup, _process, content_hash
from serving.front.images import ImageProcessorConfig
from serving.front.media import MediaPolicy
from serving.protocol import GenerateRequest, ImageInput
from serving.sampling_params import SamplingParams
from tests.vision_images import IMAGE_A, png

IMAGE_A2 = png(90, 120, 7)  # IMAGE_A's size: the same token count


def image(start: int, n: int, digest: int) -> ImageInput:
    return ImageInput(None, (1, 2, 2 * n), start, n, digest)


def test_keys() -> None:
    """Token positions keep their ids; an image's run takes its content key (negative, so never
    a token id); pair keys (a draft) stay one-to-one and apart from token pairs."""
    vocab, ids = 1000, [5, 6, 7, 999, 999, 999, 8]
    req = Req.of(GenerateRequest("r", ids, SamplingParams()), frozenset())
    req.images = [image(3, 3, 42)]
    k = image_key(req.images[0])
    assert cache_keys(ids, req, vocab, False) == [5, 6, 7, k, k, k, 8] and k < 0
    other = Req.of(GenerateRequest("o", ids, SamplingParams()), frozenset())
    other.images = [image(3, 3, 43)]
    assert cache_keys(ids, other, vocab, False)[3] != k
    pairs = cache_keys(ids, req, vocab, True)
    assert pairs[:2] == [5 * vocab + 6, 6 * vocab + 7]
    assert len(set(pairs)) == len(pairs) - 1  # (k, k) twice
    assert all(not 0 <= p < vocab**2 for p in pairs[2:-1])
    plain = Req.of(GenerateRequest("p", ids, SamplingParams()), frozenset())
    assert cache_keys(ids, plain, vocab, False) is ids  # no image: the ids themselves


def test_the_front_hashes_images_by_their_bytes() -> None:
    """The content hash the keys fold in: equal for equal bytes (on prefill and on decode,
    whose front only counts), different for other pixels of the same size."""
    full = VisionSetup(ImageProcessorConfig(), 1, None, 4, 8000, MediaPolicy.of(None, None, 1.0))
    counts = dataclasses.replace(full, counts_only=True)
    a, a2 = _process(IMAGE_A, full), _process(IMAGE_A2, full)
    assert a.num_tokens == a2.num_tokens and a.content_hash != a2.content_hash
    assert a.content_hash == _process(IMAGE_A, counts).content_hash == content_hash(IMAGE_A)

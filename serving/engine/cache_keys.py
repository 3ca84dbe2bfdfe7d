"""The prefix cache's key per position (admission.py builds them, serving/memory/radix_cache.py
matches them). A text position's key is its token id. A position in an image's run is keyed by
the image's content (ImageInput.content_hash, the front's hash of its bytes): all <|image|> ids
alike, so token ids alone would let another image behind the same text hit. The same image
behind the same prefix gives the same keys (the embeddings depend on nothing else); another
image differs from its run's first position on, so no hit reaches past that start.

Image keys are negative (-1 - hash, hash < 2**62): never a token id. With an EAGLE draft a key
is a (position, next position) pair, because the draft's KV at a position depends on the next
token: a * vocab + b for two token ids, as before; a * 2**64 + b when either is an image key,
which lands outside [0, vocab**2) and is one-to-one since |b| < 2**63.
"""

from __future__ import annotations

from serving.engine.request import Req
from serving.protocol import ImageInput

HASH_BITS = 62


def image_key(image: ImageInput) -> int:
    return -1 - (image.content_hash & ((1 << HASH_BITS) - 1))


def position_keys(tokens: list[int], images: list[ImageInput]) -> list[int]:
    """tokens with each image's run keyed by its content (`tokens` itself when no image)."""
    if not images:
        return tokens
    keys = list(tokens)
    for image in images:
        if image.start < len(keys):
            end = min(image.start + image.num_tokens, len(keys))
            keys[image.start : end] = [image_key(image)] * (end - image.start)
    return keys


def cache_keys(tokens: list[int], req: Req, vocab: int, pairs: bool) -> list[int]:
    """The key per position of `tokens` (req's fill_ids, perhaps plus a token sampled for it).
    pairs (a draft in the pool): req keeps the pair keys built so far (pair_keys of the position
    keys pair_tokens); keys are built only from where `tokens` leave pair_tokens."""
    tokens = position_keys(tokens, req.images)
    if not pairs:
        return tokens
    keys, seen = req.pair_keys, req.pair_tokens
    n = min(len(seen), len(tokens))
    if seen[:n] != tokens[:n]:
        n = next(i for i, (a, b) in enumerate(zip(seen, tokens)) if a != b)
    del seen[n:]
    del keys[max(n - 1, 0) :]  # a key needs both its tokens among the common ones
    m = len(keys)
    keys += [
        a * vocab + b if a >= 0 and b >= 0 else a * 2**64 + b
        for a, b in zip(tokens[m:], tokens[m + 1 :])
    ]
    seen += tokens[n:]
    return list(keys)

"""Near-duplicate documents, for training/corpus.py: MinHash signatures over word 5-grams,
banded into buckets (locality-sensitive hashing), candidate pairs confirmed by the share of equal
signature entries (the estimated Jaccard similarity of their 5-gram sets).

Deterministic: word hashes are CRC-32s, not Python's per-process hash()."""

from __future__ import annotations

import zlib

import numpy as np

SHINGLE = 5
HASHES = 32
BANDS = 8  # of HASHES // BANDS rows: pairs at Jaccard 0.8 meet in a bucket with p = 0.985


def signature(text: str, a: np.ndarray, b: np.ndarray, cache: dict[str, int]) -> np.ndarray | None:
    words = text.lower().split()
    if len(words) < SHINGLE:
        return None
    ids = np.fromiter((cache.setdefault(w, zlib.crc32(w.encode())) for w in words), np.uint64,
                      len(words))  # fmt: skip
    shingles = np.zeros(len(words) - SHINGLE + 1, dtype=np.uint64)
    for k in range(SHINGLE):  # a polynomial of the 5 word hashes, wrapping mod 2**64
        shingles = shingles * np.uint64(0x100000001B3) + ids[k : len(ids) - SHINGLE + 1 + k]
    shingles = np.unique(shingles)
    return (shingles[None, :] * a[:, None] + b[:, None]).min(axis=1)


def near_duplicates(texts: list[str], prefer: list[bool], threshold: float = 0.8) -> set[int]:
    """Indices to drop so that no two kept texts are near-duplicates (estimated Jaccard of word
    5-grams >= threshold). In each group of near-duplicates the preferred texts are all kept and
    the others dropped; a group with none preferred keeps its first text."""
    rng = np.random.default_rng(0)
    a = rng.integers(1, 2**63, HASHES, dtype=np.uint64) | np.uint64(1)
    b = rng.integers(0, 2**63, HASHES, dtype=np.uint64)
    cache: dict[str, int] = {}
    with np.errstate(over="ignore"):
        sigs = [signature(t, a, b, cache) for t in texts]
    parent = list(range(len(texts)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    rows = HASHES // BANDS
    for band in range(BANDS):
        buckets: dict[bytes, int] = {}
        for i, sig in enumerate(sigs):
            if sig is None:
                continue
            key = sig[band * rows : (band + 1) * rows].tobytes()
            j = buckets.setdefault(key, i)
            if j != i and find(i) != find(j) and np.mean(sigs[j] == sig) >= threshold:
                parent[find(i)] = find(j)
    groups: dict[int, list[int]] = {}
    for i in range(len(texts)):
        groups.setdefault(find(i), []).append(i)
    drop: set[int] = set()
    for members in groups.values():
        if len(members) == 1:
            continue
        keep = [i for i in members if prefer[i]] or [min(members)]
        drop.update(i for i in members if i not in keep)
    return drop

"""DSA's ragged extend (serving/layers/attention/dsa.py select_positions), every request of a
batch at once: prefix-cache hits starting at grid positions and chunks continuing at
kpool-unaligned starts.

CPU: the batch equals its requests run one by one (pooled keys written, the tail ring, the
selected positions and their cache slots). GPU: the fast path (paged Triton scoring over every
query at once) equals the torch references on the same batch, at the bench preset's indexer
shape (16 heads, D 128, kpool 16, 32 pools selected), 32 hits of ~190 new tokens after 4,096
cached tokens. float32 caches, so scores agree to IEEE rounding and the selections are equal as
sets per token (the Triton selection lists them in another order).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kernels
from kernels import indexer as ref_idx
from serving.forward_batch import ForwardBatch
from serving.layers.attention.dsa import IndexerShape, select_positions, selected_slots
from serving.memory.cache import DSALayerCache

PAGE = 64


def _setup(device: str, starts: list[int], lens: list[int], heads: int, dim: int, kp: int, seed):
    """A paged table (each row its own shuffled pages), a cache holding earlier chunks' pooled
    keys and rings (random), the step's inputs (random) and its ForwardBatch."""
    g = torch.Generator().manual_seed(seed)
    rows = len(starts) + 1
    max_ctx = -(-max(s + n for s, n in zip(starts, lens)) // PAGE) * PAGE
    per_row = max_ctx // PAGE
    pages = torch.randperm(rows * per_row, generator=g)[: (rows - 1) * per_row] + 1
    table = torch.zeros(rows + 3, max_ctx, dtype=torch.int64)
    row_ids = [r + 3 for r in range(1, rows)]  # rows beyond a small running count
    for i, r in enumerate(row_ids):
        run = pages[i * per_row : (i + 1) * per_row]
        table[r] = (run[:, None] * PAGE + torch.arange(PAGE)).flatten()
    slots = (rows * per_row + 1) * PAGE
    ring = kp
    cache = DSALayerCache(
        latent=torch.zeros(1, 1),
        index_keys=torch.randn(slots // kp, dim, generator=g),
        tail_keys=torch.randn(rows + 3, ring, dim, generator=g),
        tail_gates=torch.randn(rows + 3, ring, dim, generator=g),
    )
    total = sum(lens)
    inputs = (
        torch.randn(total, heads, dim, generator=g),  # q
        torch.randn(total, dim, generator=g),  # k
        torch.randn(total, dim, generator=g),  # gates
        torch.rand(total, heads, generator=g) * heads**-0.5,  # head weights
        torch.randn(kp, dim, generator=g),  # ape
    )
    # poison the pooled-key rows the step must write: a pool left unwritten stays NaN
    for start, n, row in zip(starts, lens, row_ids):
        for pool in range(start // kp, (start + n) // kp):
            cache.index_keys[table[row, pool * kp] // kp] = float("nan")
    to = lambda t: t.to(device)  # noqa: E731
    cache = _tensors_mapped(cache, to)
    ids = [1] * total
    batch = ForwardBatch.build(ids, row_ids, starts, lens, to(table))
    return cache, tuple(to(t) for t in inputs), batch, row_ids


def _tensors_mapped(cache: DSALayerCache, fn) -> DSALayerCache:
    return dataclasses.replace(
        cache, **{k: fn(v) for k, v in vars(cache).items() if torch.is_tensor(v)}
    )


def _clone(cache: DSALayerCache) -> DSALayerCache:
    return _tensors_mapped(cache, torch.Tensor.clone)


def _one_by_one(shape, inputs, batch: ForwardBatch, cache: DSALayerCache) -> torch.Tensor:
    """The extend written per request, plainly: pools closing in its chunk (early members from
    its ring), its ring's last positions, then its queries scored over its own pools; the
    selected positions (-1 = empty)."""
    q, k, gates, head_w, ape = inputs
    kp, ring, r2t = shape.kpool, cache.tail_slots, batch.req_to_token
    out, offset = [], 0
    for start, n, row in zip(batch.starts_cpu, batch.lens_cpu, batch.rows_cpu):
        end, part = start + n, slice(offset, offset + n)
        base = start // kp * kp
        early = torch.arange(base, start) % ring
        keys = torch.cat([cache.tail_keys[row, early], k[part]])
        gate = torch.cat([cache.tail_gates[row, early], gates[part]])
        for pool in range(start // kp, end // kp):
            members = slice(pool * kp - base, (pool + 1) * kp - base)
            pooled = ref_idx.kpool_compress(keys[None, members], gate[None, members], ape)
            cache.index_keys[r2t[row, pool * kp] // kp] = pooled[0]
        for p in range(max(start, end - ring), end):
            cache.tail_keys[row, p % ring] = k[offset + p - start]
            cache.tail_gates[row, p % ring] = gates[offset + p - start]
        pools = max(end // kp, 1)
        pooled_keys = cache.index_keys[r2t[row, torch.arange(pools) * kp] // kp]
        scores = ref_idx.score_pools(q[part], head_w[part], pooled_keys[None], shape.head_dim**-0.5)
        positions = torch.arange(start, end)
        chosen = ref_idx.select_tokens(scores, positions, kp, shape.select_pools, True)
        out.append(chosen)
        offset += n
    return torch.cat(out)


def test_batch_equals_its_requests_one_by_one():
    """The batch writes and selects what its requests do one by one."""
    kp = 4
    shape = IndexerShape(kpool=kp, select_pools=6, select_tail=True, head_dim=16)
    # hits at grid positions, unaligned continuations (open pools in the ring), a first chunk
    starts = [128, 64, 7, 130, 0, 61]
    lens = [37, 3, 26, 1, 45, 11]
    cache, inputs, batch, _ = _setup("cpu", starts, lens, heads=4, dim=16, kp=kp, seed=1)
    alone = _clone(cache)
    got = select_positions(shape, *inputs, batch, cache)
    want = _one_by_one(shape, inputs, batch, alone)
    assert torch.equal(got, want)
    slots, offset = selected_slots(got, batch), 0
    for n, row in zip(batch.lens_cpu, batch.rows_cpu):
        part = slice(offset, offset + n)
        table_row = batch.req_to_token[row]
        assert torch.equal(slots[part][got[part] < 0], got[part][got[part] < 0])
        assert torch.equal(slots[part][got[part] >= 0], table_row[got[part][got[part] >= 0]])
        offset += n
    for name in ("index_keys", "tail_keys", "tail_gates"):
        assert torch.allclose(getattr(cache, name), getattr(alone, name), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fast_path_equals_the_references_on_32_hits():
    kp = 16
    shape = IndexerShape(kpool=kp, select_pools=32, select_tail=True, head_dim=128)
    g = torch.Generator().manual_seed(2)
    lens = torch.randint(130, 250, (32,), generator=g).tolist()
    starts = [4096 + 64 * int(i) for i in torch.randint(0, 8, (32,), generator=g)]
    starts[-2:] = [4103, 2050]  # two chunks continuing at unaligned starts
    cache, inputs, batch, _ = _setup("cuda", starts, lens, heads=16, dim=128, kp=kp, seed=3)
    reference = _clone(cache)
    got = select_positions(shape, *inputs, batch, cache)
    with kernels.torch_path():
        want = select_positions(shape, *inputs, batch, reference)
    assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)
    for name in ("index_keys", "tail_keys", "tail_gates"):
        a, b = getattr(cache, name), getattr(reference, name)
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), name

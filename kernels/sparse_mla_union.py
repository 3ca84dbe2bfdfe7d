"""Sparse MLA for an extend chunk at few heads per rank: tiles of consecutive queries walk their
request's keys in position order, each query attending only the positions its selection marks.

    sparse_mla_union(q, latent, mask, scale, req_to_token, query_rows, tiles) -> [N, H, R]

q [N, H, R] absorbed queries; latent [S, R] cache rows; mask [N, L] uint8 (row stride free, last
dim contiguous): mask[n, p] != 0 when query n attends position p of its request;
req_to_token [rows, max_ctx]; query_rows [N] each query's request row; tiles [NT, 3] int64
(first query, end query, key end) from union_tiles.
out[n, h] = sum_p softmax_p(scale * q[n,h] . c_p) * c_p over the marked p, c_p =
latent[req_to_token[query_rows[n], p]]: the same sum as kernels.sparse_mla.sparse_mla_attention
over the same selection given as slots (req_to_token at each query's selected positions;
selection_mask makes the positions a mask).
Invariants: every query marks at least one position, all below its tile's key end; a tile's
queries share one request row; the latent rows of its request's positions below the key end are
written (finite): every one of them is gathered, marked or not, and an unmarked one weighs 0.

Why. At 8 heads per rank the gather kernel (one query per program) pads its head block and
gathers 2,048 latent rows per query; here block_queries(heads, dtype) queries share one gathered key
block and one [64, R] x [R, keys] dot, so the tensor-core tile is full and
each row is gathered once per tile. The price is the union: a tile scores every key block up to
its key end that any of its queries marks. union_pays says when that pays (host ints only).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Dense-over-selected work above which the gather kernel wins. At 8 heads the gather kernel
# does ~41 TFLOP/s of useful work; the union kernel's dense rate is several times that.
UNION_MAX_DENSE_RATIO = 4.0
UNION_MAX_HEADS = 16  # at least 4 queries a tile; above, the gather kernel's head block is full


def block_queries(heads: int, dtype: torch.dtype) -> int:
    """Queries per tile: 64 rows of (query, head), one full MMA tile (32 in fp32: the Triton
    kernel's shared memory), heads padded to a power of two."""
    rows = 32 if dtype == torch.float32 else 64
    padded = 1 << max(0, heads - 1).bit_length()
    return max(1, rows // padded)


def union_tiles(starts: Sequence[int], lens: Sequence[int], block_q: int) -> torch.Tensor:
    """Tiles [NT, 3] int64 on the host (first query, end query, key end) of a ragged extend whose
    request b has lens[b] new tokens at positions starts[b].. (queries in batch order). A tile
    never straddles two requests; its key end is its last query's position + 1 (causal bound).
    Hazard: the caller uploads them without waiting for the device (a pageable .to(cuda) waits
    for the step in flight: serving.forward_batch.upload)."""
    tiles, offset = [], 0
    for start, n in zip(starts, lens):
        for first in range(0, n, block_q):
            end = min(n, first + block_q)
            tiles.append((offset + first, offset + end, start + end))
        offset += n
    # longest key walks first: a tail of short tiles balances the last wave
    tiles.sort(key=lambda tile: -tile[2])
    return torch.tensor(tiles, dtype=torch.int64).reshape(-1, 3)


def selection_mask(positions: torch.Tensor, ctx_len: int) -> torch.Tensor:
    """The selection as positions [N, W] in each query's request (-1 = empty) made mask
    [N, ctx_len] uint8 (ctx_len above every selected position). Empty entries land in a spare
    last column, so every write is a 1 and the scatter is deterministic."""
    pos = torch.where(positions >= 0, positions, ctx_len)
    mask = torch.zeros(positions.shape[0], ctx_len + 1, dtype=torch.uint8, device=pos.device)
    mask.scatter_(1, pos, 1)
    return mask[:, :ctx_len]


def _work(end: int, width: int) -> tuple[int, int]:
    """(dense, selected) keys summed over the queries at positions 0..end-1."""
    capped = min(end, width)
    return end * (end + 1) // 2, capped * (capped + 1) // 2 + (end - capped) * width


def union_pays(heads: int, width: int, starts: Sequence[int], lens: Sequence[int]) -> bool:
    """Whether the union kernel beats the gather kernel on this extend (host ints only): few
    heads, and the keys it scores (every position up to each query, the causal bound) at most
    UNION_MAX_DENSE_RATIO times the selected ones. An 8,192-token chunk with W = 2063: 2.3 with
    no prefix (union), 6.0 after 8k cached and 13.9 after 24k (gather)."""
    if heads > UNION_MAX_HEADS or not lens:
        return False
    dense = selected = 0
    for start, n in zip(starts, lens):
        d1, s1 = _work(start + n, width)
        d0, s0 = _work(start, width)
        dense, selected = dense + d1 - d0, selected + s1 - s0
    return dense <= UNION_MAX_DENSE_RATIO * selected


def sparse_mla_union(
    q: torch.Tensor,
    latent: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    req_to_token: torch.Tensor,
    query_rows: torch.Tensor,
    tiles: torch.Tensor,
) -> torch.Tensor:
    """The reference: per tile, every key up to its end gathered once, scores masked per query."""
    out = torch.empty_like(q)
    for first, end, key_end in tiles.tolist():
        row = query_rows[first]
        kv = latent[req_to_token[row, :key_end]]  # [K, R]
        marked = mask[first:end, :key_end] != 0  # [n, K]
        scores = torch.einsum("nhr,kr->nhk", q[first:end].float(), kv.float()) * scale
        scores = scores.masked_fill(~marked.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(kv.dtype)
        out[first:end] = torch.einsum("nhk,kr->nhr", probs, kv).to(q.dtype)
    return out

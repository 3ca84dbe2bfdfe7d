"""Sparse MLA attention in the absorbed (MQA) form over selected cache slots."""

from __future__ import annotations

import torch

_QUERY_BLOCK = 256  # bounds the [block, W, R] gather on long prefills


def sparse_mla_attention(
    q: torch.Tensor, latent: torch.Tensor, slots: torch.Tensor, scale: float
) -> torch.Tensor:
    """q: [N, H, R] absorbed queries; latent: [S, R] cache; slots: [N, W] cache slots, -1 = none.

    out[n, h] = sum_w softmax_w(scale * q[n,h] . latent[slots[n,w]]) * latent[slots[n,w]].
    Invariant: every row has at least one valid slot and no slot twice.
    """
    out = torch.empty_like(q)
    for start in range(0, q.shape[0], _QUERY_BLOCK):
        blk = slice(start, start + _QUERY_BLOCK)
        sel = slots[blk]
        kv = latent[sel.clamp(min=0)]  # [n, W, R]
        scores = torch.einsum("nhr,nwr->nhw", q[blk].float(), kv.float()) * scale
        scores = scores.masked_fill((sel < 0).unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(kv.dtype)
        out[blk] = torch.einsum("nhw,nwr->nhr", probs, kv).to(q.dtype)
    return out

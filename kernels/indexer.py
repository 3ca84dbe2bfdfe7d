"""DSA indexer with kpool compression: pool compression, pool scoring and top-k selection.

Index keys of `kpool` consecutive tokens are mixed into one pooled key; a query scores the
complete pools visible to it, keeps the best `index_topk // kpool`, expands them back to token
positions and appends its own open pool (the tail) unscored.

Tie rule (all our paths): among pools with equal scores the lower pool index wins. The sort is
stable over pools in index order, so the rule holds on every device.
"""

from __future__ import annotations

import torch


def kpool_compress(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """keys, gates: [N, kpool, D]; ape: [kpool, D]. Returns pooled keys [N, D] in keys' dtype.

    Per channel, a softmax over the pool's members of (gate + ape) weights their keys.
    """
    prob = torch.softmax(gates.float() + ape.float(), dim=1).to(keys.dtype)
    return (prob * keys).sum(dim=1)


def score_pools(
    q: torch.Tensor, head_weights: torch.Tensor, pool_keys: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """q: [N, Hi, D]; head_weights: [N, Hi] (already times Hi^-0.5); pool_keys: [G, P, D].

    Queries come in G equal groups, one per request (N = G * m); group g scores pool_keys[g].
    Returns [N, P] float32: sum_h w[n,h] * relu(scale * q[n,h] . k[p]).
    """
    groups, heads = pool_keys.shape[0], q.shape[1]
    grouped = q.float().reshape(groups, -1, q.shape[-1])  # [G, m*Hi, D]
    logits = torch.matmul(grouped, pool_keys.float().transpose(-1, -2))  # [G, m*Hi, P]
    logits = torch.relu(logits * softmax_scale).view(q.shape[0], heads, -1)
    return torch.matmul(head_weights.float().unsqueeze(-2), logits).squeeze(-2)


def select_tokens(
    scores: torch.Tensor,
    positions: torch.Tensor,
    kpool: int,
    select_pools: int,
    select_tail: bool,
) -> torch.Tensor:
    """Pick token positions for each query.

    scores: [N, P] pool scores (pool p covers positions p*kpool .. p*kpool+kpool-1);
    positions: [N] query positions. A pool is a candidate only once complete and visible
    ((p+1)*kpool - 1 <= position). Returns [N, select_pools*kpool (+ kpool-1)] int64 positions,
    -1 for empty entries. The result never holds a position twice.
    """
    num_pools = scores.shape[-1]
    pool_ids = torch.arange(num_pools, device=scores.device)
    visible = (pool_ids + 1) * kpool - 1 <= positions[:, None]
    masked = scores.masked_fill(~visible, float("-inf"))
    take = min(select_pools, num_pools)
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :take]
    chosen_valid = visible.gather(-1, order)
    chosen = torch.where(chosen_valid, order, torch.full_like(order, -1))
    offsets = torch.arange(kpool, device=scores.device)
    tokens = chosen.unsqueeze(-1) * kpool + offsets  # [N, take, kpool]
    tokens = torch.where(chosen.unsqueeze(-1) >= 0, tokens, torch.full_like(tokens, -1))
    tokens = tokens.flatten(1)
    width = select_pools * kpool
    if tokens.shape[-1] < width:
        pad = tokens.new_full((tokens.shape[0], width - tokens.shape[-1]), -1)
        tokens = torch.cat([tokens, pad], dim=-1)
    if select_tail and kpool > 1:
        tail_start = ((positions + 1) // kpool) * kpool
        tail = tail_start[:, None] + torch.arange(kpool - 1, device=scores.device)
        tail = torch.where(tail <= positions[:, None], tail, torch.full_like(tail, -1))
        tokens = torch.cat([tokens, tail], dim=-1)
    return tokens

"""Mixture of experts: sigmoid router with correction bias and grouped top-k; expert SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    normalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, Hd]. Returns (weights [T, k] float32, expert ids [T, k] int64).

    The bias only steers selection; the weights come from the unbiased sigmoid scores.
    """
    scores = F.linear(x.float(), gate_weight.float()).sigmoid()
    choice = scores + correction_bias.float()
    if n_group > 1:
        grouped = choice.view(x.shape[0], n_group, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        keep = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(
            ~group_mask.unsqueeze(-1).expand_as(grouped).reshape_as(choice), float("-inf")
        )
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """x: [T, Hd]; w13: [E, 2I, Hd] (gate rows then up rows); w2: [E, Hd, I].

    Returns sum_k weights[t,k] * expert_{ids[t,k]}(x[t]), shape [T, Hd], in x's dtype.
    An id equal to E selects no expert: the pair adds nothing and costs nothing (under EP, the
    experts another rank holds).
    """
    out = torch.zeros_like(x)
    flat_ids = ids.flatten()
    order = torch.argsort(flat_ids, stable=True)  # id-E pairs sort last and are never visited
    counts = torch.bincount(flat_ids, minlength=w13.shape[0])[: w13.shape[0]].tolist()
    token_of = order // ids.shape[1]
    weight_of = weights.flatten()[order]
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        tok = token_of[start : start + n]
        gate, up = F.linear(x[tok], w13[expert]).chunk(2, dim=-1)
        y = F.linear(swiglu(gate, up, limit), w2[expert]) * weight_of[start : start + n, None]
        out.index_add_(0, tok, y.to(out.dtype))
        start += n
    return out


def experts_dense(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """Same result as `experts` (ids equal to E included), computed for every expert with zero
    weight where unselected.

    No host sync and static shapes, so decode can be captured in a CUDA graph; it reads every
    expert's weights, which small decode batches on a GPU do anyway at bandwidth cost only.
    """
    e = w13.shape[0]
    dense = torch.zeros(x.shape[0], e + 1, device=x.device, dtype=torch.float32)
    dense = dense.scatter_(1, ids, weights.float())[:, :e]  # column E: the no-expert pairs
    gate, up = torch.einsum("th,eih->eti", x, w13).chunk(2, dim=-1)
    y = torch.einsum("eti,ehi->eth", swiglu(gate, up, limit), w2)
    return torch.einsum("eth,te->th", y.float(), dense).to(x.dtype)

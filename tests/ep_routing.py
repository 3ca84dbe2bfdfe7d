"""Routed-expert test inputs as an EP rank's MoE layer hands them to its experts kernels: shared
by the grouped MoE tests (tests/test_moe_grouped.py, tests/test_moe_fp8_grouped.py)."""

from __future__ import annotations

import torch

# rank 0 of TP8/EP8 of GLM-5.3-Flash: (hidden, local experts, moe_intermediate, top_k, experts)
RANK = (4096, 36, 2048, 8, 288)


def ep_routing(tokens, shape, seed=0, skip_expert=None, skip_all=False):
    """(x [T, Hd] float32, weights [T, k], ids [T, k]) on the CPU, drawn from `seed`: top-k of
    random scores over all experts, weights renormalised over all k, ids of other ranks'
    experts (>= local) set to `local`. skip_expert: a local expert nobody picks (a group with
    zero rows); skip_all: every pair on another rank."""
    hidden, local, _, top_k, total = shape
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    scores = torch.rand(tokens, total, generator=gen)
    weights, ids = scores.topk(top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    ids = ids.clamp(max=local)
    if skip_expert is not None:
        ids = ids.masked_fill(ids == skip_expert, local)
    if skip_all:
        ids = torch.full_like(ids, local)
    return x, weights, ids

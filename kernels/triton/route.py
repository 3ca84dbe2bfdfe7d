"""Triton version of kernels.moe.route for n_group 1 (GLM-5.3-Flash's router): two launches
instead of about fifteen ops (the router's float32 weight copy and GEMM, sigmoid, bias, top-k,
gather, renormalisation, scaling, the EP id mapping).

1. logits: programs of (token block, expert block, K slice) accumulate x @ W^T with fp32
   accumulators (bf16 inputs on tensor cores: every bf16 product is exact in fp32, so this is
   the reference's float32 GEMM up to the summation order; float32 inputs use IEEE dots), into
   [S, T, E] partials; a decode's one token spreads the router's 2.4 MB over the SMs.
2. select: one program per token sums the partials in a fixed order, takes sigmoid scores,
   picks top-k of scores + bias by k rounds of max (ties to the lowest id; descending, as
   torch.topk), gathers, renormalises, scales and maps ids to this rank's local ids.
Both begin with grid_dependency() and are launched with PDL (kernels/triton/pdl.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.pdl import LAUNCH, grid_dependency

# warps of a select program (one token's 288 experts in 512 lanes: each of its 8 picks is a max,
# a min and a sum across the program). 4 warps reduce through shared memory, 1 within a warp
# only. H200 trace, 45-layer rank 0 at 16 rows (session 36): 5.25 us a call at 4.
SELECT_WARPS = 4


@triton.jit
def _router_logits_kernel(
    x_ptr,  # [T, HD]
    w_ptr,  # [E, HD]
    part_ptr,  # [S, T, E] float32
    T,
    E,
    HD,
    k_per_split,
    IEEE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    grid_dependency()
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    s = tl.program_id(2)
    t_mask = t < T
    e_mask = e < E
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    k_start = s * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < HD
        a = tl.load(
            x_ptr + t[:, None].to(tl.int64) * HD + k[None, :],
            mask=t_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        w = tl.load(w_ptr + e[None, :] * HD + k[:, None], mask=e_mask[None, :] & k_mask[:, None])
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    out = part_ptr + (s * T + t[:, None]).to(tl.int64) * E + e[None, :]
    tl.store(out, acc, mask=t_mask[:, None] & e_mask[None, :])


@triton.jit
def _router_select_kernel(
    part_ptr,
    bias_ptr,  # [E] float32
    weights_ptr,  # [T, TOPK] float32
    ids_ptr,  # [T, TOPK] int64
    T,
    E,
    splits,
    scaling,
    first,
    count,
    NORMALIZE: tl.constexpr,
    LOCAL: tl.constexpr,
    TOPK: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    grid_dependency()
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    e_mask = e < E
    logits = tl.zeros([BLOCK_E], dtype=tl.float32)
    for s in range(0, splits):  # fixed order: deterministic
        logits += tl.load(part_ptr + (s * T + t) * E + e, mask=e_mask, other=0.0)
    scores = tl.sigmoid(logits)
    choice = scores + tl.load(bias_ptr + e, mask=e_mask, other=0.0)
    choice = tl.where(e_mask, choice, float("-inf"))
    kk = tl.arange(0, KP)
    picked_w = tl.zeros([KP], dtype=tl.float32)
    picked_id = tl.zeros([KP], dtype=tl.int32)
    for j in tl.static_range(TOPK):
        best = tl.max(choice, axis=0)
        idx = tl.min(tl.where(choice == best, e, BLOCK_E), axis=0)
        w = tl.sum(tl.where(e == idx, scores, 0.0), axis=0)
        picked_w = tl.where(kk == j, w, picked_w)
        picked_id = tl.where(kk == j, idx, picked_id)
        choice = tl.where(e == idx, float("-inf"), choice)
    if NORMALIZE:
        picked_w = picked_w / (tl.sum(tl.where(kk < TOPK, picked_w, 0.0), axis=0) + 1e-20)
    if LOCAL:
        mine = (picked_id >= first) & (picked_id < first + count)
        picked_id = tl.where(mine, picked_id - first, count)
    k_mask = kk < TOPK
    tl.store(weights_ptr + t * TOPK + kk, picked_w * scaling, mask=k_mask)
    tl.store(ids_ptr + t * TOPK + kk, picked_id.to(tl.int64), mask=k_mask)


def route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    normalize: bool,
    scaling: float,
    local: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.moe.route in two launches; n_group 1 only (serving/layers/mlp.py keeps the
    reference otherwise)."""
    assert n_group == 1, "the fused router has no group selection"
    tokens, hidden = x.shape
    experts = gate_weight.shape[0]
    dev = x.device
    weights = torch.empty(tokens, top_k, device=dev, dtype=torch.float32)
    ids = torch.empty(tokens, top_k, device=dev, dtype=torch.int64)
    if tokens == 0:
        return weights, ids
    x = x.contiguous()
    w = gate_weight.contiguous()
    if w.dtype != x.dtype:
        w = w.to(x.dtype)
    block_t = 16 if tokens <= 16 else 64
    block_e = 16 if tokens <= 16 else 64
    block_k = 128 if tokens <= 16 else 64
    grid_te = triton.cdiv(tokens, block_t) * triton.cdiv(experts, block_e)
    splits = max(1, min(triton.cdiv(hidden, block_k), triton.cdiv(264, grid_te)))
    k_per_split = triton.cdiv(triton.cdiv(hidden, splits), block_k) * block_k
    splits = triton.cdiv(hidden, k_per_split)
    part = torch.empty(splits, tokens, experts, device=dev, dtype=torch.float32)
    grid = (triton.cdiv(tokens, block_t), triton.cdiv(experts, block_e), splits)
    _router_logits_kernel[grid](
        x,
        w,
        part,
        tokens,
        experts,
        hidden,
        k_per_split,
        IEEE=x.dtype == torch.float32,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        BLOCK_K=block_k,
        num_warps=4,
        **LAUNCH,
    )
    first, count = local if local is not None else (0, experts)
    _router_select_kernel[(tokens,)](
        part,
        correction_bias.contiguous().float(),
        weights,
        ids,
        tokens,
        experts,
        splits,
        float(scaling),
        first,
        count,
        NORMALIZE=normalize,
        LOCAL=local is not None,
        TOPK=top_k,
        KP=triton.next_power_of_2(top_k),
        BLOCK_E=triton.next_power_of_2(experts),
        num_warps=SELECT_WARPS,
        **LAUNCH,
    )
    return weights, ids

"""Mixture of experts: sigmoid router with correction bias and grouped top-k; expert SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import fp8


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
    """x: [T, Hd]. Returns (weights [T, k] float32, expert ids [T, k] int64).

    The bias only steers selection; the weights come from the unbiased sigmoid scores.
    local (EP): (first, count) of this rank's experts; ids become local ids in [0, count), and
    count for an expert another rank holds (which the expert kernels skip).
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
    if local is not None:
        first, count = local
        ids = torch.where((ids >= first) & (ids < first + count), ids - first, count)
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


def experts_fp8(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """`experts` with block-FP8 weights, W8A8 (kernels/fp8.py): w13 [E, 2I, Hd] and w2 [E, Hd, I]
    float8_e4m3fn; w13_scale [E, 2 * ceil(I/128), ceil(Hd/128)] (gate's blocks, then up's: each
    half has its own partial edge block), w2_scale [E, ceil(Hd/128), ceil(I/128)]. x is quantized
    per token group before gate/up, the SwiGLU output (rounded to x's dtype) before down.

    Every expert runs on every token with weight 0 where unselected (ids equal to E add
    nothing): static shapes and no host sync, so it is capturable like experts_dense.
    """
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    nb = fp8.blocks(inter)
    dense = torch.zeros(x.shape[0], num_experts + 1, device=x.device, dtype=torch.float32)
    dense = dense.scatter_(1, ids, weights.float())[:, :num_experts]
    xq = _fake_quant(x)
    out = torch.zeros(x.shape[0], x.shape[1], device=x.device, dtype=torch.float32)
    for e in range(num_experts):
        gate = xq @ fp8.dequantize(w13[e, :inter], w13_scale[e, :nb]).T
        up = xq @ fp8.dequantize(w13[e, inter:], w13_scale[e, nb:]).T
        h = _fake_quant(swiglu(gate, up, limit).to(x.dtype))
        y = (h @ fp8.dequantize(w2[e], w2_scale[e]).T) * dense[:, e : e + 1]
        out += y.to(x.dtype).float()  # each pair's output rounded, as the Triton MoE stores it
    return out.to(x.dtype)


def _fake_quant(x: torch.Tensor) -> torch.Tensor:
    """x after per-token-group FP8 quantization, as float32."""
    x8, scale = fp8.quantize_act(x)
    return x8.float() * scale.repeat_interleave(fp8.BLOCK, dim=-1)[:, : x.shape[1]]

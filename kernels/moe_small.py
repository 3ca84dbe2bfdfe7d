"""MoE at decode batch sizes through expert slots: the plain-torch references of
kernels/triton/moe_small.py (the oracle its tests compare with; sync-free and capturable too).

A small batch picks few of the rank's local experts (T * top_k pairs, at most E_local distinct),
so instead of sorting pairs by expert the router lists the distinct local experts picked:
- slot_expert [S] int32, S = num_slots(T, top_k, E_local) = min(T * top_k, E_local): the picked
  local experts in ascending id order, then E_local (no expert) in the slots left over;
- slot_weight [S, T] float32: the routing weight token t gives slot j's expert (0 where t did
  not pick it, and in every unused slot).
The experts then read each picked expert's weights once for all its tokens.

The shared expert joins as one more expert of weight 1 for every token: gate/up accumulate in
float32, the SwiGLU output is rounded to x's dtype and the down projection's float32 sum joins
the routed ones, one rounding to x's dtype at the end. (serving/layers/mlp.DenseMLP rounds gate
and up to x's dtype first: a bf16 difference only; float32 is the same function.)

Block FP8 (W8A8, as kernels.moe.experts_fp8 and kernels.fp8.block_fp8_linear): a projection whose
weight is float8_e4m3fn (scale given) reads x quantized per token group of 128, and a down
projection in FP8 reads the SwiGLU output (rounded to x's dtype) quantized per row group of 128.
The routed experts are FP8 or not as a whole; the shared expert's gate/up and down each on
their own (the load keeps a weight shape dense where FP8 is not faster: serving/models/
fp8_choice.py).

counters: the Triton kernels' int32 last-program counters (kernels/triton/moe_small.py), owned
by the call site; unused here (same signature as the Triton twins).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels import fp8
from kernels.moe import route, swiglu


class Experts(NamedTuple):
    """The rank's routed experts: w13 [E_local, 2I, Hd] (gate rows, then up rows), w2
    [E_local, Hd, I]; block FP8: float8_e4m3fn with w13_scale [E_local, 2 * ceil(I/128),
    ceil(Hd/128)] (gate's blocks, then up's) and w2_scale [E_local, ceil(Hd/128), ceil(I/128)]."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None


class SharedExpert(NamedTuple):
    """The shared expert's (this rank's share of the) SwiGLU: gate, up [Is, Hd], down [Hd, Is];
    a weight with a block scale is float8_e4m3fn (gate and up alike: they share one shape)."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_scale: torch.Tensor | None = None
    up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None


def num_slots(tokens: int, top_k: int, num_local: int) -> int:
    """Slots of a batch: at most T * top_k pairs and E_local experts can be picked."""
    return min(tokens * top_k, num_local)


def route_slots(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    normalize: bool,
    scaling: float,
    local: tuple[int, int] | None,
    counters: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.moe.route (n_group 1) as slots: (slot_expert [S] int32, slot_weight [S, T]
    float32). local (EP): (first, count) of this rank's experts, as in route; the slots list
    local ids."""
    weights, ids = route(x, gate_weight, correction_bias, top_k, 1, 1, normalize, scaling, local)
    tokens = x.shape[0]
    num_local = local[1] if local is not None else gate_weight.shape[0]
    slots = num_slots(tokens, top_k, num_local)
    # column E_local: the pairs of other ranks' experts, dropped
    dense = weights.new_zeros(tokens, num_local + 1).scatter_(1, ids, weights)[:, :num_local]
    picked = torch.zeros(tokens, num_local + 1, device=x.device, dtype=torch.bool)
    active = picked.scatter_(1, ids, True)[:, :num_local].any(0)
    order = torch.argsort((~active).to(torch.int8), stable=True)[:slots]  # picked ids first
    used = torch.arange(slots, device=x.device) < active.sum()
    slot_expert = torch.where(used, order, num_local).to(torch.int32)
    slot_weight = torch.where(used[:, None], dense[:, order].T, 0.0).contiguous()
    return slot_expert, slot_weight


def experts_slots(
    x: torch.Tensor,
    slot_expert: torch.Tensor,
    slot_weight: torch.Tensor,
    experts: Experts,
    shared: SharedExpert | None,
    limit: float,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_j slot_weight[j, t] * expert_{slot_expert[j]}(x[t]) + shared(x[t]), [T, Hd] in x's
    dtype (float32 sums, one rounding). Slots holding E_local add nothing."""
    w13, w2, w13_scale, w2_scale = experts
    num_local, two_inter, _ = w13.shape
    inter = two_inter // 2
    nb = fp8.blocks(inter)
    out = torch.zeros(x.shape, device=x.device, dtype=torch.float32)
    for j in range(slot_expert.shape[0]):
        e = slot_expert[j : j + 1].long().clamp(max=num_local - 1)  # an unused slot: weight 0
        g13, g2 = w13.index_select(0, e)[0], w2.index_select(0, e)[0]  # index_select: no sync
        if w13_scale is None:
            scales = (None, None, None)
        else:
            s13 = w13_scale.index_select(0, e)[0]
            scales = (s13[:nb], s13[nb:], w2_scale.index_select(0, e)[0])
        y = _swiglu_mlp(x, g13[:inter], g13[inter:], g2, *scales, limit)
        out += y * slot_weight[j][:, None]
    if shared is not None:
        out += _swiglu_mlp(x, *shared[:3], *shared[3:], limit)
    return out.to(x.dtype)


def moe_small(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    normalize: bool,
    scaling: float,
    local: tuple[int, int] | None,
    experts: Experts,
    shared: SharedExpert | None,
    limit: float,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """A small batch's MoE on this rank: route_slots, then experts_slots (a partial sum under
    TP/EP, as serving/layers/mlp.MoE's)."""
    slot_expert, slot_weight = route_slots(
        x, gate_weight, correction_bias, top_k, normalize, scaling, local
    )
    return experts_slots(x, slot_expert, slot_weight, experts, shared, limit)


def _swiglu_mlp(x, gate, up, down, gate_scale, up_scale, down_scale, limit) -> torch.Tensor:
    """One expert on every token, float32 out (see the module docstring for the roundings)."""
    a = _fake_quant(x) if gate_scale is not None else x.float()
    g = a @ _weight(gate, gate_scale).T
    u = a @ _weight(up, up_scale).T
    h = swiglu(g, u, limit).to(x.dtype)
    h = _fake_quant(h) if down_scale is not None else h.float()
    return h @ _weight(down, down_scale).T


def _weight(w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return w.float() if scale is None else fp8.dequantize(w, scale)


def _fake_quant(x: torch.Tensor) -> torch.Tensor:
    """x after per-token-group FP8 quantization, as float32."""
    x8, scale = fp8.quantize_act(x)
    return x8.float() * scale.repeat_interleave(fp8.BLOCK, dim=-1)[:, : x.shape[1]]

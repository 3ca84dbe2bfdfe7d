"""Kimi Delta Attention (KDA): short causal conv and the gated delta-rule recurrence, the gates
(forget_gate, gated_norm), and a decode or verify step's whole core (kda_decode_layer).

State per request: conv state [C, K-1] (the last K-1 pre-conv inputs) and recurrent state
[H, Dk, Dv] in float32. Both live in engine-owned tensors indexed by request row; these
functions read and update them in place at `rows`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels.fp8 import block_fp8_linear


def causal_conv_extend(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    rows: torch.Tensor,
    lens: list[int],
    history: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Depthwise causal conv + SiLU over a ragged batch, continuing from `conv_state[rows]`.

    x: [T, C] new inputs, requests back to back with lengths `lens`; weight: [C, K].
    conv_state: [R, C, K-1], updated in place to the last K-1 inputs of every request.
    history: if given, receives [B, C, K-1+max_len] (old state ++ inputs), from which the conv
    state after any position can be cut (speculative verify rolls back with it).
    """
    kernel = weight.shape[-1]
    num_reqs, max_len = len(lens), max(lens)
    chans = x.shape[-1]
    # seq[b] = state ++ x_b ++ zero padding, laid out [B, C, K-1+max_len]
    seq = x.new_zeros(num_reqs, chans, kernel - 1 + max_len, dtype=weight.dtype)
    seq[:, :, : kernel - 1] = conv_state[rows].to(weight.dtype)
    offset = 0
    for b, n in enumerate(lens):
        seq[b, :, kernel - 1 : kernel - 1 + n] = x[offset : offset + n].T.to(weight.dtype)
        offset += n
    out = F.silu(F.conv1d(seq, weight.unsqueeze(1), groups=chans))  # [B, C, max_len]
    if history is not None:
        history.append(seq)
    pieces = []
    for b, n in enumerate(lens):
        pieces.append(out[b, :, :n].T)
        conv_state[rows[b]] = seq[b, :, n : n + kernel - 1].to(conv_state.dtype)
    return torch.cat(pieces).to(x.dtype)


def conv_qkv_extend(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    rows: torch.Tensor,
    lens: list[int],
    heads: int,
    history: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """causal_conv_extend of q | k | v (x [T, 3*H*D]) as [3, T, H, D]: q, k, v, with q's and
    k's heads l2-normed (in float32 from the conv's rounded output, rounded to x's dtype), for
    kda_extend(qk_normed=True)."""
    out = causal_conv_extend(x, weight, conv_state, rows, lens, history)
    q, k, v = (t.reshape(x.shape[0], heads, -1) for t in out.chunk(3, dim=-1))
    return torch.stack([_l2norm(q.float()).to(x.dtype), _l2norm(k.float()).to(x.dtype), v])


def causal_conv_uniform(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    rows: torch.Tensor,
    step_len: int,
    history: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """causal_conv_extend for a batch where every request adds step_len tokens. Graph-safe."""
    kernel, chans = weight.shape[-1], x.shape[-1]
    new = x.view(-1, step_len, chans).transpose(1, 2).to(weight.dtype)
    seq = torch.cat([conv_state[rows].to(weight.dtype), new], dim=-1)  # [B, C, K-1+L]
    out = F.silu(F.conv1d(seq, weight.unsqueeze(1), groups=chans))  # [B, C, L]
    if history is not None:
        history.append(seq)
    conv_state[rows] = seq[:, :, step_len : step_len + kernel - 1].to(conv_state.dtype)
    return out.transpose(1, 2).reshape(-1, chans).to(x.dtype)


def causal_conv_decode(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """One token per request. x: [B, C]; conv_state[rows] shifts by one. Graph-safe."""
    seq = torch.cat([conv_state[rows].to(weight.dtype), x.to(weight.dtype).unsqueeze(-1)], dim=-1)
    out = F.silu((seq * weight.unsqueeze(0)).sum(-1))
    conv_state[rows] = seq[:, :, 1:].to(conv_state.dtype)
    return out.to(x.dtype)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    # Matches FLA and transformers: x / sqrt(sum(x^2) + eps), not F.normalize.
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _delta_step(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """state [N,H,Dk,Dv]; q,k,g [N,H,Dk]; v [N,H,Dv]; beta [N,H]. All float32 (or all float64).

    state' = (I - beta k k^T) diag(exp g) state + beta k v^T, out = state'^T q."""
    state = state * g.exp().unsqueeze(-1)
    kv_mem = (state * k.unsqueeze(-1)).sum(-2)
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    out = (state * q.unsqueeze(-1)).sum(-2)
    return out, state


def kda_extend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor,
    lens: list[int],
    history: list[torch.Tensor] | None = None,
    *,
    gate: ForgetGate | None = None,
    qk_normed: bool = False,
) -> torch.Tensor:
    """KDA over a ragged batch starting from `state[rows]` (updated in place).

    q, k: [T, H, Dk] (l2-normalised here); v: [T, H, Dv]; g: [T, H, Dk] log-decay;
    beta: [T, H]. Returns [T, H, Dv] in q's dtype. history: if given, receives the state after
    every position, [B, max_len, H, Dk, Dv] float32 (for speculative rollback). Arithmetic in
    float32, or float64 for float64 q.
    gate: if given, g holds the forget gate's logits f (f_b_proj's output, [T, H, Dk]) and the
    log decay is forget_gate(f, *gate) (the fast path applies it inside fla's chunk kernel).
    qk_normed: q and k come l2-normed (conv_qkv_extend's), only scaled here.
    """
    if gate is not None:
        g = forget_gate(g.flatten(1), *gate, q.shape[1])
    out_dtype = q.dtype
    heads, dk = q.shape[1], q.shape[2]
    wide = _compute_dtype(q)
    q, k = q.to(wide), k.to(wide)
    q, k = (q, k) if qk_normed else (_l2norm(q), _l2norm(k))
    q = q * dk**-0.5
    v, g, beta = v.to(wide), g.to(wide), beta.to(wide)
    num_reqs, max_len = len(lens), max(lens)
    starts = torch.tensor([0] + lens[:-1], device=q.device).cumsum(0)
    lens_t = torch.tensor(lens, device=q.device)
    s = state[rows].to(wide)
    out = torch.empty(q.shape[0], heads, v.shape[-1], device=q.device, dtype=wide)
    states = [] if history is not None else None
    for t in range(max_len):
        active = lens_t > t
        idx = (starts + t).clamp(max=q.shape[0] - 1)
        o_t, s_new = _delta_step(s, q[idx], k[idx], v[idx], g[idx], beta[idx])
        s = torch.where(active.view(num_reqs, 1, 1, 1), s_new, s)
        out[idx[active]] = o_t[active]
        if states is not None:
            states.append(s)
    if states is not None:
        history.append(torch.stack(states, dim=1))
    state[rows] = s.to(state.dtype)
    return out.to(out_dtype)


def kda_uniform(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor,
    step_len: int,
    history: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """kda_extend for a batch where every request adds step_len tokens. Graph-safe."""
    heads, dk = q.shape[1], q.shape[2]

    def per_req(t: torch.Tensor) -> torch.Tensor:  # [B*L, ...] -> [B, L, ...] float32
        return t.float().view(-1, step_len, *t.shape[1:])

    qs, ks = per_req(_l2norm(q.float()) * dk**-0.5), per_req(_l2norm(k.float()))
    vs, gs, bs = per_req(v), per_req(g), per_req(beta)
    s = state[rows].float()
    outs, states = [], []
    for t in range(step_len):
        o_t, s = _delta_step(s, qs[:, t], ks[:, t], vs[:, t], gs[:, t], bs[:, t])
        outs.append(o_t)
        states.append(s)
    if history is not None:
        history.append(torch.stack(states, dim=1))
    state[rows] = s.to(state.dtype)
    return torch.stack(outs, dim=1).view(-1, heads, v.shape[-1]).to(q.dtype)


def kda_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor,
) -> torch.Tensor:
    """One token per request (shapes as kda_extend with T = B). Graph-safe."""
    dk = q.shape[-1]
    o, s = _delta_step(
        state[rows].float(),
        _l2norm(q.float()) * dk**-0.5,
        _l2norm(k.float()),
        v.float(),
        g.float(),
        beta.float(),
    )
    state[rows] = s.to(state.dtype)
    return o.to(q.dtype)


def forget_gate(
    f: torch.Tensor,
    dt_bias: torch.Tensor,
    a_log: torch.Tensor,
    lower_bound: float | None,
    heads: int,
) -> torch.Tensor:
    """Per-channel log decay g [T, H, Dk] (float32) from the forget gate's logits f [T, H*Dk]
    (f_b_proj's output): lower_bound * sigmoid(exp(A_log) * (f + dt_bias)), or without a lower
    bound -exp(A_log) * softplus(f + dt_bias)."""
    g = (f.float() + dt_bias).view(f.shape[0], heads, -1)
    rate = a_log.exp().view(1, heads, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * g)
    return -rate * F.softplus(g, threshold=20.0)


def gated_norm(
    o: torch.Tensor, gate: torch.Tensor, o_norm: torch.Tensor, eps: float
) -> torch.Tensor:
    """The output's RMSNorm per head (o [T, H, Dv]), in float32, scaled by o_norm and gated by
    sigmoid(gate) (g_b_proj's output [T, H*Dv]); [T, H*Dv] in o's dtype."""
    of = o.float()
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps) * o_norm
    return (of * torch.sigmoid(gate.view(o.shape).float())).to(o.dtype).flatten(1)


class ForgetGate(NamedTuple):
    """forget_gate's parameters past its logits: kda_extend(gate=) applies them."""

    dt_bias: torch.Tensor  # [H*Dk] float32
    a_log: torch.Tensor  # [H] float32
    lower_bound: float | None


class KDAWeights(NamedTuple):
    """A KDA layer's parameters its core reads, past the input projections (serving/models/
    kda.py's, this rank's)."""

    conv: torch.Tensor  # [3*H*D, K] float32: q | k | v depthwise kernels
    dt_bias: torch.Tensor  # [H*D] float32
    a_log: torch.Tensor  # [H] float32
    o_norm: torch.Tensor  # [D] float32
    lower_bound: float | None  # the bounded forget gate's, or None: -exp(A_log) * softplus
    eps: float  # the output RMSNorm's
    f_b: torch.Tensor  # [H*D, R] f_b_proj's weight: the model's dtype, or block FP8 (e4m3)
    f_b_scale: torch.Tensor | None  # its block scales [ceil(H*D/128), ceil(R/128)] if FP8
    g_b: torch.Tensor  # [H*D, R] g_b_proj's, likewise
    g_b_scale: torch.Tensor | None


def head_projection(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None):
    """x W^T as the layer's Linear computes it: in x's dtype, or W8A8 for a block-FP8 W."""
    if scale is None:
        return F.linear(x, weight)
    return block_fp8_linear(x, weight, scale)


def kda_decode_layer(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    f_a: torch.Tensor,
    b: torch.Tensor,
    g_a: torch.Tensor,
    weights: KDAWeights,
    conv_state: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor,
    step_len: int = 1,
    history: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """A decode-phase step through a KDA layer's core, step_len tokens per request (1, or a
    speculative verify's draft tokens): the causal conv + SiLU of q, k, v, the forget gate from
    f_b_proj(f_a), beta = sigmoid(b), the gated delta rule on state[rows] (in place), the
    per-head RMSNorm gated by g_b_proj(g_a). q, k, v [B*step_len, H*D]; f_a, g_a
    [B*step_len, R]; b [B*step_len, H]. Returns [B*step_len, H*D] in q's dtype. With history
    (a verify) the conv and the recurrence take their uniform forms and append their histories
    (conv inputs [B, 3*H*D, K-1+step_len], states [B, step_len, H, D, D]); a decode step
    without it takes the decode forms. Graph-safe."""
    heads, dim = state.shape[1], state.shape[2]
    mixed = torch.cat([q, k, v], dim=-1)
    decode = step_len == 1 and history is None
    if decode:
        mixed = causal_conv_decode(mixed, weights.conv, conv_state, rows)
    else:
        mixed = causal_conv_uniform(mixed, weights.conv, conv_state, rows, step_len, history)
    q, k, v = (t.view(-1, heads, dim) for t in mixed.chunk(3, dim=-1))
    f = head_projection(f_a, weights.f_b, weights.f_b_scale)
    g = forget_gate(f, weights.dt_bias, weights.a_log, weights.lower_bound, heads)
    beta = torch.sigmoid(b).float()
    if decode:
        o = kda_decode(q, k, v, g, beta, state, rows)
    else:
        o = kda_uniform(q, k, v, g, beta, state, rows, step_len, history)
    gate = head_projection(g_a, weights.g_b, weights.g_b_scale)
    return gated_norm(o, gate, weights.o_norm, weights.eps)

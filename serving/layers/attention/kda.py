"""KDA's stateful core: the short causal conv and the gated delta rule over the request rows'
conv and recurrent states (KDALayerCache), and every KDA kernel choice (kernels.fast_path: on
CUDA kernels/triton/kda.py, else kernels/kda.py's references). A decode or uniform batch (one or
step_len tokens per request: EAGLE's verify; graph-safe) runs the whole core in one call
(decode_core: one kernel on the fast path, from the projections through the gated norm); a
ragged extend (extend_core) runs the conv (short_conv) and the recurrence (delta_rule) apart.

history (multi-token batches): receives [conv inputs, per-position states] for rollback.
batch.kda_saves (prefill): snapshots of the states at positions inside the chunk, taken between
passes of the same kernel (the prefix cache's; serving/forward_batch.KDASaves).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels import fast_path
from kernels import kda as kda_kernels
from kernels.kda import ForgetGate, KDAWeights
from serving.forward_batch import ForwardBatch, KDASaves
from serving.memory.cache import KDALayerCache


def _ops(x: torch.Tensor):
    """kernels.kda, or on CUDA kernels.triton.kda (fla-core + a Triton conv): same signatures."""
    if fast_path(x):
        from kernels.triton import kda

        return kda
    return kda_kernels


def decode_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    f_a: torch.Tensor,
    g_a: torch.Tensor,
    b: torch.Tensor,
    weights: KDAWeights,
    batch: ForwardBatch,
    cache: KDALayerCache,
    history: list[torch.Tensor] | None,
) -> torch.Tensor:
    """A decode or uniform batch's core (kda_decode_layer), from in_proj's outputs to the gated
    norm's [T, H*D], continuing each request's states."""
    step_len = 1 if batch.is_decode else batch.step_len
    assert step_len is not None, "decode_core takes decode and uniform batches"
    return _ops(q).kda_decode_layer(
        q, k, v, f_a, b, g_a, weights, cache.conv, cache.state, batch.req_rows, step_len, history
    )


def extend_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    f: torch.Tensor,
    gate: torch.Tensor,
    b: torch.Tensor,
    weights: KDAWeights,
    batch: ForwardBatch,
    cache: KDALayerCache,
    history: list[torch.Tensor] | None,
) -> torch.Tensor:
    """A ragged extend's core: the conv (q and k l2-normed with it), the recurrence with the
    forget gate from f (f_b_proj's output; applied inside the recurrence's op), the gated norm
    with gate (g_b_proj's); [T, H*D]."""
    heads, dim = cache.state.shape[1], cache.state.shape[2]
    q, k, v = short_conv(joined_columns(q, k, v), weights.conv, heads, batch, cache, history)
    forget = ForgetGate(weights.dt_bias, weights.a_log, weights.lower_bound)
    beta = torch.sigmoid(b).float()
    o = delta_rule(q, k, v, f.view(-1, heads, dim), beta, forget, batch, cache, history)
    return _ops(o).gated_norm(o, gate, weights.o_norm, weights.eps)


def joined_columns(*parts: torch.Tensor) -> torch.Tensor:
    """The parts [T, n_i] side by side as [T, sum n_i]: a view when they already lie so in one
    tensor (q, k, v: the first columns of the stacked input projection's output), else a copy
    (torch.cat)."""
    first, width = parts[0], sum(p.shape[1] for p in parts)
    at, size = first.data_ptr(), first.element_size()
    for p in parts:
        if p.stride() != first.stride() or p.stride(1) != 1 or p.data_ptr() != at:
            return torch.cat(parts, dim=-1)
        at += p.shape[1] * size
    if first.shape[0] > 1 and first.stride(0) < width:
        return torch.cat(parts, dim=-1)
    return first.as_strided((first.shape[0], width), (first.stride(0), 1))


def short_conv(
    mixed: torch.Tensor,
    weight: torch.Tensor,
    heads: int,
    batch: ForwardBatch,
    cache: KDALayerCache,
    history: list[torch.Tensor] | None,
) -> torch.Tensor:
    """Depthwise causal conv + SiLU over a ragged extend's q | k | v [T, 3*H*D], continuing
    each request's conv state: [3, T, H, D], q and k l2-normed (conv_qkv_extend)."""
    ops = _ops(mixed)
    if batch.kda_saves is not None:

        def save(rows: torch.Tensor, slots: torch.Tensor) -> None:
            cache.saved_conv[slots] = cache.conv[rows]

        return _in_passes(
            (mixed,),
            batch.kda_saves,
            lambda xs, rows, lens: ops.conv_qkv_extend(*xs, weight, cache.conv, rows, lens, heads),
            save,
            token_dim=1,
        )
    return ops.conv_qkv_extend(
        mixed, weight, cache.conv, batch.req_rows, batch.lens_cpu, heads, history
    )


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    f: torch.Tensor,
    beta: torch.Tensor,
    forget: ForgetGate,
    batch: ForwardBatch,
    cache: KDALayerCache,
    history: list[torch.Tensor] | None,
) -> torch.Tensor:
    """The gated delta-rule recurrence over a ragged extend, from each request's state (updated
    in place); f: the forget gate's logits [T, H, Dk], forget its parameters."""
    ops = _ops(q)
    rows = batch.req_rows
    if batch.kda_saves is not None:

        def save(rows: torch.Tensor, slots: torch.Tensor) -> None:
            cache.saved_state[slots] = cache.state[rows]

        return _in_passes(
            (q, k, v, f, beta),
            batch.kda_saves,
            lambda xs, rows, lens: ops.kda_extend(
                *xs, cache.state, rows, lens, gate=forget, qk_normed=True
            ),
            save,
        )
    return ops.kda_extend(
        q, k, v, f, beta, cache.state, rows, batch.lens_cpu, history, gate=forget, qk_normed=True
    )


def _in_passes(
    inputs: tuple[torch.Tensor, ...],
    saves: KDASaves,
    run: Callable[[tuple[torch.Tensor, ...], torch.Tensor, list[int]], torch.Tensor],
    save: Callable[[torch.Tensor, torch.Tensor], None],
    token_dim: int = 0,
) -> torch.Tensor:
    """run() over each pass's tokens, save() after it. Each pass continues the rows' states in
    place, so the result equals one run over the whole chunk. token_dim: the results' token
    dimension (the inputs' is 0)."""
    pieces = []
    for p in saves.passes:
        pieces.append((p.index, run(tuple(t[p.index] for t in inputs), p.rows, p.lens)))
        if p.save_rows.numel():
            save(p.save_rows, p.save_slots)
    first = pieces[0][1]
    shape = list(first.shape)
    shape[token_dim] = inputs[0].shape[0]
    out = first.new_empty(shape)
    for index, piece in pieces:  # index: a slice or a tensor of token positions
        out[(slice(None),) * token_dim + (index,)] = piece
    return out

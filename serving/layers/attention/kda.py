"""KDA's stateful core: the short causal conv and the gated delta rule over the request rows'
conv and recurrent states (KDALayerCache). The batch's shape picks the kernel: decode (one token
per request), uniform (step_len tokens per request: EAGLE verify, graph-safe) or ragged extend.

history (multi-token batches): receives [conv inputs, per-position states] for rollback.
batch.kda_saves (prefill): snapshots of the states at positions inside the chunk, taken between
passes of the same kernel (the prefix cache's; serving/forward_batch.KDASaves).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels import fast_path
from kernels import kda as kda_kernels
from serving.forward_batch import ForwardBatch, KDASaves
from serving.memory.cache import KDALayerCache


def _ops(x: torch.Tensor):
    """kernels.kda, or on CUDA kernels.triton.kda (fla-core + a Triton conv): same signatures."""
    if fast_path(x):
        from kernels.triton import kda

        return kda
    return kda_kernels


def short_conv(
    mixed: torch.Tensor,
    weight: torch.Tensor,
    batch: ForwardBatch,
    cache: KDALayerCache,
    history: list[torch.Tensor] | None,
) -> torch.Tensor:
    """Depthwise causal conv + SiLU over [T, C], continuing each request's conv state."""
    ops = _ops(mixed)
    if batch.is_decode:
        return ops.causal_conv_decode(mixed, weight, cache.conv, batch.req_rows)
    if batch.step_len is not None:
        return ops.causal_conv_uniform(
            mixed, weight, cache.conv, batch.req_rows, batch.step_len, history
        )
    if batch.kda_saves is not None:

        def save(rows: torch.Tensor, slots: torch.Tensor) -> None:
            cache.saved_conv[slots] = cache.conv[rows]

        return _in_passes(
            (mixed,),
            batch.kda_saves,
            lambda xs, rows, lens: ops.causal_conv_extend(*xs, weight, cache.conv, rows, lens),
            save,
        )
    return ops.causal_conv_extend(
        mixed, weight, cache.conv, batch.req_rows, batch.lens_cpu, history
    )


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    batch: ForwardBatch,
    cache: KDALayerCache,
    history: list[torch.Tensor] | None,
) -> torch.Tensor:
    """The gated delta-rule recurrence from each request's state (updated in place)."""
    ops = _ops(q)
    rows = batch.req_rows
    if batch.is_decode:
        return ops.kda_decode(q, k, v, g, beta, cache.state, rows)
    if batch.step_len is not None:
        return ops.kda_uniform(q, k, v, g, beta, cache.state, rows, batch.step_len, history)
    if batch.kda_saves is not None:

        def save(rows: torch.Tensor, slots: torch.Tensor) -> None:
            cache.saved_state[slots] = cache.state[rows]

        return _in_passes(
            (q, k, v, g, beta),
            batch.kda_saves,
            lambda xs, rows, lens: ops.kda_extend(*xs, cache.state, rows, lens),
            save,
        )
    return ops.kda_extend(q, k, v, g, beta, cache.state, rows, batch.lens_cpu, history)


def _in_passes(
    inputs: tuple[torch.Tensor, ...],
    saves: KDASaves,
    run: Callable[[tuple[torch.Tensor, ...], torch.Tensor, list[int]], torch.Tensor],
    save: Callable[[torch.Tensor, torch.Tensor], None],
) -> torch.Tensor:
    """run() over each pass's tokens, save() after it. Each pass continues the rows' states in
    place, so the result equals one run over the whole chunk."""
    pieces = []
    for p in saves.passes:
        pieces.append((p.index, run(tuple(t[p.index] for t in inputs), p.rows, p.lens)))
        if p.save_rows.numel():
            save(p.save_rows, p.save_slots)
    first = pieces[0][1]
    out = first.new_empty((inputs[0].shape[0], *first.shape[1:]))
    for index, piece in pieces:
        out[index] = piece
    return out

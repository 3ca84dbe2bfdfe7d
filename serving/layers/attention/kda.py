"""KDA's stateful core: the short causal conv and the gated delta rule over the request rows'
conv and recurrent states (KDALayerCache). The batch's shape picks the kernel: decode (one token
per request), uniform (step_len tokens per request: EAGLE verify, graph-safe) or ragged extend.

history (multi-token batches): receives [conv inputs, per-position states] for rollback.
"""

from __future__ import annotations

import torch

from kernels import fast_path
from kernels import kda as kda_kernels
from serving.forward_batch import ForwardBatch
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
    return ops.kda_extend(q, k, v, g, beta, cache.state, rows, batch.lens_cpu, history)

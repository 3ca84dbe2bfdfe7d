"""KDA's stateful core: the short causal conv and the gated delta rule over the request rows'
conv and recurrent states (KDALayerCache). The batch's shape picks the kernel: decode (one token
per request), uniform (step_len tokens per request: EAGLE verify, graph-safe) or ragged extend.

history (multi-token batches): receives [conv inputs, per-position states] for rollback.
"""

from __future__ import annotations

import torch

from kernels import kda as kda_kernels
from serving.forward_batch import ForwardBatch
from serving.memory.cache import KDALayerCache


def short_conv(
    mixed: torch.Tensor,
    weight: torch.Tensor,
    batch: ForwardBatch,
    cache: KDALayerCache,
    history: list[torch.Tensor] | None,
) -> torch.Tensor:
    """Depthwise causal conv + SiLU over [T, C], continuing each request's conv state."""
    if batch.is_decode:
        return kda_kernels.causal_conv_decode(mixed, weight, cache.conv, batch.req_rows)
    if batch.step_len is not None:
        return kda_kernels.causal_conv_uniform(
            mixed, weight, cache.conv, batch.req_rows, batch.step_len, history
        )
    return kda_kernels.causal_conv_extend(
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
    rows = batch.req_rows
    if batch.is_decode:
        return kda_kernels.kda_decode(q, k, v, g, beta, cache.state, rows)
    if batch.step_len is not None:
        return kda_kernels.kda_uniform(q, k, v, g, beta, cache.state, rows, batch.step_len, history)
    return kda_kernels.kda_extend(q, k, v, g, beta, cache.state, rows, batch.lens_cpu, history)

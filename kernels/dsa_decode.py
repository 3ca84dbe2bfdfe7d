"""A DSA layer's step (decode, or a uniform verify of step_len tokens per request) between its
projections, as three operations; the torch references of kernels/triton/dsa_decode.py.

    write_step(q_a, kv_a, q_norm, kv_norm, eps, latent, step, index) -> q_lora
        The step's cache writes: RMSNorm of q_a (returned) and of kv_a (stored as the tokens'
        latents); with an indexer, each token's key LayerNorm(wk) and gate enter the tail ring,
        and every pool a token closes is compressed into its pooled-key row.
    step_queries(q, kv_b_nope, index, step, counters=None) -> (q_abs, slots | None)
        MLA's absorbed queries q_abs[t, h] = kv_b_nope[h]^T q[t, h]; with an indexer, the cache
        slots [T, W] int32 (-1 = empty) each token attends: its best select_pools complete pools
        by score (the lower pool index first among equal scores), expanded to their tokens,
        then its open pool (the tail) when select_tail.
    step_attention(q_abs, latent, slots, scale, kv_b_v) -> o [T, H * V]
        Sparse MLA over the slots, each head's latent output taken up by kv_b_v[h].

Order (the caller's): write_step, then step_queries, then step_attention; a token may select
its own pool, its tail or itself. Token t belongs to request t // step_len; a request's tokens
have consecutive positions. W = select_pools * kpool (+ kpool - 1 with the tail).

The slots here come in the order of kernels.indexer.select_tokens (by score); the Triton
version lists the selected pools by pool index. Sparse MLA takes them as a set (up to the
summation order), so callers must not depend on the order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels.indexer import kpool_compress, score_pools, select_tokens
from kernels.norm import rms_norm
from kernels.sparse_mla import sparse_mla_attention


class StepLayout(NamedTuple):
    """Where a step's T = B * step_len tokens live."""

    req_to_token: torch.Tensor  # [rows, max_context] int64 slot of each position
    req_rows: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [T] int64
    token_slots: torch.Tensor  # [T] int64 latent slot of each token
    step_len: int
    max_pools: int  # >= 1 and >= every token's complete pools ((position + 1) // kpool)


class IndexWrite(NamedTuple):
    """An indexer layer's inputs to write_step."""

    wk: torch.Tensor  # [T, D] key projection (before its LayerNorm)
    gates: torch.Tensor  # [T, D] compression gates
    k_norm_weight: torch.Tensor  # [D]
    k_norm_bias: torch.Tensor  # [D]
    k_norm_eps: float
    ape: torch.Tensor  # [kpool, D] float32
    index_keys: torch.Tensor  # [slots // kpool, D] pooled keys
    tail_keys: torch.Tensor  # [rows, ring, D]; position p at p % ring
    tail_gates: torch.Tensor  # [rows, ring, D]


class IndexQuery(NamedTuple):
    """An indexer layer's inputs to step_queries."""

    q: torch.Tensor  # [T, Hi, D]
    head_weights: torch.Tensor  # [T, Hi] weights_proj output, before head_scale
    head_scale: float  # Hi^-0.5
    index_keys: torch.Tensor  # [slots // kpool, D]
    kpool: int
    select_pools: int
    select_tail: bool


def write_step(
    q_a: torch.Tensor,
    kv_a: torch.Tensor,
    q_norm: torch.Tensor,
    kv_norm: torch.Tensor,
    eps: float,
    latent: torch.Tensor,
    step: StepLayout,
    index: IndexWrite | None,
) -> torch.Tensor:
    """q_a [T, q_lora], kv_a [T, R] -> q_lora [T, q_lora]; writes latent[token_slots] and,
    with `index`, the ring and the pooled keys of the pools that close."""
    latent[step.token_slots] = rms_norm(kv_a, kv_norm, eps).to(latent.dtype)
    if index is not None:
        _write_index(index, step)
    return rms_norm(q_a, q_norm, eps)


def _write_index(index: IndexWrite, step: StepLayout) -> None:
    """All of the step's keys enter the ring before any pool is compressed, so a pool that
    closes mid-step finds its members. The ring holds kpool-1 + step_len slots, so this step's
    writes never evict a member of a pool it still closes."""
    kp, ring = index.ape.shape[0], index.tail_keys.shape[1]
    assert step.step_len <= ring - kp + 1, "ring too small"
    dim = index.wk.shape[-1]
    k = F.layer_norm(index.wk, (dim,), index.k_norm_weight, index.k_norm_bias, index.k_norm_eps)
    rows = step.req_rows.repeat_interleave(step.step_len)
    pos = step.positions
    index.tail_keys[rows, pos % ring] = k.to(index.tail_keys.dtype)
    index.tail_gates[rows, pos % ring] = index.gates.to(index.tail_gates.dtype)
    members = (pos[:, None] - kp + 1 + torch.arange(kp, device=pos.device)) % ring
    pooled = kpool_compress(
        index.tail_keys[rows[:, None], members], index.tail_gates[rows[:, None], members], index.ape
    )
    # Tokens that close no pool write to pooled-key row 0 (the padding page's), so two tokens of
    # one request that share a pool never race on its row.
    closes = pos % kp == kp - 1
    dst = torch.where(closes, step.req_to_token[rows, (pos // kp) * kp] // kp, 0)
    index.index_keys[dst] = pooled.to(index.index_keys.dtype)


def step_queries(
    q: torch.Tensor,
    kv_b_nope: torch.Tensor,
    index: IndexQuery | None,
    step: StepLayout,
    counters: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [T, H, nope], kv_b_nope [H, nope, R] -> (q_abs [T, H, R] in q's dtype, slots [T, W]
    int32 or None without `index`). counters: unused here (the Triton version's per-token
    cross-program counters). scores: optional [T, max_pools] float32 that receives the pool
    scores (tests; entries of pools a token cannot see are left undefined)."""
    q_abs = torch.einsum("thd,hdr->thr", q, kv_b_nope)
    if index is None:
        return q_abs, None
    kp, r2t = index.kpool, step.req_to_token
    # one gather of pooled keys per request, shared by its step_len queries
    pools = torch.arange(step.max_pools, device=q.device)
    keys = index.index_keys[r2t[step.req_rows[:, None], pools[None, :] * kp] // kp]
    head_w = index.head_weights.float() * index.head_scale
    pool_scores = score_pools(index.q, head_w, keys, index.q.shape[-1] ** -0.5)
    if scores is not None:
        scores.copy_(pool_scores)
    positions = select_tokens(
        pool_scores, step.positions, kp, index.select_pools, index.select_tail
    )
    rows = step.req_rows.repeat_interleave(step.step_len)[:, None]
    slots = torch.where(positions >= 0, r2t[rows, positions.clamp(min=0)], -1)
    return q_abs, slots.to(torch.int32)


def step_attention(
    q_abs: torch.Tensor,
    latent: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    kv_b_v: torch.Tensor,
) -> torch.Tensor:
    """q_abs [T, H, R], slots [T, W], kv_b_v [H, V, R] -> o [T, H * V] in q_abs's dtype."""
    o_lat = sparse_mla_attention(q_abs, latent, slots, scale)
    return torch.einsum("thr,hvr->thv", o_lat, kv_b_v).flatten(1)

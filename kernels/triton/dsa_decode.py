"""A DSA layer's step (decode, or a uniform verify of step_len tokens per request) in four
launches between its projections; semantics and signatures of kernels/dsa_decode.py.

    write_step(q_a, kv_a, q_norm, kv_norm, eps, latent, step, index) -> q_lora
        One launch, programs (token, part): part 0 the q_a RMSNorm; part 1 the kv_a RMSNorm
        stored as the token's latent; part 2 (indexer layers) the key LayerNorm and the gate
        into the tail ring, and the compression of the pool the token closes. A pool's members
        from earlier steps are read from the ring; those of this step come from this step's
        own inputs (their LayerNorm recomputed), never from the ring another program writes,
        so no program waits on another. (The ring sizing guarantees that this step's ring
        writes never hit a slot holding an earlier member of a pool it closes.)
    step_queries(q, kv_b_nope, index, step, counters) -> (q_abs, slots)
        One launch of two kinds of programs. Absorb programs (token block, head, R block):
        q_abs = q @ kv_b_nope[h], each weight tile read once per 16 tokens. Score programs
        (token, block of pools): the token's pool scores sum_h w_h relu(scale q_h . k_p) from
        the paged pooled keys into a float32 scratch row; then each bumps the token's counter
        and the last one of the token selects (below) and resets the counter to 0, so graph
        replays start clean. `counters`: int32 zeros, one per token at least, owned by the call
        site (no other kernel that could overlap may share them); None allocates them.
    step_attention(q_abs, latent, slots, scale, kv_b_v) -> o [T, H * V]
        Two launches. Split attention (token, split of W): the split's latent rows gathered
        once for all heads (H padded to 16 for the tensor cores; the padding costs FLOPs, not
        bytes), online softmax in float32, a normalised partial and its log-sum-exp. Then
        combine + up-projection (token or block of 16 tokens, head, V block): the splits
        merged in float32, rounded like the reference's latent output, times kv_b_v[h].

Selection (exact; the reference's set). Scores become order-preserving uint32 keys (-0.0 folded
into +0.0, as the float comparison does). With n visible pools and k = select_pools < n, a
radix search over the key bits (RADIX_BITS per pass, the 2^RADIX_BITS - 1 candidate digits of
a pass counted together) finds tau, the k-th largest key. Every pool above tau is selected, and
of the pools equal to tau the lowest-indexed k - #above: the reference's stable-sort tie rule.
A scan in pool order then writes the selected pool ids compactly (in ascending pool order, not
by score), and the same program expands them to the tokens' cache slots; with n <= k every
visible pool is taken. No torch.topk, no sort, no host sync.

All launch parameters come from host ints (T, step_len, max_pools, shapes), so every launch is
CUDA-graph capturable. Deterministic: fixed summation orders, the only atomics are the integer
counters.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.dsa_decode import IndexQuery, IndexWrite, StepLayout
from kernels.triton import INTERPRETER
from kernels.triton.online_softmax import online_softmax_update
from kernels.triton.pdl import LAUNCH, grid_dependency
from kernels.triton.sparse_mla import _num_sms  # interpreter: 4, so tests meet several splits

_LOG2E = 1.4426950408889634
_MIN_SPLIT_LEN = 64  # latent rows per attention split at least
# the selection's scan for rows of up to 512 pools: 8 passes of 4 bits (16 candidates x 4 keys
# per thread at 4 warps)
SHORT_CHUNK, SHORT_BITS = 512, 4


# ------------------------------------------------------------------------------- write_step


@triton.jit
def _rms_norm_row(x_ptr, w_ptr, eps, N: tl.constexpr, BLOCK: tl.constexpr):
    """kernels.norm.rms_norm of one row: normalised in fp32, rounded to x's dtype, then scaled
    (the product rounded to x's dtype by the caller's store)."""
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    y = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return (w * y).to(x.dtype), offs, mask


@triton.jit
def _layer_norm_rows(x, mask, w, b, eps, D: tl.constexpr):
    """F.layer_norm over the last dim of x [M, BLOCK_D] (fp32 math, like torch's kernels)."""
    mean = tl.sum(x, axis=1) / D
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / D + eps)
    return xc * rstd[:, None] * w[None, :] + b[None, :]


@triton.jit
def _write_step_kernel(
    qa_ptr,
    kva_ptr,
    qn_ptr,
    kvn_ptr,
    qlora_ptr,
    latent_ptr,
    slots_ptr,
    wk_ptr,
    gates_ptr,
    knw_ptr,
    knb_ptr,
    ape_ptr,
    keys_ptr,
    tk_ptr,
    tg_ptr,
    r2t_ptr,
    rows_ptr,
    pos_ptr,
    stride_qa,
    stride_kva,
    stride_latent,
    stride_wk,
    stride_g,
    stride_key,
    stride_tail_row,
    stride_tail_slot,
    stride_r2t,
    ring,
    eps,
    k_eps,
    QL: tl.constexpr,
    BLOCK_QL: tl.constexpr,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_KP: tl.constexpr,
    STEP_LEN: tl.constexpr,
    HAS_INDEX: tl.constexpr,
):
    grid_dependency()  # first: kernels/triton/pdl.py
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    if part == 0:
        y, offs, mask = _rms_norm_row(qa_ptr + t * stride_qa, qn_ptr, eps, QL, BLOCK_QL)
        tl.store(qlora_ptr + t * QL + offs, y, mask=mask)
    elif part == 1:
        y, offs, mask = _rms_norm_row(kva_ptr + t * stride_kva, kvn_ptr, eps, R, BLOCK_R)
        slot = tl.load(slots_ptr + t)
        dst = latent_ptr + slot * stride_latent + offs
        tl.store(dst, y.to(latent_ptr.dtype.element_ty), mask=mask)
    elif HAS_INDEX:
        row = tl.load(rows_ptr + t // STEP_LEN)
        pos = tl.load(pos_ptr + t)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        knw = tl.load(knw_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        knb = tl.load(knb_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        # this token's key and gate into the ring
        x = tl.load(wk_ptr + t * stride_wk + offs_d[None, :], mask=d_mask[None, :], other=0.0)
        k = _layer_norm_rows(x.to(tl.float32), d_mask[None, :], knw, knb, k_eps, D)
        k = k.to(x.dtype)
        g = tl.load(gates_ptr + t * stride_g + offs_d[None, :], mask=d_mask[None, :], other=0.0)
        ring_at = row * stride_tail_row + (pos % ring) * stride_tail_slot + offs_d[None, :]
        tl.store(tk_ptr + ring_at, k.to(tk_ptr.dtype.element_ty), mask=d_mask[None, :])
        tl.store(tg_ptr + ring_at, g.to(tg_ptr.dtype.element_ty), mask=d_mask[None, :])
        if pos % KP == KP - 1:  # the token closes pool pos // KP: compress its members
            offs_j = tl.arange(0, BLOCK_KP)
            j_mask = offs_j < KP
            member = pos - KP + 1 + offs_j
            first = pos - t % STEP_LEN  # the request's first position in this step
            mine = j_mask & (member >= first)
            old = j_mask & (member < first)
            tok = t - (pos - member)
            md = mine[:, None] & d_mask[None, :]
            xs = tl.load(wk_ptr + tok[:, None] * stride_wk + offs_d[None, :], mask=md, other=0.0)
            ks = _layer_norm_rows(xs.to(tl.float32), md, knw, knb, k_eps, D).to(xs.dtype)
            gs = tl.load(gates_ptr + tok[:, None] * stride_g + offs_d[None, :], mask=md, other=0.0)
            od = old[:, None] & d_mask[None, :]
            at = row * stride_tail_row + (member % ring)[:, None] * stride_tail_slot
            at = at + offs_d[None, :]
            kr = tl.load(tk_ptr + at, mask=od, other=0.0)
            gr = tl.load(tg_ptr + at, mask=od, other=0.0)
            keys = tl.where(mine[:, None], ks.to(tk_ptr.dtype.element_ty), kr)
            gts = tl.where(mine[:, None], gs.to(tg_ptr.dtype.element_ty), gr)
            # kernels.indexer.kpool_compress: softmax over the members per channel, the
            # probabilities and each product rounded to the keys' dtype, summed in fp32
            a = tl.load(
                ape_ptr + offs_j[:, None] * D + offs_d[None, :],
                mask=j_mask[:, None] & d_mask[None, :],
                other=0.0,
            )
            z = tl.where(j_mask[:, None], gts.to(tl.float32) + a.to(tl.float32), float("-inf"))
            e = tl.exp(z - tl.max(z, axis=0)[None, :])
            prob = e / tl.sum(e, axis=0)[None, :]
            prod = (prob.to(keys.dtype).to(tl.float32) * keys.to(tl.float32)).to(keys.dtype)
            pooled = tl.sum(prod.to(tl.float32), axis=0)
            pool_slot = tl.load(r2t_ptr + row * stride_r2t + (pos // KP) * KP)
            dst = keys_ptr + (pool_slot // KP) * stride_key + offs_d
            tl.store(dst, pooled.to(keys_ptr.dtype.element_ty), mask=d_mask)


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
    """As kernels.dsa_decode.write_step, in one launch. Inputs may be row-strided views (the
    stacked projection's parts); their last dim must be contiguous."""
    t, ql = q_a.shape
    r = kv_a.shape[1]
    q_lora = torch.empty(t, ql, device=q_a.device, dtype=q_a.dtype)
    if t == 0:
        return q_lora
    for x in (q_a, kv_a, latent, step.req_to_token):
        assert x.stride(-1) == 1
    parts = 2
    args: list = [None] * 11
    ring, k_eps, dim, kp, strides = 1, 0.0, 16, 1, [0] * 5
    if index is not None:
        parts = 3
        kp, dim = index.ape.shape
        ring = index.tail_keys.shape[1]
        assert step.step_len <= ring - kp + 1, "ring too small"
        for x in (index.wk, index.gates, index.index_keys, index.tail_keys, index.tail_gates):
            assert x.stride(-1) == 1
        assert index.tail_gates.stride() == index.tail_keys.stride()
        args = [
            index.wk,
            index.gates,
            index.k_norm_weight,
            index.k_norm_bias,
            index.ape.contiguous(),
            index.index_keys,
            index.tail_keys,
            index.tail_gates,
            step.req_to_token,
            step.req_rows,
            step.positions,
        ]
        strides = [
            index.wk.stride(0),
            index.gates.stride(0),
            index.index_keys.stride(0),
            index.tail_keys.stride(0),
            index.tail_keys.stride(1),
        ]
        k_eps = index.k_norm_eps
    _write_step_kernel[(t, parts)](
        q_a,
        kv_a,
        q_norm,
        kv_norm,
        q_lora,
        latent,
        step.token_slots,
        *args,
        q_a.stride(0),
        kv_a.stride(0),
        latent.stride(0),
        *strides,
        step.req_to_token.stride(0),
        ring,
        eps,
        k_eps,
        QL=ql,
        BLOCK_QL=triton.next_power_of_2(ql),
        R=r,
        BLOCK_R=triton.next_power_of_2(r),
        D=dim,
        BLOCK_D=triton.next_power_of_2(dim),
        KP=kp,
        BLOCK_KP=triton.next_power_of_2(kp),
        STEP_LEN=step.step_len,
        HAS_INDEX=index is not None,
        num_warps=4,
        **LAUNCH,
    )
    return q_lora


# ---------------------------------------------------------------------------- step_queries


@triton.jit
def _absorb(
    a,
    q_ptr,
    w_ptr,
    out_ptr,
    T,
    stride_qt,
    stride_qh,
    stride_wh,
    stride_wd,
    stride_ot,
    stride_oh,
    H: tl.constexpr,
    NOPE: tl.constexpr,
    R: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_NOPE: tl.constexpr,
    BLOCK_RA: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Absorb program a = (token block, head, R block): q_abs = q[:, h] @ kv_b_nope[h]."""
    nrb: tl.constexpr = (R + BLOCK_RA - 1) // BLOCK_RA
    tb = a // (H * nrb)
    h = (a // nrb) % H
    rb = a % nrb
    offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_NOPE)
    offs_r = rb * BLOCK_RA + tl.arange(0, BLOCK_RA)
    t_mask = offs_t < T
    d_mask = offs_d < NOPE
    r_mask = offs_r < R
    q = tl.load(
        q_ptr + offs_t[:, None].to(tl.int64) * stride_qt + h * stride_qh + offs_d[None, :],
        mask=t_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    w = tl.load(
        w_ptr + h * stride_wh + offs_d[:, None] * stride_wd + offs_r[None, :],
        mask=d_mask[:, None] & r_mask[None, :],
        other=0.0,
    )
    acc = tl.dot(q, w.to(q.dtype), input_precision=DOT_PREC)
    dst = out_ptr + offs_t[:, None].to(tl.int64) * stride_ot + h * stride_oh + offs_r[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & r_mask[None, :])


@triton.jit
def _pool_keys(scores_ptr, offs, valid):
    """Order-preserving uint32 keys of float32 scores (0 where not valid; a valid score's key
    is >= 1 unless the score is a negative NaN)."""
    s = tl.load(scores_ptr + offs, mask=valid, other=0.0)
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 -> +0.0: equal floats get equal keys
    bits = s.to(tl.int32, bitcast=True)
    flip = (bits >> 31) | -2147483648  # negative: every bit; positive: the sign bit
    u = (bits ^ flip).to(tl.uint32, bitcast=True)
    return tl.where(valid, u, 0)


@triton.jit
def _pick_pools(
    n_vis, scores_ptr, pools_ptr, K: tl.constexpr, CHUNK: tl.constexpr, BITS: tl.constexpr
):
    """The ids of the min(n_vis, K) selected pools (the module docstring's rule), ascending,
    into pools_ptr[0..]."""
    digits: tl.constexpr = 1 << BITS
    k_eff = tl.minimum(n_vis, K)
    tau = tl.full([], 0, tl.uint32)  # with n_vis <= K every valid key is above it
    if n_vis > K:
        offs_c = tl.arange(0, digits).to(tl.uint32)
        prefix = tl.full([], 0, tl.uint32)
        for p in tl.static_range(32 // BITS):
            shift = 32 - (p + 1) * BITS
            cand = prefix + (offs_c << shift)  # no carry: prefix is 0 from bit `shift` down
            counts = tl.zeros([digits], dtype=tl.int32)
            for c0 in range(0, n_vis, CHUNK):
                offs = c0 + tl.arange(0, CHUNK)
                u = _pool_keys(scores_ptr, offs, offs < n_vis)
                counts += tl.sum((u[None, :] >= cand[:, None]).to(tl.int32), axis=1)
            # counts fall as the digit grows and count(>= prefix) >= K: the digit is the last
            # c >= 1 whose count still reaches K (0 if none)
            digit = tl.sum(((offs_c >= 1) & (counts >= K)).to(tl.int32), axis=0)
            prefix += digit.to(tl.uint32) << shift
        tau = prefix  # the K-th largest key
    above = tl.zeros([], dtype=tl.int32)
    for c0 in range(0, n_vis, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        above += tl.sum((_pool_keys(scores_ptr, offs, offs < n_vis) > tau).to(tl.int32), axis=0)
    ties = k_eff - above  # pools equal to tau that are taken: the lowest-indexed ones
    ties_before = tl.zeros([], dtype=tl.int32)
    taken = tl.zeros([], dtype=tl.int32)
    for c0 in range(0, n_vis, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        valid = offs < n_vis
        u = _pool_keys(scores_ptr, offs, valid)
        eq = ((u == tau) & valid).to(tl.int32)
        tie_rank = ties_before + tl.cumsum(eq, axis=0) - eq
        sel = ((u > tau) | ((eq == 1) & (tie_rank < ties))).to(tl.int32)
        at = taken + tl.cumsum(sel, axis=0) - sel
        tl.store(pools_ptr + at, offs.to(tl.int32), mask=sel == 1)
        ties_before += tl.sum(eq, axis=0)
        taken += tl.sum(sel, axis=0)


@triton.jit
def _select(
    t,
    row,
    pos,
    n_vis,
    scores_ptr,
    pools_ptr,
    r2t_ptr,
    out_ptr,
    stride_r2t,
    stride_out,
    KP: tl.constexpr,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_KP: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    CHUNK: tl.constexpr,
    RADIX_BITS: tl.constexpr,
    SHORT_CHUNK: tl.constexpr,
    SHORT_BITS: tl.constexpr,
):
    """Token t's selection from its n_vis scores -> its slots. A plan for long rows (CHUNK
    past SHORT_CHUNK) still takes the short rows' scan when the token sees few pools (graphs
    are captured at the longest context, most tokens are shorter)."""
    if CHUNK > SHORT_CHUNK:
        if n_vis <= SHORT_CHUNK:
            _pick_pools(n_vis, scores_ptr, pools_ptr, K, SHORT_CHUNK, SHORT_BITS)
        else:
            _pick_pools(n_vis, scores_ptr, pools_ptr, K, CHUNK, RADIX_BITS)
    else:
        _pick_pools(n_vis, scores_ptr, pools_ptr, K, CHUNK, RADIX_BITS)
    tl.debug_barrier()  # the pool ids, written by other threads of this program
    k_eff = tl.minimum(n_vis, K)
    offs_i = tl.arange(0, BLOCK_K)
    offs_j = tl.arange(0, BLOCK_KP)
    have = offs_i < k_eff
    pool = tl.load(pools_ptr + offs_i, mask=have, other=0).to(tl.int64)
    m2 = have[:, None] & (offs_j < KP)[None, :]
    slot = tl.load(r2t_ptr + row * stride_r2t + pool[:, None] * KP + offs_j[None, :], mask=m2)
    slot = tl.where(m2, slot, -1)
    dst = out_ptr + t * stride_out + offs_i[:, None] * KP + offs_j[None, :]
    tl.store(dst, slot.to(tl.int32), mask=(offs_i < K)[:, None] & (offs_j < KP)[None, :])
    if TAIL > 0:  # the open pool's tokens up to the query: unscored, always attended
        offs_tl = tl.arange(0, BLOCK_TAIL)
        tail = ((pos + 1) // KP) * KP + offs_tl
        ok = (offs_tl < TAIL) & (tail <= pos)
        slot = tl.load(r2t_ptr + row * stride_r2t + tail, mask=ok)
        tl.store(
            out_ptr + t * stride_out + K * KP + offs_tl,
            tl.where(ok, slot, -1).to(tl.int32),
            mask=offs_tl < TAIL,
        )


@triton.jit
def _score_select(
    s,
    qi_ptr,
    hw_ptr,
    keys_ptr,
    r2t_ptr,
    rows_ptr,
    pos_ptr,
    scores_ptr,
    pools_ptr,
    out_ptr,
    counters_ptr,
    n_pblocks,
    stride_it,
    stride_ih,
    stride_hw,
    stride_key,
    stride_r2t,
    stride_sc,
    stride_out,
    head_scale,
    softmax_scale,
    HI: tl.constexpr,
    BLOCK_HI: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KP: tl.constexpr,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_KP: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    STEP_LEN: tl.constexpr,
    BLOCK_P: tl.constexpr,
    CHUNK: tl.constexpr,
    RADIX_BITS: tl.constexpr,
    SHORT_CHUNK: tl.constexpr,
    SHORT_BITS: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Score program s = (token, block of pools); the token's last one selects."""
    t = (s // n_pblocks).to(tl.int64)
    pb = s % n_pblocks
    row = tl.load(rows_ptr + t // STEP_LEN)
    pos = tl.load(pos_ptr + t)
    n_vis = ((pos + 1) // KP).to(tl.int32)  # complete pools visible to the token
    scores_row = scores_ptr + t * stride_sc
    if pb * BLOCK_P < n_vis:
        offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
        p_mask = offs_p < n_vis
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        slot = tl.load(r2t_ptr + row * stride_r2t + offs_p * KP, mask=p_mask, other=0)
        k = tl.load(
            keys_ptr + (slot // KP)[:, None] * stride_key + offs_d[None, :],
            mask=p_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        offs_h = tl.arange(0, BLOCK_HI)
        h_mask = offs_h < HI
        q = tl.load(
            qi_ptr + t * stride_it + offs_h[:, None] * stride_ih + offs_d[None, :],
            mask=h_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        w = tl.load(hw_ptr + t * stride_hw + offs_h, mask=h_mask, other=0.0)
        w = w.to(tl.float32) * head_scale
        logits = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC)  # [HI, P]
        score = tl.sum(w[:, None] * tl.maximum(logits * softmax_scale, 0.0), axis=0)
        tl.store(scores_row + offs_p, score, mask=p_mask)
    # the last of the token's programs selects, once every score is written and visible
    tl.debug_barrier()
    if tl.atomic_add(counters_ptr + t, 1, sem="acq_rel") == n_pblocks - 1:
        _select(
            t,
            row,
            pos,
            n_vis,
            scores_row,
            pools_ptr + t * K,
            r2t_ptr,
            out_ptr,
            stride_r2t,
            stride_out,
            KP,
            K,
            BLOCK_K,
            BLOCK_KP,
            TAIL,
            BLOCK_TAIL,
            CHUNK,
            RADIX_BITS,
            SHORT_CHUNK,
            SHORT_BITS,
        )
        tl.atomic_xchg(counters_ptr + t, 0, sem="relaxed")


@triton.jit
def _queries_kernel(
    q_ptr,
    wn_ptr,
    qabs_ptr,
    qi_ptr,
    hw_ptr,
    keys_ptr,
    r2t_ptr,
    rows_ptr,
    pos_ptr,
    scores_ptr,
    pools_ptr,
    out_ptr,
    counters_ptr,
    T,
    n_score,
    n_pblocks,
    stride_qt,
    stride_qh,
    stride_wh,
    stride_wd,
    stride_at,
    stride_ah,
    stride_it,
    stride_ih,
    stride_hw,
    stride_key,
    stride_r2t,
    stride_sc,
    stride_out,
    head_scale,
    softmax_scale,
    H: tl.constexpr,
    NOPE: tl.constexpr,
    R: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_NOPE: tl.constexpr,
    BLOCK_RA: tl.constexpr,
    HI: tl.constexpr,
    BLOCK_HI: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KP: tl.constexpr,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_KP: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    STEP_LEN: tl.constexpr,
    BLOCK_P: tl.constexpr,
    CHUNK: tl.constexpr,
    RADIX_BITS: tl.constexpr,
    SHORT_CHUNK: tl.constexpr,
    SHORT_BITS: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Programs [0, n_score): score/select (first: the selection is the longer chain);
    the rest absorb."""
    grid_dependency()  # first: kernels/triton/pdl.py
    pid = tl.program_id(0)
    if HAS_INDEX:
        if pid < n_score:
            _score_select(
                pid,
                qi_ptr,
                hw_ptr,
                keys_ptr,
                r2t_ptr,
                rows_ptr,
                pos_ptr,
                scores_ptr,
                pools_ptr,
                out_ptr,
                counters_ptr,
                n_pblocks,
                stride_it,
                stride_ih,
                stride_hw,
                stride_key,
                stride_r2t,
                stride_sc,
                stride_out,
                head_scale,
                softmax_scale,
                HI,
                BLOCK_HI,
                D,
                BLOCK_D,
                KP,
                K,
                BLOCK_K,
                BLOCK_KP,
                TAIL,
                BLOCK_TAIL,
                STEP_LEN,
                BLOCK_P,
                CHUNK,
                RADIX_BITS,
                SHORT_CHUNK,
                SHORT_BITS,
                DOT_PREC,
            )
    if pid >= n_score:
        _absorb(
            pid - n_score,
            q_ptr,
            wn_ptr,
            qabs_ptr,
            T,
            stride_qt,
            stride_qh,
            stride_wh,
            stride_wd,
            stride_at,
            stride_ah,
            H,
            NOPE,
            R,
            BLOCK_T,
            BLOCK_NOPE,
            BLOCK_RA,
            DOT_PREC,
        )


class QueryPlan(NamedTuple):
    block_p: int  # pools per score program
    chunk: int  # pools per step of the selection's scans
    radix_bits: int  # key bits resolved per pass of the threshold search (divides 32)
    block_ra: int  # R columns per absorb program
    num_warps: int


def query_plan(
    tokens: int,
    max_pools: int,
    block_p: int | None = None,
    chunk: int | None = None,
    radix_bits: int | None = None,
    block_ra: int | None = None,
    num_warps: int | None = None,
) -> QueryPlan:
    """None = default. The pool block grows with the tokens (more programs per token only help
    while the tokens alone do not fill the GPU; each program also reads the token's query).
    Past SHORT_CHUNK pools the selection scans 4,096 pools per step (8 warps, 2-bit passes: 16
    passes, 4 candidates x 16 keys per thread), so a 64k context's 4,096 pools take one step
    per pass; a token that sees fewer pools still takes the short scan. Two variants only, so
    an eager decode compiles little as its contexts grow."""
    wide = max_pools > SHORT_CHUNK
    return QueryPlan(
        block_p or (32 if tokens < 8 else 64),
        chunk or (4096 if wide else SHORT_CHUNK),
        radix_bits or (2 if wide else SHORT_BITS),
        block_ra or 32,
        num_warps or (8 if wide else 4),
    )


def step_queries(
    q: torch.Tensor,
    kv_b_nope: torch.Tensor,
    index: IndexQuery | None,
    step: StepLayout,
    counters: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
    plan: QueryPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """As kernels.dsa_decode.step_queries, in one launch; the slots list the selected pools in
    ascending pool order. counters: int32 zeros, at least one per token, this call site's own
    (None: allocated here). scores: the score scratch, given to read it back (tests); only the
    pools a token can see are written. plan: query_plan's override (tuning and tests)."""
    t, heads, nope = q.shape
    rank = kv_b_nope.shape[2]
    q_abs = torch.empty(t, heads, rank, device=q.device, dtype=q.dtype)
    assert q.stride(2) == 1 and kv_b_nope.stride(2) == 1
    pl = plan or query_plan(t, step.max_pools)
    assert 32 % pl.radix_bits == 0
    block_t = 16
    n_absorb = triton.cdiv(t, block_t) * heads * triton.cdiv(rank, pl.block_ra)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    n_score = n_pblocks = 0
    qi = hw = keys = pools = out = None
    r2t, rows, pos = step.req_to_token, step.req_rows, step.positions
    hi = dim = kp = k = tail = 16
    strides = [0] * 7
    head_scale = softmax_scale = 1.0
    if index is not None:
        qi, hw, keys = index.q, index.head_weights, index.index_keys
        assert qi.stride(2) == 1 and hw.stride(1) == 1 and keys.stride(1) == 1
        hi, dim = qi.shape[1:]
        kp, k = index.kpool, index.select_pools
        tail = kp - 1 if index.select_tail and kp > 1 else 0
        out = torch.empty(t, k * kp + tail, device=q.device, dtype=torch.int32)
        n_pblocks = triton.cdiv(step.max_pools, pl.block_p)
        n_score = t * n_pblocks
        if scores is None:
            scores = torch.empty(t, step.max_pools, device=q.device, dtype=torch.float32)
        assert scores.shape == (t, step.max_pools) and scores.stride(1) == 1
        pools = torch.empty(t, k, device=q.device, dtype=torch.int32)
        if counters is None:
            counters = torch.zeros(max(t, 1), device=q.device, dtype=torch.int32)
        assert counters.numel() >= t and counters.dtype == torch.int32
        strides = [
            qi.stride(0),
            qi.stride(1),
            hw.stride(0),
            keys.stride(0),
            r2t.stride(0),
            scores.stride(0),
            out.stride(0),
        ]
        head_scale, softmax_scale = index.head_scale, dim**-0.5
    if t == 0:
        return q_abs, out
    _queries_kernel[(n_score + n_absorb,)](
        q,
        kv_b_nope,
        q_abs,
        qi,
        hw,
        keys,
        r2t,
        rows,
        pos,
        scores,
        pools,
        out,
        counters,
        t,
        n_score,
        max(n_pblocks, 1),
        q.stride(0),
        q.stride(1),
        kv_b_nope.stride(0),
        kv_b_nope.stride(1),
        q_abs.stride(0),
        q_abs.stride(1),
        *strides,
        head_scale,
        softmax_scale,
        H=heads,
        NOPE=nope,
        R=rank,
        BLOCK_T=block_t,
        BLOCK_NOPE=max(16, triton.next_power_of_2(nope)),
        BLOCK_RA=pl.block_ra,
        HI=hi,
        BLOCK_HI=max(16, triton.next_power_of_2(hi)),
        D=dim,
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        KP=kp,
        K=k,
        BLOCK_K=triton.next_power_of_2(k),
        BLOCK_KP=triton.next_power_of_2(kp),
        TAIL=tail,
        BLOCK_TAIL=triton.next_power_of_2(max(tail, 1)),
        STEP_LEN=step.step_len,
        BLOCK_P=pl.block_p,
        CHUNK=pl.chunk,
        RADIX_BITS=pl.radix_bits,
        SHORT_CHUNK=SHORT_CHUNK,
        SHORT_BITS=SHORT_BITS,
        HAS_INDEX=index is not None,
        DOT_PREC=prec,
        num_warps=pl.num_warps,
        **LAUNCH,
    )
    return q_abs, out


# -------------------------------------------------------------------------- step_attention


@triton.jit
def _mla_split_kernel(
    q_ptr,
    kv_ptr,
    slots_ptr,
    part_o_ptr,
    part_lse_ptr,
    W,
    stride_qt,
    stride_qh,
    stride_kv,
    stride_st,
    qk_scale_log2,
    H: tl.constexpr,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_W: tl.constexpr,
    SPLITS: tl.constexpr,
    NUM_ITERS: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Program (token, split): every head over the split's slots; a normalised partial output
    [H, R] and its log2-sum-exp [H] (-inf where the split has no valid slot)."""
    grid_dependency()  # first: kernels/triton/pdl.py
    t = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    h_mask = offs_h < H
    r_mask = offs_r < R
    q = tl.load(
        q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_r[None, :],
        mask=h_mask[:, None] & r_mask[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    w0 = split * (NUM_ITERS * BLOCK_W)
    for it in range(NUM_ITERS):
        offs_w = w0 + it * BLOCK_W + tl.arange(0, BLOCK_W)
        slot = tl.load(slots_ptr + t * stride_st + offs_w, mask=offs_w < W, other=-1)
        valid = slot >= 0
        kv = tl.load(
            kv_ptr + slot.to(tl.int64)[:, None] * stride_kv + offs_r[None, :],
            mask=valid[:, None] & r_mask[None, :],
            other=0.0,
        )
        s = tl.dot(q, tl.trans(kv), input_precision=DOT_PREC) * qk_scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_update(s, kv, m_i, l_i, acc, DOT_PREC)
    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    row = (t * SPLITS + split) * H + offs_h  # partials [T, splits, H, R] and lse [T, splits, H]
    tl.store(
        part_o_ptr + row[:, None] * R + offs_r[None, :],
        o,
        mask=h_mask[:, None] & r_mask[None, :],
    )
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(part_lse_ptr + row, lse, mask=h_mask)


@triton.jit
def _combine_up_kernel(
    part_o_ptr,
    part_lse_ptr,
    wv_ptr,
    out_ptr,
    T,
    stride_wh,
    stride_wv,
    stride_ot,
    H: tl.constexpr,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    V: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Program (token block, head, V block): the splits merged (float32, by their log-sum-exp),
    rounded to the output's dtype as the reference's latent output is, times kv_b_v[h].

    BLOCK_T 1 (few tokens, many splits): the splits' partial rows load BLOCK_S at a time, all
    in flight together, and the up-projection is a GEMV; each token reads the V block's
    weights (from L2 after the first). BLOCK_T 16 (few splits): one split's [16, R] tile at a
    time, and the up-projection is a dot, the weights read once per 16 tokens."""
    grid_dependency()  # first: kernels/triton/pdl.py
    tb = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    v_mask = offs_v < V
    wv_at = wv_ptr + h * stride_wh + offs_v[:, None] * stride_wv + offs_r[None, :]
    wv_mask = v_mask[:, None] & r_mask[None, :]
    offs_s = tl.arange(0, BLOCK_S)
    if BLOCK_T == 1:
        wv = tl.load(wv_at, mask=wv_mask, other=0.0)  # in flight with the partials' loads
        t = tb.to(tl.int64)
        # lse over every split first (few scalars), then the weighted partial rows by chunks
        m = tl.full([], float("-inf"), dtype=tl.float32)
        for s0 in tl.static_range(0, SPLITS, BLOCK_S):
            s_mask = s0 + offs_s < SPLITS
            lse = tl.load(
                part_lse_ptr + (t * SPLITS + s0 + offs_s) * H + h, mask=s_mask, other=float("-inf")
            )
            m = tl.maximum(m, tl.max(lse, axis=0))
        m = tl.where(m == float("-inf"), 0.0, m)  # no split has a slot: never for a real token
        total = tl.zeros([], dtype=tl.float32)
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for s0 in tl.static_range(0, SPLITS, BLOCK_S):
            s_mask = s0 + offs_s < SPLITS
            rows = (t * SPLITS + s0 + offs_s) * H + h
            lse = tl.load(part_lse_ptr + rows, mask=s_mask, other=float("-inf"))
            w = tl.exp2(lse - m)
            part = tl.load(
                part_o_ptr + rows[:, None] * R + offs_r[None, :],
                mask=s_mask[:, None] & r_mask[None, :],
                other=0.0,
            )
            total += tl.sum(w, axis=0)
            acc += tl.sum(w[:, None] * part, axis=0)
        o_lat = (acc / tl.where(total > 0.0, total, 1.0)).to(out_ptr.dtype.element_ty)
        o = tl.sum(wv.to(tl.float32) * o_lat.to(tl.float32)[None, :], axis=1)  # [BLOCK_V]
        tl.store(
            out_ptr + t * stride_ot + h * V + offs_v, o.to(out_ptr.dtype.element_ty), mask=v_mask
        )
    else:
        offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
        t_mask = offs_t < T
        base = offs_t.to(tl.int64) * SPLITS  # [BLOCK_T]
        lse = tl.load(
            part_lse_ptr + (base[:, None] + offs_s[None, :]) * H + h,
            mask=t_mask[:, None] & (offs_s < SPLITS)[None, :],
            other=float("-inf"),
        )
        m = tl.max(lse, axis=1)
        m = tl.where(m == float("-inf"), 0.0, m)  # padding tokens only
        wts = tl.exp2(lse - m[:, None])
        total = tl.sum(wts, axis=1)
        wts = wts / tl.where(total > 0.0, total, 1.0)[:, None]
        acc = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
        for s in range(SPLITS):  # unrolled, the tiles in flight spill the registers
            w_s = tl.sum(tl.where(offs_s[None, :] == s, wts, 0.0), axis=1)
            part = tl.load(
                part_o_ptr + ((base + s) * H + h)[:, None] * R + offs_r[None, :],
                mask=t_mask[:, None] & r_mask[None, :],
                other=0.0,
            )
            acc += w_s[:, None] * part
        o_lat = acc.to(out_ptr.dtype.element_ty)
        wv = tl.load(wv_at, mask=wv_mask, other=0.0)
        o = tl.dot(o_lat, tl.trans(wv.to(o_lat.dtype)), input_precision=DOT_PREC)  # [T, V]
        dst = out_ptr + offs_t[:, None].to(tl.int64) * stride_ot + h * V + offs_v[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & v_mask[None, :])


class AttentionPlan(NamedTuple):
    num_splits: int
    split_len: int
    block_w: int
    block_v: int
    num_warps: int
    num_stages: int


def attention_plan(
    tokens: int,
    width: int,
    dtype: torch.dtype,
    device: torch.device,
    num_splits: int | None = None,
    block_w: int | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> AttentionPlan:
    """From shapes only; None = default. About one program per SM over (token, split); a split
    keeps _MIN_SPLIT_LEN rows at least (below that its partial output costs more than its
    rows)."""
    wide = dtype == torch.float32
    if block_w is None:
        block_w = 16 if wide else 32
    if num_splits is None:
        num_splits = min(triton.cdiv(_num_sms(device), tokens), triton.cdiv(width, _MIN_SPLIT_LEN))
    num_splits = max(1, min(num_splits, triton.cdiv(width, block_w)))
    split_len = triton.cdiv(triton.cdiv(width, num_splits), block_w) * block_w
    num_splits = triton.cdiv(width, split_len)
    return AttentionPlan(
        num_splits,
        split_len,
        block_w,
        block_v or (16 if wide else 32),  # float32: 32 spills the combine's registers
        num_warps or 4,
        num_stages or (1 if wide else 2),
    )


def step_attention(
    q_abs: torch.Tensor,
    latent: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    kv_b_v: torch.Tensor,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """As kernels.dsa_decode.step_attention, in two launches. slots: int32 or int64, last dim
    contiguous; every token has at least one valid slot. plan: attention_plan's override."""
    t, heads, rank = q_abs.shape
    v_dim = kv_b_v.shape[1]
    width = slots.shape[1]
    out = torch.empty(t, heads * v_dim, device=q_abs.device, dtype=q_abs.dtype)
    if t == 0:
        return out
    assert q_abs.stride(2) == 1 and latent.stride(1) == 1 and kv_b_v.stride(2) == 1
    assert slots.stride(1) == 1
    pl = plan or attention_plan(t, width, q_abs.dtype, q_abs.device)
    splits = pl.num_splits
    part_o = torch.empty(t, splits, heads, rank, device=q_abs.device, dtype=torch.float32)
    part_lse = torch.empty(t, splits, heads, device=q_abs.device, dtype=torch.float32)
    block_r = triton.next_power_of_2(rank)
    prec = "ieee" if q_abs.dtype == torch.float32 else "tf32"
    stages = {} if INTERPRETER else {"num_stages": pl.num_stages}
    _mla_split_kernel[(t, splits)](
        q_abs,
        latent,
        slots,
        part_o,
        part_lse,
        width,
        q_abs.stride(0),
        q_abs.stride(1),
        latent.stride(0),
        slots.stride(0),
        scale * _LOG2E,
        H=heads,
        R=rank,
        BLOCK_R=block_r,
        BLOCK_H=max(16, triton.next_power_of_2(heads)),
        BLOCK_W=pl.block_w,
        SPLITS=splits,
        NUM_ITERS=pl.split_len // pl.block_w,
        DOT_PREC=prec,
        num_warps=pl.num_warps,
        **stages,
        **LAUNCH,
    )
    # per token while tokens are few (then splits are many); blocks of 16 tokens sharing the
    # weight tile past that (then splits are few: about one program per SM over both)
    block_t = 1 if t < 16 else 16
    block_s = (
        min(16, triton.next_power_of_2(splits)) if block_t == 1 else triton.next_power_of_2(splits)
    )
    _combine_up_kernel[(triton.cdiv(t, block_t), heads, triton.cdiv(v_dim, pl.block_v))](
        part_o,
        part_lse,
        kv_b_v,
        out,
        t,
        kv_b_v.stride(0),
        kv_b_v.stride(1),
        out.stride(0),
        H=heads,
        R=rank,
        BLOCK_R=block_r,
        V=v_dim,
        BLOCK_V=pl.block_v,
        BLOCK_T=block_t,
        SPLITS=splits,
        BLOCK_S=block_s,
        DOT_PREC=prec,
        num_warps=4,
        **LAUNCH,
    )
    return out

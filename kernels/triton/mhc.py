"""Triton versions of kernels/mhc.py's references (same signatures and results):

- mhc_pre (collapse + RMSNorm) in two launches: (1) split-K partial sums of the mixing logits
  (logit_dot: float32-accurate tensor-core dots of the raw streams with fn) and of the squares,
  over programs of (token block, K slice) so a decode's one token still spreads fn's 1.5 MB
  over the SMs;
  (2) one program per token: the partials summed in a fixed order (deterministic), the RMS
  factor applied to the logits (F.linear of the normalised rows equals the factor times the
  linear of the raw rows), pre/post/comb as kernels.mhc.mhc_mix_reference (the Sinkhorn loop
  in registers), then the collapse rounded to the streams' dtype and its RMSNorm; the collapse
  is computed twice (once for its sum of squares, once to normalise) instead of stored and
  re-read, which would need a barrier. Past 16 tokens, with
  few K splits (sinkhorn_tokens), comb (the Sinkhorn) runs in programs of PRE_SINKHORN_TOKENS
  tokens of the same launch instead;
- mhc_post: one program per (token, Hd block), every new stream of it one tile (each old
  stream read once), each term rounded to the streams' dtype as the reference's bf16 ops round
  them. Run 5's prefill ran this as a cuBLAS batched 4x4 GEMM per
  token: 2.5 ms per call at 8,192 tokens, two per layer;
- mhc_boundary (a decode-sized batch): mhc_post then mhc_pre in one launch. Programs of (token
  block, channel block) expand their channels of every stream (rounded as mhc_post) and dot them
  with fn's columns in IEEE float32 (at <= 8 tokens per program a tensor-core tile would be
  mostly padding, and the fn tile is read once per block of tokens anyway); the last program of
  a token block to arrive (an atomic counter per block, "the last program finishes") sums the
  partials in a fixed order and does what mhc_pre's finish kernel does, for each token of its
  block, with the collapse held in registers (one read of the new streams); the program that
  arrived just before it runs the Sinkhorn meanwhile (BOUNDARY_SPLIT_FINISH). Past
  BOUNDARY_MAX_TOKENS: mhc_post then mhc_pre.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import INTERPRETER
from kernels.triton.pdl import LAUNCH, grid_dependency

# The mixing logits' dot on tensor cores at float32's accuracy (IEEE float32 on CUDA cores made
# the prefill's collapse compute-bound: 1.3 ms per call at 8,192 tokens of the real size),
# logit_dot(dtype):
# - float32 streams, "tf32x3": three TF32 products of the hi/lo split of both operands;
# - bf16 streams, "bf16_split": the streams go to the dot as they are (a bf16 value is exact),
#   fn's float32 tile split into three bf16 terms w1 + w2 + w3 (each the rounding of what the
#   previous left: 24 significant bits, fn's own), three bf16 products, so no conversion of the
#   streams' tile and half its registers (70 against 156 at sm_90a). Against tf32x3 on bf16
#   streams (bench.decode_mhc_kda, rank 0): an 8,192-token boundary 466 against 569 us on the
#   H200, 574 against 693 on the H100; 1,024 tokens 89 against 104 (H200), 96 against 109.
#   Measured and dropped (2026-12-05): the expansion and these partial sums in one kernel, each
#   new stream's tile dotted from registers (saving the partial's 32 KB a token of re-read):
#   2.8 ms against 0.47 an 8k boundary on the H200 even with 16-byte loads, and off float32's
#   tolerance in bf16 (notebook, session 23).


@triton.jit
def _sinkhorn(logits, m, iters, eps):
    """Mixing logits [..., P, P] (valid where m) -> row softmax + eps, then iters column/row
    normalisations (the last is a column one), as kernels.mhc's reference; over the last two
    axes, so a [P, P] tile is one token and a [BLOCK_T, P, P] tile several."""
    logits = tl.where(m, logits, float("-inf"))
    logits = logits - tl.max(logits, axis=-1, keep_dims=True)
    e = tl.where(m, tl.exp(logits), 0.0)
    comb = tl.where(m, e / tl.sum(e, axis=-1, keep_dims=True) + eps, 0.0)
    comb = comb / (tl.sum(comb, axis=-2, keep_dims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, axis=-1, keep_dims=True) + eps)
        comb = comb / (tl.sum(comb, axis=-2, keep_dims=True) + eps)
    return comb


@triton.jit
def _collapse(base, pre, i, h, h_mask, dt, HC: tl.constexpr, HD: tl.constexpr, CACHE: tl.constexpr):
    """sum_j pre[j] * streams[j, h] for one token's block of channels h, rounded to the
    stream dtype as the reference's collapse is (float32 out)."""
    col = tl.zeros(h.shape, dtype=tl.float32)
    for j in tl.static_range(HC):
        pj = tl.sum(tl.where(i == j, pre, 0.0))
        s = tl.load(base + j * HD + h, mask=h_mask, other=0.0, cache_modifier=CACHE)
        col += pj * s.to(tl.float32)
    return col.to(dt).to(tl.float32)


@triton.jit
def _norm_store(col, rms, nw_ptr, out_row, h, h_mask, dt):
    normed = (col * rms).to(dt).to(tl.float32)
    w = tl.load(nw_ptr + h, mask=h_mask, other=0.0).to(tl.float32)
    tl.store(out_row + h, (w * normed).to(dt), mask=h_mask)


@triton.jit
def _collapse_norm(
    base,  # one token's streams [HC, HD]
    pre,  # [P] float32 collapse weights (i: their stream index)
    i,
    nw_ptr,  # [HD] RMSNorm weight
    out_row,  # [HD]
    rms_eps,
    HC: tl.constexpr,
    HD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    CACHE: tl.constexpr,
):
    """One token's collapse rounded to the streams' dtype, then its RMSNorm (normalised in
    float32, rounded, scaled by the weight in that dtype, as kernels.norm.rms_norm). With one
    block of channels the collapse stays in registers; otherwise it is computed twice (once
    for its sum of squares, once to normalise) instead of stored and re-read, which would need
    a barrier."""
    dt = out_row.dtype.element_ty
    if BLOCK_H >= HD:
        h = tl.arange(0, BLOCK_H)
        h_mask = h < HD
        col = _collapse(base, pre, i, h, h_mask, dt, HC, HD, CACHE)
        rms = 1.0 / tl.sqrt(tl.sum(col * col) / HD + rms_eps)
        _norm_store(col, rms, nw_ptr, out_row, h, h_mask, dt)
    else:
        ss = tl.zeros([BLOCK_H], dtype=tl.float32)
        for h0 in range(0, HD, BLOCK_H):  # pass 1: the collapse's sum of squares
            h = h0 + tl.arange(0, BLOCK_H)
            h_mask = h < HD
            col = _collapse(base, pre, i, h, h_mask, dt, HC, HD, CACHE)
            ss += col * col
        rms = 1.0 / tl.sqrt(tl.sum(ss) / HD + rms_eps)
        for h0 in range(0, HD, BLOCK_H):  # pass 2: the same collapse, normalised and scaled
            h = h0 + tl.arange(0, BLOCK_H)
            h_mask = h < HD
            col = _collapse(base, pre, i, h, h_mask, dt, HC, HD, CACHE)
            _norm_store(col, rms, nw_ptr, out_row, h, h_mask, dt)


@triton.jit
def _bf16x3(w):
    """float32 w -> bf16 terms (w1, w2, w3), w1 + w2 + w3 = w: each the rounding of what the
    previous left (24 significant bits, float32's own; both differences are exact)."""
    w1 = w.to(tl.bfloat16)
    rest = w - w1.to(tl.float32)
    w2 = rest.to(tl.bfloat16)
    return w1, w2, (rest - w2.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _mhc_pre_partial_kernel(
    x_ptr,  # [T, K] the flattened streams
    fn_ptr,  # [MIX, K] float32; bf16_presplit: [3, MIX, K] bf16 (split_bf16x3)
    part_ptr,  # [S, T, MP + 1] float32: logits partials, then the sum of squares
    T,
    K,
    k_per_split,
    MIX: tl.constexpr,
    MP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,  # logit_dot's, or bf16_presplit
):
    grid_dependency()  # first: kernels/triton/pdl.py
    pid_t = tl.program_id(0)
    s = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < T
    m = tl.arange(0, MP)
    m_mask = m < MIX
    acc = tl.zeros([BLOCK_T, MP], dtype=tl.float32)
    sq = tl.zeros([BLOCK_T], dtype=tl.float32)
    k_start = s * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        xs = tl.load(
            x_ptr + t[:, None].to(tl.int64) * K + k[None, :],
            mask=t_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        x = xs.to(tl.float32)
        w_at = fn_ptr + m[None, :] * K + k[:, None]
        w_mask = m_mask[None, :] & k_mask[:, None]
        sq += tl.sum(x * x, axis=1)
        if PRECISION == "bf16_presplit":  # fn_ptr: split_bf16x3's [3, MIX, K], so no conversion
            w1 = tl.load(w_at, mask=w_mask, other=0.0)
            w2 = tl.load(w_at + MIX * K, mask=w_mask, other=0.0)
            w3 = tl.load(w_at + 2 * MIX * K, mask=w_mask, other=0.0)
        elif PRECISION == "bf16_split":  # xs is bf16 (logit_dot)
            w1, w2, w3 = _bf16x3(tl.load(w_at, mask=w_mask))
        else:
            w = tl.load(w_at, mask=w_mask)
        if PRECISION != "tf32x3":
            # the step's products from zero, then one float32 add: the running sum must not
            # stay in the tensor cores' accumulator, whose additions truncate (so does Triton's
            # own tf32x3); 86 K steps of that at 8k tokens drifted past float32's 1e-5
            step = tl.dot(xs, w3)  # the smallest term first
            step = tl.dot(xs, w2, step)
            acc += tl.dot(xs, w1, step)
        else:
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
    row = part_ptr + (s * T + t[:, None]) * (MP + 1)
    tl.store(row + m[None, :], acc, mask=t_mask[:, None])
    tl.store(part_ptr + (s * T + t) * (MP + 1) + MP, sq, mask=t_mask)


@triton.jit
def _split_bf16x3_kernel(w_ptr, out_ptr, N, BLOCK: tl.constexpr):
    grid_dependency()  # first: kernels/triton/pdl.py
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < N
    w1, w2, w3 = _bf16x3(tl.load(w_ptr + i, mask=mask))
    tl.store(out_ptr + i, w1, mask=mask)
    tl.store(out_ptr + N + i, w2, mask=mask)
    tl.store(out_ptr + 2 * N + i, w3, mask=mask)


def split_bf16x3(w: torch.Tensor) -> torch.Tensor:
    """float32 w -> [3, *w.shape] bf16 terms w1 + w2 + w3 = w (24 significant bits), as
    _mhc_pre_partial_kernel's bf16_split makes them per tile: one launch of ~4 MB for the
    prefill's partial kernel to load instead of converting fn in every token block."""
    w = w.contiguous().float()
    out = torch.empty(3, *w.shape, device=w.device, dtype=torch.bfloat16)
    block = 4096
    _split_bf16x3_kernel[(triton.cdiv(w.numel(), block),)](w, out, w.numel(), BLOCK=block, **LAUNCH)
    return out


@triton.jit
def _finish_tokens(
    part_ptr,  # float32 partials: token t's split s at row (t * stride_t + s * stride_s) * (MP + 1)
    stride_t,
    stride_s,
    n_splits,
    x_ptr,  # [T, HC, HD] the streams to collapse
    base_ptr,
    scale_ptr,
    nw_ptr,  # [HD] RMSNorm weight
    post_ptr,  # [T, HC] float32 out
    comb_ptr,  # [T, HC, HC] float32 out
    out_ptr,  # [T, HD] out: the normed collapse
    t0,
    n,  # tokens t0 .. t0 + n - 1 (n <= BLOCK_T)
    iters,
    eps,
    norm_eps,
    rms_eps,
    HC: tl.constexpr,
    P: tl.constexpr,
    MP: tl.constexpr,
    HD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    CACHE: tl.constexpr,
    PART: tl.constexpr = 0,  # 0: all; 1: post and the collapse; 2: comb (the Sinkhorn)
):
    """The collapse's finish for a block of tokens, from the split partials of its mixing logits
    (then the sum of squares of the raw rows, at MP): the partials summed SPLITS at a time, each
    block as a tree, a fixed order (deterministic); the RMS factor applied to the logits (F.linear
    of the normalised rows equals the factor times the linear of the raw rows); pre/post/comb as
    kernels.mhc.mhc_mix_reference for the block's tokens at once; then each token's collapse and
    RMSNorm."""
    tok = tl.arange(0, BLOCK_T)
    tm = tok < n
    r = tl.arange(0, P)
    rv = r < HC
    rc = r[:, None] * HC + r[None, :]  # [P, P]: comb[row, col] at row * HC + col
    pm = rv[:, None] & rv[None, :]
    pre_w = tl.zeros([BLOCK_T, P], dtype=tl.float32)
    post_w = tl.zeros([BLOCK_T, P], dtype=tl.float32)
    comb_w = tl.zeros([BLOCK_T, P, P], dtype=tl.float32)
    sq = tl.zeros([BLOCK_T], dtype=tl.float32)
    for s0 in range(0, n_splits, SPLITS):
        s = s0 + tl.arange(0, SPLITS)
        ts = tm[:, None] & (s < n_splits)[None, :]  # [BLOCK_T, SPLITS]
        row = (t0 + tok)[:, None] * stride_t + s[None, :] * stride_s
        rows = part_ptr + row.to(tl.int64) * (MP + 1)
        vm = ts[:, :, None] & rv[None, None, :]
        vec = rows[:, :, None] + r[None, None, :]
        if PART != 2:
            pre_w += tl.sum(tl.load(vec, mask=vm, other=0.0, cache_modifier=CACHE), axis=1)
            post_w += tl.sum(tl.load(vec + HC, mask=vm, other=0.0, cache_modifier=CACHE), axis=1)
        if PART != 1:
            cm = ts[:, :, None, None] & pm[None, None, :, :]
            comb_w += tl.sum(
                tl.load(
                    rows[:, :, None, None] + 2 * HC + rc[None, None, :, :],
                    mask=cm,
                    other=0.0,
                    cache_modifier=CACHE,
                ),
                axis=1,
            )
        sq += tl.sum(tl.load(rows + MP, mask=ts, other=0.0, cache_modifier=CACHE), axis=1)
    rstd = 1.0 / tl.sqrt(sq / (HC * HD) + norm_eps)
    tv = (t0 + tok).to(tl.int64)
    if PART != 1:
        s2 = tl.load(scale_ptr + 2)
        comb_b = tl.load(base_ptr + 2 * HC + rc, mask=pm, other=0.0)
        logits = comb_w * rstd[:, None, None] * s2 + comb_b[None, :, :]
        lm = tm[:, None, None] & pm[None, :, :]
        comb = comb_ptr + tv[:, None, None] * HC * HC + rc[None, :, :]
        tl.store(comb, _sinkhorn(logits, lm, iters, eps), mask=lm)
    if PART != 2:
        s0 = tl.load(scale_ptr)
        s1 = tl.load(scale_ptr + 1)
        pre = tl.load(base_ptr + r, mask=rv, other=0.0)[None, :]
        pre = tl.sigmoid(pre_w * rstd[:, None] * s0 + pre) + eps  # [BLOCK_T, P]
        post = tl.load(base_ptr + HC + r, mask=rv, other=0.0)[None, :]
        post = 2.0 * tl.sigmoid(post_w * rstd[:, None] * s1 + post)
        tl.store(post_ptr + tv[:, None] * HC + r[None, :], post, mask=tm[:, None] & rv[None, :])
        for tt in range(0, n):  # the collapse of each token of the block, and its RMSNorm
            t = (t0 + tt).to(tl.int64)
            pre_t = tl.sum(tl.where(tok[:, None] == tt, pre, 0.0), axis=0)
            _collapse_norm(
                x_ptr + t * (HC * HD), pre_t, r, nw_ptr, out_ptr + t * HD, rms_eps, HC, HD,
                BLOCK_H, CACHE,
            )  # fmt: skip


# T and splits not specialized (== 1, divisible by 16): both vary with the token count, and each
# specialization would be one more compiled variant
@triton.jit(do_not_specialize=["T", "splits"])
def _mhc_pre_finish_kernel(
    part_ptr,  # [S, T, MP + 1] float32 (_mhc_pre_partial_kernel's)
    x_ptr,  # [T, HC, HD] streams
    base_ptr,
    scale_ptr,
    nw_ptr,  # [HD] RMSNorm weight
    post_ptr,
    comb_ptr,
    out_ptr,  # [T, HD] the normed collapse
    T,
    splits,
    iters,
    eps,
    norm_eps,
    rms_eps,
    HC: tl.constexpr,
    P: tl.constexpr,
    MP: tl.constexpr,
    HD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SPLITS: tl.constexpr,
    SINKHORN_T: tl.constexpr,  # 0: each program's Sinkhorn its own; else PRE_SINKHORN_TOKENS
    SINKHORN_SPLITS: tl.constexpr,
):
    grid_dependency()  # first: kernels/triton/pdl.py
    pid = tl.program_id(0)
    if SINKHORN_T != 0:
        # the first cdiv(T, SINKHORN_T) programs: comb for SINKHORN_T tokens at once (one
        # [SINKHORN_T, P, P] tile); the rest: post and the collapse of BLOCK_T tokens each
        sinkhorn_programs = tl.cdiv(T, SINKHORN_T)
        if pid < sinkhorn_programs:
            t0 = pid * SINKHORN_T
            _finish_tokens(
                part_ptr, 1, T, splits, x_ptr, base_ptr, scale_ptr, nw_ptr, post_ptr, comb_ptr,
                out_ptr, t0, tl.minimum(T - t0, SINKHORN_T), iters, eps, norm_eps, rms_eps, HC,
                P, MP, HD, SINKHORN_T, SINKHORN_SPLITS, BLOCK_H, "", 2,
            )  # fmt: skip
            return
        pid -= sinkhorn_programs
    t0 = pid * BLOCK_T
    _finish_tokens(
        part_ptr, 1, T, splits, x_ptr, base_ptr, scale_ptr, nw_ptr, post_ptr, comb_ptr, out_ptr,
        t0, tl.minimum(T - t0, BLOCK_T), iters, eps, norm_eps, rms_eps, HC, P, MP, HD, BLOCK_T,
        SPLITS, BLOCK_H, "", 1 if SINKHORN_T else 0,
    )  # fmt: skip


# The collapse past 16 tokens (prefill sizes): the partial kernel's (tokens, K step, warps) per
# program and the finish kernel's (tokens, channel block, warps); PRE_PARTIAL_PRESPLIT: the
# bf16_split terms of fn made once a call (split_bf16x3), not per tile in every token block:
# only with more than one token block (one block splits each tile once anyway; the extra launch
# was 2.3 us a call at a 32-row decode batch on the H200, 90 a step).
# `bench.decode_mhc_kda --pre-sweep` times mhc_pre alone over a grid of them; on an H100
# (2026-12-05, one run, us at 8,192 / 1,024 tokens): (64, 64, 4) split per tile, (1, 1024, 4)
# (the defaults before) 300.1 / 55.7; split once 252.4 / 51.3; finish (1, 4096, 8): one
# program a token, its collapse held in registers (one read of the streams) 285.0 / 50.9; finish
# blocks of 4-16 tokens 287.7-296.4 at 8k; partial blocks of 128 tokens x 8 warps 269.0.
PRE_PARTIAL = (64, 64, 4)
PRE_PARTIAL_PRESPLIT = True
PRE_FINISH = (1, 4096, 8)
# Past 16 tokens the finish launch's Sinkhorn (comb, needed only by the next expansion) runs in
# programs of its own, this many tokens a [T, P, P] tile, beside the collapse programs, instead
# of as a [1, P, P] tile's 40 serial normalisations in every collapse program; 0: the latter.
# Only where a Sinkhorn program sums at most PRE_SINKHORN_MAX_ROWS partial rows (its tokens x the
# partial kernel's K splits): the splits grow as the tokens shrink (about two partial programs an
# SM), and one program summing 32 tokens x 264 splits took 111 us a call at a 32-row decode
# batch on the H200 (10 of the step's 26.9 ms; session 33), where 32 collapse programs share
# them. mhc_pre on the H200 (`bench.decode_mhc_kda --pre-sweep`, session 33, us, in every
# program / 32 / 64 tokens a Sinkhorn program): 64 tokens 20.0 / 118.7 / 48.4, 256 tokens 19.0 /
# 41.1 / 30.5, 512 27.0 / 32.9 / 26.7, 1,024 46.8 / 42.5 / 38.7, 4,096 130.0 / 118.3 / 113.4,
# 8,192 233.0 / 207.5 / 205.7.
# Up to PRE_SINKHORN_ONE_TOKEN_MAX tokens (decode batches, EAGLE's verify of 32 rows) a Sinkhorn
# program a token instead: each sums only its own token's partials, and runs beside that token's
# collapse program rather than before it. H100, session 34 (the same sweep, one process): 32
# tokens 12.85 against 16.41 us (the finish 8.6 against 13.0), a tie at 256 (20.01 / 19.95),
# 49.8 against 41.3 at 1,024 tokens; between 64 and 256 unmeasured, so the old rule there.
PRE_SINKHORN_TOKENS = 64
PRE_SINKHORN_MAX_ROWS = 2048
PRE_SINKHORN_ONE_TOKEN_MAX = 64


def sinkhorn_tokens(tokens: int, splits: int) -> int:
    """Tokens a Sinkhorn program of mhc_pre's finish launch takes (0: the Sinkhorn in every
    collapse program), for a call of `tokens` tokens whose partials come in `splits` K splits."""
    if tokens <= 16:
        return 0
    if tokens <= PRE_SINKHORN_ONE_TOKEN_MAX:
        return 1
    return PRE_SINKHORN_TOKENS if PRE_SINKHORN_TOKENS * splits <= PRE_SINKHORN_MAX_ROWS else 0


def logit_dot(dtype: torch.dtype) -> str:
    """The mixing logits' dot for streams of this dtype (the comment above _sinkhorn)."""
    return "bf16_split" if dtype == torch.bfloat16 else "tf32x3"


def mhc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    iters: int,
    eps: float,
    norm_eps: float,
    weight: torch.Tensor,
    rms_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernels.mhc.mhc_pre_reference in two launches (the module docstring)."""
    tokens, hc, hidden = streams.shape
    mix = fn.shape[0]
    assert mix == (2 + hc) * hc and fn.shape[1] == hc * hidden, (fn.shape, streams.shape)
    assert weight.dtype == streams.dtype, "the RMSNorm weight is held in the streams' dtype"
    dev = streams.device
    post = torch.empty(tokens, hc, device=dev, dtype=torch.float32)
    comb = torch.empty(tokens, hc, hc, device=dev, dtype=torch.float32)
    out = torch.empty(tokens, hidden, device=dev, dtype=streams.dtype)
    if tokens == 0:
        return post, comb, out
    x = streams.contiguous()
    k = hc * hidden
    mp = triton.next_power_of_2(mix)
    if tokens <= 16:
        block_t, block_k, warps, finish_t, finish_h, finish_warps = 16, 128, 4, 1, 1024, 4
    else:
        block_t, block_k, warps = PRE_PARTIAL
        finish_t, finish_h, finish_warps = PRE_FINISH
    t_blocks = triton.cdiv(tokens, block_t)
    # about two programs per SM (132 on the H200) however few the tokens
    splits = max(1, min(triton.cdiv(k, block_k), triton.cdiv(264, t_blocks)))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    part = torch.empty(splits, tokens, mp + 1, device=dev, dtype=torch.float32)
    precision = logit_dot(streams.dtype)
    weights = fn.contiguous().float()
    if t_blocks > 1 and PRE_PARTIAL_PRESPLIT and precision == "bf16_split":
        precision, weights = "bf16_presplit", split_bf16x3(weights)
    _mhc_pre_partial_kernel[(t_blocks, splits)](
        x,
        weights,
        part,
        tokens,
        k,
        k_per_split,
        MIX=mix,
        MP=mp,
        BLOCK_T=block_t,
        BLOCK_K=block_k,
        PRECISION=precision,
        num_warps=warps,
        **LAUNCH,
    )
    sinkhorn_t = sinkhorn_tokens(tokens, splits)
    finish_programs = triton.cdiv(tokens, finish_t)
    if sinkhorn_t:
        finish_programs += triton.cdiv(tokens, sinkhorn_t)
    _mhc_pre_finish_kernel[(finish_programs,)](
        part,
        x,
        base.contiguous().float(),
        scale.contiguous().float(),
        weight.contiguous(),
        post,
        comb,
        out,
        tokens,
        splits,
        iters,
        eps,
        norm_eps,
        rms_eps,
        HC=hc,
        P=triton.next_power_of_2(hc),
        MP=mp,
        HD=hidden,
        BLOCK_T=finish_t,
        BLOCK_H=min(finish_h, triton.next_power_of_2(hidden)),
        SPLITS=min(64 // finish_t, triton.next_power_of_2(splits)),
        SINKHORN_T=sinkhorn_t,
        SINKHORN_SPLITS=min(64 // sinkhorn_t, triton.next_power_of_2(splits)) if sinkhorn_t else 1,
        num_warps=finish_warps,
        **LAUNCH,
    )
    return post, comb, out


@triton.jit
def _mhc_post_kernel(
    out_ptr,  # [T, HD] sublayer output
    res_ptr,  # [T, HC, HD]
    post_ptr,  # [T, HC] float32
    comb_ptr,  # [T, HC, HC] float32
    new_ptr,  # [T, HC, HD]
    HC: tl.constexpr,
    P: tl.constexpr,
    HD: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Every new stream of one token's Hd block as one [P, BLOCK_H] tile, so each old stream is
    loaded once (a loop over new streams reloaded each old one per new stream: 16 loads, not 4)."""
    grid_dependency()  # first: kernels/triton/pdl.py
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h < HD
    i = tl.arange(0, P)
    i_mask = i < HC
    dt = new_ptr.dtype.element_ty
    o = tl.load(out_ptr + t * HD + h, mask=h_mask, other=0.0).to(tl.float32)
    p = tl.load(post_ptr + t * HC + i, mask=i_mask, other=0.0).to(dt).to(tl.float32)
    res = t * (HC * HD) + h
    mixed = tl.zeros([P, BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(HC):  # mixed[i] = sum_j comb[j, i] res[j], j in order
        cj = tl.load(comb_ptr + t * HC * HC + j * HC + i, mask=i_mask, other=0.0)
        rj = tl.load(res_ptr + res + j * HD, mask=h_mask, other=0.0).to(tl.float32)
        mixed += cj.to(dt).to(tl.float32)[:, None] * rj[None, :]
    a = (p[:, None] * o[None, :]).to(dt).to(tl.float32)
    b = mixed.to(dt).to(tl.float32)
    new = new_ptr + t * (HC * HD) + i[:, None] * HD + h[None, :]
    tl.store(new, (a + b).to(dt), mask=i_mask[:, None] & h_mask[None, :])


def mhc_post(
    out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """kernels.mhc.mhc_post_reference in one launch."""
    tokens, hc, hidden = residual.shape
    new = torch.empty_like(residual, memory_format=torch.contiguous_format)
    if tokens == 0:
        return new
    block_h = min(1024, triton.next_power_of_2(hidden))
    _mhc_post_kernel[(tokens, triton.cdiv(hidden, block_h))](
        out.contiguous(),
        residual.contiguous(),
        post.contiguous().float(),
        comb.contiguous().float(),
        new,
        HC=hc,
        P=triton.next_power_of_2(hc),
        HD=hidden,
        BLOCK_H=block_h,
        num_warps=4,
        **LAUNCH,
    )
    return new


# The fused boundary: batches of up to this many tokens (decode, EAGLE verify, short chunks);
# larger ones run mhc_post + mhc_pre (three launches, but each tile of fn serves a block of
# tokens there, through tf32x3 tensor-core dots): the fused kernel reads fn once per block of
# tokens and multiplies on the CUDA cores. Measured on the H200 (bench.decode_mhc_kda, rank 0 of
# TP8): 10.3 against post + pre's 16.6 us at 1 token, 13.9 against 17.4 at 8, 32.6 against 22.5
# at 32. In the decode step (H100, the 28-layer rank 0, session 37, three processes, `--variant
# bmax8=...`): at 12 / 16 rows post + pre 7.759-7.772 / 8.523-8.539 ms against the fused
# boundary's 8.160-8.327 / 8.897-8.927 (blocks of 2 tokens, which session 36's H200 step had put
# ahead of a token a program); at 1 / 4 / 8 rows the fused boundary 2.411-2.416 / 4.459-4.480 /
# 5.927-5.968 against post + pre's 2.805-2.809 / 4.832-4.849 / 5.999-6.021. So 8: a token a
# program (boundary_block_t). The kernel keeps its token blocks for a larger setting; its
# one-token form stays the measured one (the token loop and T unspecialized: 209fe56's
# loop-free kernel, the same math, ran decode at 8 rows 2-3% slower on the H200).
BOUNDARY_MAX_TOKENS = 8
BOUNDARY_BLOCK_H = 64  # channels per program and stream: Hd 4096 -> 64 programs per token block
BOUNDARY_BLOCK_F = 16384  # streams x channels the finishing program holds at once
# the fused boundary's finish in two programs at once (the Sinkhorn beside the collapse, the
# kernel's comment). H100, bench.decode_mhc_kda, three runs each interleaved: 9.41 -> 6.96 us at
# 1 token, 13.36 -> 11.07 at 8; the 28-layer rank's decode at batch 8 6.58 -> 6.30 ms (medians)
BOUNDARY_SPLIT_FINISH = True


def boundary_block_t(tokens: int) -> int:
    """Tokens per program of the fused boundary: 1 up to 8 tokens (one finishing program per
    token), then up to 8 (fn read from L2 once per block; the finishing program collapses its
    block's tokens one after another)."""
    return min(8, triton.next_power_of_2(triton.cdiv(tokens, 8)))


@triton.jit
def _expansion_terms(
    t,
    res_ptr,
    post_ptr,
    comb_ptr,
    i,
    h,
    cm,
    dt,
    HC: tl.constexpr,
    K: tl.constexpr,
    HD: tl.constexpr,
    P: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Token t's post weight per lane and its streams mixed by comb (sum_j comb[j, i] res[j, h]),
    each term rounded to the streams' dtype dt as _mhc_post_kernel rounds it, float32."""
    p = tl.load(post_ptr + t * HC + i, mask=cm, other=0.0).to(dt).to(tl.float32)
    mixed = tl.zeros([P * BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(HC):
        cji = tl.load(comb_ptr + t * HC * HC + j * HC + i, mask=cm, other=0.0)
        rj = tl.load(res_ptr + t * K + j * HD + h, mask=cm, other=0.0).to(tl.float32)
        mixed += cji.to(dt).to(tl.float32) * rj
    return p, mixed


# T not specialized (== 1, divisible by 16): one compiled variant per BLOCK_T, which the decode
# graphs' capture and the start-up warm-up meet (serving/engine/kernel_warmup.py)
@triton.jit(do_not_specialize=["T"])
def _mhc_boundary_kernel(
    out_ptr,  # [T, HD] the sublayer's output
    res_ptr,  # [T, HC, HD] the streams its input was collapsed from
    post_ptr,  # [T, HC] float32: that collapse's post
    comb_ptr,  # [T, HC, HC] float32: and comb
    fn_ptr,  # [MIX, HC * HD] float32: the next collapse's mixing projection
    base_ptr,  # [MIX] float32
    scale_ptr,  # [3] float32
    nw_ptr,  # [HD] the next RMSNorm's weight
    new_ptr,  # [T, HC, HD] out: the new streams
    part_ptr,  # [T, NB, MP + 1] float32 scratch: per channel block, logits then sum of squares
    counter_ptr,  # [>= token blocks] int32: arrivals per token block, zero between calls
    post2_ptr,  # [T, HC] float32 out
    comb2_ptr,  # [T, HC, HC] float32 out
    x_ptr,  # [T, HD] out: the next sublayer's input (collapsed, RMS-normed)
    T,
    iters,
    eps,
    norm_eps,
    rms_eps,
    HC: tl.constexpr,
    P: tl.constexpr,
    MIX: tl.constexpr,
    MP: tl.constexpr,
    HD: tl.constexpr,
    NB: tl.constexpr,
    NB_P: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_F: tl.constexpr,
    SPLIT_FINISH: tl.constexpr,
):
    tb = tl.program_id(0)
    hb = tl.program_id(1)
    t0 = tb * BLOCK_T
    dt = new_ptr.dtype.element_ty
    K = HC * HD
    # this program's channels of every stream, flattened: stream i, channel h
    c = tl.arange(0, P * BLOCK_H)
    i = c // BLOCK_H
    h = hb * BLOCK_H + c % BLOCK_H
    cm = (i < HC) & (h < HD)
    m = tl.arange(0, MP)
    fn = tl.load(
        fn_ptr + m[:, None] * K + (i * HD + h)[None, :],
        mask=(m < MIX)[:, None] & cm[None, :],
        other=0.0,
    )  # [MP, P * BLOCK_H], read once for the block's tokens
    # a weight, so loaded before the wait (kernels/triton/pdl.py's exception): its latency
    # overlaps the previous kernel's tail
    if BLOCK_T == 1:
        # one token a block (decode): the streams' mix, from the previous boundary's outputs,
        # before the wait too: the kernel right before this one (the sublayer's last) writes
        # none of them (kernels/triton/pdl.py), only `out`. H100, at 1 token: 9.67 -> 9.35 us
        p_early, mixed_early = _expansion_terms(
            t0.to(tl.int64), res_ptr, post_ptr, comb_ptr, i, h, cm, dt, HC, K, HD, P, BLOCK_H
        )
    grid_dependency()
    n = tl.minimum(T - t0, BLOCK_T)
    for tt in range(0, n):
        t = (t0 + tt).to(tl.int64)
        # the expansion, each term rounded to the streams' dtype (as _mhc_post_kernel)
        o = tl.load(out_ptr + t * HD + h, mask=cm, other=0.0).to(tl.float32)
        if BLOCK_T == 1:
            p, mixed = p_early, mixed_early
        else:
            p, mixed = _expansion_terms(
                t, res_ptr, post_ptr, comb_ptr, i, h, cm, dt, HC, K, HD, P, BLOCK_H
            )
        new = ((p * o).to(dt).to(tl.float32) + mixed.to(dt).to(tl.float32)).to(dt)
        tl.store(new_ptr + t * K + i * HD + h, new, mask=cm)
        # the next collapse's partial logits (IEEE float32) and sum of squares (0 off the mask)
        x = new.to(tl.float32)
        row = part_ptr + (t * NB + hb) * (MP + 1)
        tl.store(row + m, tl.sum(fn * x[None, :], axis=1))
        tl.store(row + MP, tl.sum(x * x))
    # the last program of the token block to arrive finishes it: every thread's stores are
    # issued before the (one-thread) release, and the acquire orders the reads below after
    # every other program's stores; the partials and streams are read past L1 (.cg)
    tl.debug_barrier()
    count = tl.atomic_add(counter_ptr + tb, 1, sem="acq_rel")
    if count == NB - 1:  # the last: post and the collapse (with SPLIT_FINISH), else all
        if not SPLIT_FINISH:
            tl.store(counter_ptr + tb, 0)  # for the next call (a graph replay): none reads it
        _finish_tokens(
            part_ptr, NB, 1, NB, new_ptr, base_ptr, scale_ptr, nw_ptr, post2_ptr, comb2_ptr,
            x_ptr, t0, n, iters, eps, norm_eps, rms_eps, HC, P, MP, HD, BLOCK_T, NB_P, BLOCK_F,
            ".cg", 1 if SPLIT_FINISH else 0,
        )  # fmt: skip
    if SPLIT_FINISH:
        # two finishing programs side by side: the last to arrive collapses (post, x), the one
        # before it waits for the last's arrival, then runs the Sinkhorn (comb) and resets the
        # counter. Hazard: a wait on a later program's arrival. It cannot deadlock: one program
        # a token block waits (at most 8 a grid) and every other runs to its end without
        # waiting, so the last one always gets an SM, whatever the dispatch order; but never
        # under the interpreter, which runs programs one by one. The poll is the acquire itself,
        # its value the loop's condition (sm_90a: LDG.STRONG.GPU + CCTL.IVALL in the loop, the
        # partials' loads after it): Triton drops an atomic whose value is unused, and ptxas
        # moves later loads above a volatile-load loop.
        if count == NB - 2:
            seen = tl.atomic_add(counter_ptr + tb, 0, sem="acquire")
            while seen < NB:
                seen = tl.atomic_add(counter_ptr + tb, 0, sem="acquire")
            tl.store(counter_ptr + tb, 0)  # for the next call: nothing else reads it now
            _finish_tokens(
                part_ptr, NB, 1, NB, new_ptr, base_ptr, scale_ptr, nw_ptr, post2_ptr, comb2_ptr,
                x_ptr, t0, n, iters, eps, norm_eps, rms_eps, HC, P, MP, HD, BLOCK_T, NB_P,
                BLOCK_F, ".cg", 2,
            )  # fmt: skip


def mhc_boundary(
    out: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    iters: int,
    eps: float,
    norm_eps: float,
    weight: torch.Tensor,
    rms_eps: float,
    counter: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernels.mhc.mhc_boundary_reference: the expansion of `out` onto the streams, then the next
    collapse with its RMSNorm. Up to BOUNDARY_MAX_TOKENS tokens in one launch: programs of (token
    block, BOUNDARY_BLOCK_H channels of every stream) write the new streams and their partial logits
    and sums of squares; the last program of a token block to arrive (counter: the call site's int32
    buffer, at least cdiv(T, boundary_block_t(T)) zeros, which the kernel leaves zero) sums them in
    a fixed order and collapses + normalises, the one before it (BOUNDARY_SPLIT_FINISH; on CUDA)
    running the Sinkhorn beside it. Hazard: up to 8 tokens, residual, post and comb are read before
    the PDL wait (kernels/triton/pdl.py): the kernel launched right before must not write them (here
    it is the sublayer's last, which writes only `out`). Larger batches: mhc_post, then mhc_pre."""
    tokens, hc, hidden = residual.shape
    if tokens > BOUNDARY_MAX_TOKENS:
        new = mhc_post(out, residual, post, comb)
        return new, *mhc_pre(new, fn, base, scale, iters, eps, norm_eps, weight, rms_eps)
    mix = fn.shape[0]
    assert mix == (2 + hc) * hc and fn.shape[1] == hc * hidden, (fn.shape, residual.shape)
    assert weight.dtype == residual.dtype, "the RMSNorm weight is held in the streams' dtype"
    # the kernel reads fn before its PDL wait: it must be the parameter itself, no conversion's
    # output (kernels/triton/pdl.py)
    assert fn.dtype == torch.float32 and fn.is_contiguous(), (fn.dtype, fn.stride())
    dev = residual.device
    new = torch.empty(tokens, hc, hidden, device=dev, dtype=residual.dtype)
    post2 = torch.empty(tokens, hc, device=dev, dtype=torch.float32)
    comb2 = torch.empty(tokens, hc, hc, device=dev, dtype=torch.float32)
    x = torch.empty(tokens, hidden, device=dev, dtype=residual.dtype)
    if tokens == 0:
        return new, post2, comb2, x
    block_t = boundary_block_t(tokens)
    token_blocks = triton.cdiv(tokens, block_t)
    assert counter is not None and counter.dtype == torch.int32, "the fused boundary's counters"
    assert counter.numel() >= token_blocks, (counter.numel(), token_blocks)
    p = triton.next_power_of_2(hc)
    mp = triton.next_power_of_2(mix)
    blocks = triton.cdiv(hidden, BOUNDARY_BLOCK_H)
    part = torch.empty(tokens, blocks, mp + 1, device=dev, dtype=torch.float32)
    _mhc_boundary_kernel[(token_blocks, blocks)](
        out.contiguous(),
        residual.contiguous(),
        post.contiguous().float(),
        comb.contiguous().float(),
        fn,
        base.contiguous().float(),
        scale.contiguous().float(),
        weight.contiguous(),
        new,
        part,
        counter,
        post2,
        comb2,
        x,
        tokens,
        iters,
        eps,
        norm_eps,
        rms_eps,
        HC=hc,
        P=p,
        MIX=mix,
        MP=mp,
        HD=hidden,
        NB=blocks,
        NB_P=triton.next_power_of_2(blocks),
        BLOCK_T=block_t,
        BLOCK_H=BOUNDARY_BLOCK_H,
        BLOCK_F=min(triton.next_power_of_2(hidden), BOUNDARY_BLOCK_F // p),
        SPLIT_FINISH=BOUNDARY_SPLIT_FINISH and blocks >= 2 and not INTERPRETER,
        num_warps=8,
        **LAUNCH,
    )
    return new, post2, comb2, x

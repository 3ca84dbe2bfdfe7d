"""Triton versions of kernels/mhc.py's references (same signatures and results):

- mhc_mix: one program per token, the Sinkhorn loop in registers;
- mhc_pre (collapse + RMSNorm) in two launches: (1) split-K partial sums of the mixing logits
  (LOGIT_DOT: tf32x3 dots of the raw streams with fn) and of the squares, over programs of
  (token block, K slice) so a decode's one token still spreads fn's 1.5 MB over the SMs;
  (2) one program per token: the partials summed in a fixed order (deterministic), the RMS
  factor applied to the logits (F.linear of the normalised rows equals the factor times the
  linear of the raw rows), pre/post/comb as mhc_mix, then the collapse rounded to the streams'
  dtype and its RMSNorm; the collapse is computed twice (once for its sum of squares, once to
  normalise) instead of stored and re-read, which would need a barrier;
- mhc_post: one program per (token, Hd block), each term rounded to the streams' dtype as the
  reference's bf16 ops round them. Run 5's prefill ran this as a cuBLAS batched 4x4 GEMM per
  token: 2.5 ms per call at 8,192 tokens, two per layer;
- mhc_boundary (a decode-sized batch): mhc_post then mhc_pre in one launch. Programs of (token
  block, channel block) expand their channels of every stream (rounded as mhc_post) and dot them
  with fn's columns in IEEE float32 (at <= 8 tokens per program a tensor-core tile would be
  mostly padding, and the fn tile is read once per block of tokens anyway); the last program of
  a token block to arrive (an atomic counter per block, "the last program finishes") sums the
  partials in a fixed order and does what mhc_pre's finish kernel does, for each token of its
  block, with the collapse held in registers (one read of the new streams);
- mhc_boundary_prefill, what mhc_boundary runs above BOUNDARY_MAX_TOKENS (prefill, large
  decode and verify batches) once PREFILL_BOUNDARY is set (until then mhc_post + mhc_pre), in two
  launches: (1) programs of (channel slice, block of 16 or 64 tokens) expand their channels of
  every stream (rounded as mhc_post), store them and dot them with fn's columns on the tensor
  cores (bf16 streams: three exact bf16 products; else LOGIT_DOT) into the split-K partials of
  mhc_pre's layout; (2) mhc_pre's finish kernel, each token's whole row loaded before its
  Sinkhorn (ROW_FIRST, up to PREFILL_FINISH_ROW). No counters, no atomics.
  The old streams and `out` are read once and the new streams written once; the finish re-reads
  the new streams, from HBM at prefill sizes. One program per token block looping over every
  channel would keep them L2-hot only with at most a few hundred tokens in flight on the whole
  GPU (72 KB of traffic each against L2's 50 MB), and each program would then read fn's 1.5 MB
  from L2 for its few tokens: 0.8-3 GB at 8,192 tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.pdl import LAUNCH, grid_dependency

# The mixing logits' dot: three TF32 tensor-core products (the hi/lo split of each operand) keep
# float32's accuracy; IEEE float32 on CUDA cores made the prefill's collapse compute-bound
# (1.3 ms per call at 8,192 tokens of the real size, a third of the chunk).
LOGIT_DOT = "tf32x3"


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
def _mhc_mix_kernel(
    mix_ptr,
    base_ptr,
    scale_ptr,
    pre_ptr,
    post_ptr,
    comb_ptr,
    iters,
    eps,
    HC: tl.constexpr,
    P: tl.constexpr,
):
    t = tl.program_id(0)
    width = (2 + HC) * HC
    row = mix_ptr + t * width
    i = tl.arange(0, P)
    vec_mask = i < HC
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    pre = tl.load(row + i, mask=vec_mask, other=0.0) * s0 + tl.load(base_ptr + i, mask=vec_mask)
    tl.store(pre_ptr + t * HC + i, tl.sigmoid(pre) + eps, mask=vec_mask)
    post = tl.load(row + HC + i, mask=vec_mask, other=0.0) * s1
    post += tl.load(base_ptr + HC + i, mask=vec_mask)
    tl.store(post_ptr + t * HC + i, 2.0 * tl.sigmoid(post), mask=vec_mask)

    r = tl.arange(0, P)[:, None]
    c = tl.arange(0, P)[None, :]
    m = (r < HC) & (c < HC)
    offs = 2 * HC + r * HC + c
    logits = tl.load(row + offs, mask=m, other=0.0) * s2 + tl.load(base_ptr + offs, mask=m)
    comb = _sinkhorn(logits, m, iters, eps)
    tl.store(comb_ptr + t * HC * HC + r * HC + c, comb, mask=m)


def mhc_mix_triton(
    mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mix = mix.contiguous().float()
    n = mix.shape[0]
    pre = torch.empty(n, hc, device=mix.device, dtype=torch.float32)
    post = torch.empty_like(pre)
    comb = torch.empty(n, hc, hc, device=mix.device, dtype=torch.float32)
    if n:
        _mhc_mix_kernel[(n,)](
            mix,
            base.contiguous().float(),
            scale.contiguous().float(),
            pre,
            post,
            comb,
            iters,
            eps,
            HC=hc,
            P=triton.next_power_of_2(hc),
        )
    return pre, post, comb


@triton.jit
def _mhc_pre_partial_kernel(
    x_ptr,  # [T, K] the flattened streams
    fn_ptr,  # [MIX, K] float32
    part_ptr,  # [S, T, MP + 1] float32: logits partials, then the sum of squares
    T,
    K,
    k_per_split,
    MIX: tl.constexpr,
    MP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
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
        x = tl.load(
            x_ptr + t[:, None].to(tl.int64) * K + k[None, :],
            mask=t_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        w = tl.load(fn_ptr + m[None, :] * K + k[:, None], mask=m_mask[None, :] & k_mask[:, None])
        sq += tl.sum(x * x, axis=1)
        acc = tl.dot(x, w.to(tl.float32), acc, input_precision=PRECISION)
    row = part_ptr + (s * T + t[:, None]) * (MP + 1)
    tl.store(row + m[None, :], acc, mask=t_mask[:, None])
    tl.store(part_ptr + (s * T + t) * (MP + 1) + MP, sq, mask=t_mask)


# T and splits not specialized (== 1, divisible by 16): a prefill boundary's splits vary with its
# token count (mhc_boundary_prefill, which also fixes SPLITS), so the start-up warm-up's sizes
# could not meet every variant
@triton.jit(do_not_specialize=["T", "splits"])
def _mhc_pre_finish_kernel(
    part_ptr,
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
    BLOCK_H: tl.constexpr,
    SPLITS: tl.constexpr,
    ROW_FIRST: tl.constexpr,
):
    """ROW_FIRST (BLOCK_H >= HD): the token's streams are loaded as one [P, BLOCK_H] tile before
    anything else, so that their latency passes behind the partials' sums and the Sinkhorn, and
    collapsed as a sum over the tile's stream axis (another float32 order than _collapse's).
    Otherwise _collapse_norm loads them after the Sinkhorn."""
    grid_dependency()  # first: kernels/triton/pdl.py
    t = tl.program_id(0)
    i = tl.arange(0, P)
    vec_mask = i < HC
    base = x_ptr + t.to(tl.int64) * (HC * HD)
    if ROW_FIRST:
        h = tl.arange(0, BLOCK_H)
        rows = tl.load(
            base + i[:, None] * HD + h[None, :],
            mask=vec_mask[:, None] & (h < HD)[None, :],
            other=0.0,
        )  # [P, BLOCK_H]: 0 off the streams, so pre's padding adds nothing below
    r = tl.arange(0, P)[:, None]
    c = tl.arange(0, P)[None, :]
    m = (r < HC) & (c < HC)
    pre_w = tl.zeros([P], dtype=tl.float32)
    post_w = tl.zeros([P], dtype=tl.float32)
    comb_w = tl.zeros([P, P], dtype=tl.float32)
    sq = 0.0
    comb_off = 2 * HC + r * HC + c
    # SPLITS partials at a time, each block summed as a tree: a fixed order (deterministic)
    # without a serial load per partial (a decode's one token has ~128 of them)
    for s0 in range(0, splits, SPLITS):
        s = s0 + tl.arange(0, SPLITS)
        s_mask = s < splits
        row = part_ptr + (s * T + t).to(tl.int64) * (MP + 1)
        vm = s_mask[:, None] & vec_mask[None, :]
        pre_w += tl.sum(tl.load(row[:, None] + i[None, :], mask=vm, other=0.0), axis=0)
        post_w += tl.sum(tl.load(row[:, None] + HC + i[None, :], mask=vm, other=0.0), axis=0)
        cm = s_mask[:, None, None] & m[None, :, :]
        comb_w += tl.sum(
            tl.load(row[:, None, None] + comb_off[None, :, :], mask=cm, other=0.0), axis=0
        )
        sq += tl.sum(tl.load(row + MP, mask=s_mask, other=0.0))
    rstd = 1.0 / tl.sqrt(sq / (HC * HD) + norm_eps)
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    pre = tl.sigmoid(pre_w * rstd * s0 + tl.load(base_ptr + i, mask=vec_mask, other=0.0)) + eps
    post = post_w * rstd * s1 + tl.load(base_ptr + HC + i, mask=vec_mask, other=0.0)
    tl.store(post_ptr + t * HC + i, 2.0 * tl.sigmoid(post), mask=vec_mask)
    logits = comb_w * rstd * s2 + tl.load(base_ptr + 2 * HC + r * HC + c, mask=m, other=0.0)
    comb = _sinkhorn(logits, m, iters, eps)
    tl.store(comb_ptr + t * HC * HC + r * HC + c, comb, mask=m)

    out_row = out_ptr + t.to(tl.int64) * HD
    if ROW_FIRST:
        dt = out_row.dtype.element_ty
        col = tl.sum(pre[:, None] * rows.to(tl.float32), axis=0).to(dt).to(tl.float32)
        rms = 1.0 / tl.sqrt(tl.sum(col * col) / HD + rms_eps)
        _norm_store(col, rms, nw_ptr, out_row, h, h < HD, dt)
    else:
        _collapse_norm(base, pre, i, nw_ptr, out_row, rms_eps, HC, HD, BLOCK_H, "")


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
    block_t = 16 if tokens <= 16 else 64
    block_k = 128 if block_t == 16 else 64
    t_blocks = triton.cdiv(tokens, block_t)
    # about two programs per SM (132 on the H200) however few the tokens
    splits = max(1, min(triton.cdiv(k, block_k), triton.cdiv(264, t_blocks)))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    part = torch.empty(splits, tokens, mp + 1, device=dev, dtype=torch.float32)
    _mhc_pre_partial_kernel[(t_blocks, splits)](
        x,
        fn.contiguous().float(),
        part,
        tokens,
        k,
        k_per_split,
        MIX=mix,
        MP=mp,
        BLOCK_T=block_t,
        BLOCK_K=block_k,
        PRECISION=LOGIT_DOT,
        num_warps=4,
        **LAUNCH,
    )
    args = (base, scale, iters, eps, norm_eps, weight, rms_eps, post, comb, out)
    splits_block = min(64, triton.next_power_of_2(splits))
    _pre_finish(part, x, *args, row_first=False, splits_block=splits_block)
    return post, comb, out


def _pre_finish(
    part,
    streams,
    base,
    scale,
    iters,
    eps,
    norm_eps,
    weight,
    rms_eps,
    post,
    comb,
    out,
    row_first,
    splits_block,
):
    """The collapse's second launch: part [splits, T, MP + 1] (the logits' split-K partials, then
    the sum of squares) and the streams [T, hc, Hd] -> post, comb and the normed collapse, written
    into the given outputs. row_first: the token's whole row loaded first, in one tile (the
    kernel's ROW_FIRST); else in blocks of up to 1024 channels after the Sinkhorn, twice when Hd
    is larger (the second time from L2 if it still holds them). splits_block: partials summed
    per step (the kernel's SPLITS)."""
    splits, tokens = part.shape[:2]
    _, hc, hidden = streams.shape
    block_h = triton.next_power_of_2(hidden)
    if not row_first:
        block_h = min(1024, block_h)
    _mhc_pre_finish_kernel[(tokens,)](
        part,
        streams,
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
        MP=part.shape[2] - 1,
        HD=hidden,
        BLOCK_H=block_h,
        SPLITS=splits_block,
        ROW_FIRST=row_first,
        num_warps=8 if row_first else 4,
        **LAUNCH,
    )


@triton.jit
def _mhc_post_kernel(
    out_ptr,  # [T, HD] sublayer output
    res_ptr,  # [T, HC, HD]
    post_ptr,  # [T, HC] float32
    comb_ptr,  # [T, HC, HC] float32
    new_ptr,  # [T, HC, HD]
    HC: tl.constexpr,
    HD: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    grid_dependency()  # first: kernels/triton/pdl.py
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h < HD
    dt = new_ptr.dtype.element_ty
    o = tl.load(out_ptr + t * HD + h, mask=h_mask, other=0.0).to(tl.float32)
    res = t * (HC * HD) + h
    for i in tl.static_range(HC):
        p = tl.load(post_ptr + t * HC + i).to(dt).to(tl.float32)
        mixed = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(HC):
            cji = tl.load(comb_ptr + t * HC * HC + j * HC + i).to(dt).to(tl.float32)
            rj = tl.load(res_ptr + res + j * HD, mask=h_mask, other=0.0).to(tl.float32)
            mixed += cji * rj
        a = (p * o).to(dt).to(tl.float32)
        b = mixed.to(dt).to(tl.float32)
        tl.store(new_ptr + res + i * HD, (a + b).to(dt), mask=h_mask)


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
        HD=hidden,
        BLOCK_H=block_h,
        num_warps=4,
        **LAUNCH,
    )
    return new


# The fused boundary: batches of up to this many tokens (decode, EAGLE verify, short chunks);
# larger ones run mhc_boundary_prefill (two launches, but each tile of fn serves a block of
# tokens there, through tf32x3 tensor-core dots): the fused kernel reads fn once per block of at
# most 8 tokens and multiplies on the CUDA cores, which at prefill sizes is T/8 reads of 1.5 MB.
# Measured on the H200 (bench.decode_mhc_kda, rank 0 of TP8): 10.3 against post + pre's 16.6 us
# at 1 token, 13.9 against 17.4 at 8, but 32.6 against 22.5 at 32: so 16, not more (measured
# against mhc_post + mhc_pre, before mhc_boundary_prefill).
BOUNDARY_MAX_TOKENS = 16
# Past BOUNDARY_MAX_TOKENS: mhc_boundary_prefill where True, else mhc_post then mhc_pre (three
# launches, the streams read three times; the path measured on the H200). False until
# bench.prefill_mhc and the GPU tests have run on the H200: the prefill boundary has only run in
# Triton's interpreter and compiled for sm_90 ahead of time (its bf16 tf32x3 logits unchecked).
PREFILL_BOUNDARY = False
BOUNDARY_BLOCK_H = 64  # channels per program and stream: Hd 4096 -> 64 programs per token block
BOUNDARY_BLOCK_F = 16384  # streams x channels the finishing program holds at once


def boundary_block_t(tokens: int) -> int:
    """Tokens per program of the fused boundary: 1 up to 8 tokens (one finishing program per
    token), then up to 8 (fn read from L2 once per block; the finishing program collapses its
    block's tokens one after another)."""
    return min(8, triton.next_power_of_2(triton.cdiv(tokens, 8)))


# T not specialized (== 1, divisible by 16): the compiled variants are BLOCK_T's four, which the
# decode graphs' capture (1 to 8 tokens) and the start-up warm-up's prefills of 16, 17 and 33+
# tokens all meet (serving/engine/kernel_warmup.py)
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
):
    grid_dependency()  # first: kernels/triton/pdl.py
    tb = tl.program_id(0)
    hb = tl.program_id(1)
    t0 = tb * BLOCK_T
    n = tl.minimum(T - t0, BLOCK_T)
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
    for tt in range(0, n):
        t = (t0 + tt).to(tl.int64)
        # the expansion, each term rounded to the streams' dtype (as _mhc_post_kernel)
        o = tl.load(out_ptr + t * HD + h, mask=cm, other=0.0).to(tl.float32)
        p = tl.load(post_ptr + t * HC + i, mask=cm, other=0.0).to(dt).to(tl.float32)
        mixed = tl.zeros([P * BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(HC):
            cji = tl.load(comb_ptr + t * HC * HC + j * HC + i, mask=cm, other=0.0)
            rj = tl.load(res_ptr + t * K + j * HD + h, mask=cm, other=0.0).to(tl.float32)
            mixed += cji.to(dt).to(tl.float32) * rj
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
    if count == NB - 1:
        tl.store(counter_ptr + tb, 0)  # for the next call (a graph replay): nothing else reads it
        tok = tl.arange(0, BLOCK_T)
        s = tl.arange(0, NB_P)
        r = tl.arange(0, P)
        tm = tok < n
        rows = part_ptr + ((t0 + tok)[:, None] * NB + s[None, :]).to(tl.int64) * (MP + 1)
        ts = tm[:, None] & (s < NB)[None, :]  # [BLOCK_T, NB_P]
        # the partials summed as a tree over the channel blocks: a fixed order
        vm = ts[:, :, None] & (r < HC)[None, None, :]
        vec = rows[:, :, None] + r[None, None, :]
        pre_w = tl.sum(tl.load(vec, mask=vm, other=0.0, cache_modifier=".cg"), axis=1)
        post_w = tl.sum(tl.load(vec + HC, mask=vm, other=0.0, cache_modifier=".cg"), axis=1)
        rc = r[:, None] * HC + r[None, :]  # [P, P]: comb[row, col] at row * HC + col
        pm = (r < HC)[:, None] & (r < HC)[None, :]
        cmask = ts[:, :, None, None] & pm[None, None, :, :]
        comb_w = tl.sum(
            tl.load(
                rows[:, :, None, None] + 2 * HC + rc[None, None, :, :],
                mask=cmask,
                other=0.0,
                cache_modifier=".cg",
            ),
            axis=1,
        )  # [BLOCK_T, P, P]
        sq = tl.sum(tl.load(rows + MP, mask=ts, other=0.0, cache_modifier=".cg"), axis=1)
        # F.linear of the normalised rows = the RMS factor times the linear of the raw rows
        rstd = 1.0 / tl.sqrt(sq / K + norm_eps)
        s0 = tl.load(scale_ptr)
        s1 = tl.load(scale_ptr + 1)
        s2 = tl.load(scale_ptr + 2)
        vmask = tm[:, None] & (r < HC)[None, :]
        pre = tl.load(base_ptr + r, mask=r < HC, other=0.0)[None, :]
        pre = tl.sigmoid(pre_w * rstd[:, None] * s0 + pre) + eps  # [BLOCK_T, P]
        post = tl.load(base_ptr + HC + r, mask=r < HC, other=0.0)[None, :]
        post = 2.0 * tl.sigmoid(post_w * rstd[:, None] * s1 + post)
        tv = (t0 + tok).to(tl.int64)
        tl.store(post2_ptr + tv[:, None] * HC + r[None, :], post, mask=vmask)
        comb_b = tl.load(base_ptr + 2 * HC + rc, mask=pm, other=0.0)
        logits = comb_w * rstd[:, None, None] * s2 + comb_b[None, :, :]
        comb = _sinkhorn(logits, tm[:, None, None] & pm[None, :, :], iters, eps)
        tl.store(comb2_ptr + tv[:, None, None] * HC * HC + rc[None, :, :], comb,
                 mask=tm[:, None, None] & pm[None, :, :])  # fmt: skip
        for tt in range(0, n):  # the collapse of each token of the block, and its RMSNorm
            t = (t0 + tt).to(tl.int64)
            pre_t = tl.sum(tl.where(tok[:, None] == tt, pre, 0.0), axis=0)
            _collapse_norm(
                new_ptr + t * K, pre_t, r, nw_ptr, x_ptr + t * HD, rms_eps, HC, HD, BLOCK_F, ".cg"
            )


# The prefill boundary's expansion: blocks of 16 tokens (the smallest MMA tile) up to
# PREFILL_SMALL_TOKENS, then 64 (a tile of fn's columns then serves 64 tokens: 196 MB of L2 reads
# at 8,192 tokens), with 32 and 16 channels of every stream per step of a program's loop, 4
# warps. Compiled ahead of time for sm_90 (ptxas -v, bf16): 137 and 96 registers, no spills;
# 64 x 64 took 255 with spills (Triton computes the expansion in the MMA operand's layout, which
# it hoists above the elementwise work), so did the float32 operands of tf32x3. The channels are
# split so that the expansion runs about PREFILL_PROGRAMS programs: eight per SM of the H200, so
# that the last wave is a small part of the time (a chunk of 8,192 tokens: 128 token blocks x 9
# splits of 29 blocks of 16 channels; the partials 9.7 MB). Not yet measured: bench.prefill_mhc
# --programs sweeps it.
PREFILL_SMALL_TOKENS = 64
PREFILL_PROGRAMS = 1056
# Software pipelining of the expansion's loop: off, so that fn's tiles take no multi-buffered
# shared memory from the L1 that the streams' re-reads per output stream hit (_mhc_post_kernel's
# pattern: 90% of the HBM's bandwidth at 8,192 tokens in the H200 profile); unmeasured here
PREFILL_STAGES = 1
# The finish loads a token's whole row first (ROW_FIRST) where its P x Hd tile has at most this
# many elements (Hd 4096 at hc 4: 64 per thread of 8 warps); larger rows, two passes of 1024
PREFILL_FINISH_ROW = 16384


def prefill_block_t(tokens: int) -> int:
    return 16 if tokens <= PREFILL_SMALL_TOKENS else 64


def prefill_block_h(block_t: int) -> int:
    return 32 if block_t == 16 else 16


# T and blocks_per_split not specialized: they vary with the token count, and the compiled
# variants are then BLOCK_T's two (and the dtype's), which the start-up warm-up's prefills of 17
# to 64 and of 65+ tokens both meet (serving/engine/kernel_warmup.py). Hazard: a channel offset
# must stay a visible multiple of BLOCK_H (blocks times the constexpr): Triton's alignment
# analysis cannot see through an unspecialized channel count, and the loads and stores would
# lose their 16-byte vectors
@triton.jit(do_not_specialize=["T", "blocks_per_split"])
def _mhc_boundary_expand_kernel(
    out_ptr,  # [T, HD] the sublayer's output
    res_ptr,  # [T, HC, HD] the streams its input was collapsed from
    post_ptr,  # [T, HC] float32: that collapse's post
    comb_ptr,  # [T, HC, HC] float32: and comb
    fn_ptr,  # [MIX, HC * HD] float32: the next collapse's mixing projection
    new_ptr,  # [T, HC, HD] out: the new streams
    part_ptr,  # [S, T, MP + 1] float32 out: logits partials, then the sum of squares
    T,
    blocks_per_split,  # blocks of BLOCK_H channels per split
    HC: tl.constexpr,
    MIX: tl.constexpr,
    MP: tl.constexpr,
    HD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BF16_SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Programs of (split s: a channel slice of every stream, token block): the expansion of
    _mhc_post_kernel (the same ops in the same order: each term rounded to the streams' dtype),
    stored, and the next collapse's partial logits (its rounded values dotted with fn's columns
    i * HD + h) and sum of squares, as _mhc_pre_partial_kernel's for the K slice {i * HD + h}.
    Token blocks run last first, so that the finish kernel's first programs (the first tokens)
    re-read the new streams written last, which L2 may still hold.

    The logits' dots: BF16_SPLIT (bf16 streams) as three bf16 tensor-core products of the new
    streams, exact in bf16, with fn split exactly into three bf16 terms (hi + mid + lo: 24 bits
    of mantissa), every product exact and summed in float32 (tf32x3 drops its lo x lo term);
    else PRECISION (LOGIT_DOT) on float32 operands, whose splits cost more registers (178 at 64
    tokens x 16 channels for sm_90, against 96)."""
    grid_dependency()  # first: kernels/triton/pdl.py
    s = tl.program_id(0)
    tb = tl.num_programs(1) - 1 - tl.program_id(1)
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < T
    tv = t.to(tl.int64)
    m = tl.arange(0, MP)
    m_mask = m < MIX
    dt = new_ptr.dtype.element_ty
    K = HC * HD
    acc = tl.zeros([BLOCK_T, MP], dtype=tl.float32)
    sq = tl.zeros([BLOCK_T], dtype=tl.float32)
    for hb in range(0, blocks_per_split):
        h = (s * blocks_per_split + hb) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_mask = h < HD
        th = t_mask[:, None] & h_mask[None, :]
        o = tl.load(out_ptr + tv[:, None] * HD + h[None, :], mask=th, other=0.0).to(tl.float32)
        rows = tv[:, None] * K + h[None, :]
        for i in tl.static_range(HC):
            # fn's columns of stream i first: their L2 latency passes behind the expansion (no
            # load moves above the previous stream's store, which might alias it)
            w = tl.load(
                fn_ptr + m[None, :] * K + (i * HD + h)[:, None],
                mask=m_mask[None, :] & h_mask[:, None],
                other=0.0,
            )
            p = tl.load(post_ptr + tv * HC + i, mask=t_mask, other=0.0).to(dt).to(tl.float32)
            mixed = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
            for j in tl.static_range(HC):  # the streams re-read per i hit L1
                cji = tl.load(comb_ptr + tv * (HC * HC) + j * HC + i, mask=t_mask, other=0.0)
                rj = tl.load(res_ptr + rows + j * HD, mask=th, other=0.0).to(tl.float32)
                mixed += cji.to(dt).to(tl.float32)[:, None] * rj
            a = (p[:, None] * o).to(dt).to(tl.float32)
            b = mixed.to(dt).to(tl.float32)
            new = (a + b).to(dt)
            x = new.to(tl.float32)  # 0 off the mask
            sq += tl.sum(x * x, axis=1)
            if BF16_SPLIT:
                w_hi = w.to(tl.bfloat16)
                rest = w - w_hi.to(tl.float32)  # exact, as is the next remainder
                w_mid = rest.to(tl.bfloat16)
                w_lo = (rest - w_mid.to(tl.float32)).to(tl.bfloat16)
                acc = tl.dot(new, w_hi, acc)
                acc = tl.dot(new, w_mid, acc)
                acc = tl.dot(new, w_lo, acc)
            else:
                acc = tl.dot(x, w, acc, input_precision=PRECISION)
            tl.store(new_ptr + rows + i * HD, new, mask=th)
    row = part_ptr + (s * T + tv) * (MP + 1)
    tl.store(row[:, None] + m[None, :], acc, mask=t_mask[:, None])
    tl.store(row + MP, sq, mask=t_mask)


def mhc_boundary_prefill(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernels.mhc.mhc_boundary_reference in two launches for a batch of any size (the module
    docstring): the expansion with the collapse's split-K partials, then mhc_pre's finish. The
    mixing logits are LOGIT_DOT sums of the rounded new streams in another order than mhc_pre's
    (float32's accuracy either way)."""
    tokens, hc, hidden = residual.shape
    mix = fn.shape[0]
    assert mix == (2 + hc) * hc and fn.shape[1] == hc * hidden, (fn.shape, residual.shape)
    assert weight.dtype == residual.dtype, "the RMSNorm weight is held in the streams' dtype"
    dev = residual.device
    new = torch.empty(tokens, hc, hidden, device=dev, dtype=residual.dtype)
    post2 = torch.empty(tokens, hc, device=dev, dtype=torch.float32)
    comb2 = torch.empty(tokens, hc, hc, device=dev, dtype=torch.float32)
    x = torch.empty(tokens, hidden, device=dev, dtype=residual.dtype)
    if tokens == 0:
        return new, post2, comb2, x
    mp = triton.next_power_of_2(mix)
    block_t = prefill_block_t(tokens)
    block_h = prefill_block_h(block_t)
    t_blocks = triton.cdiv(tokens, block_t)
    h_blocks = triton.cdiv(hidden, block_h)
    splits = max(1, min(h_blocks, triton.cdiv(PREFILL_PROGRAMS, t_blocks)))
    blocks_per_split = triton.cdiv(h_blocks, splits)
    splits = triton.cdiv(h_blocks, blocks_per_split)
    part = torch.empty(splits, tokens, mp + 1, device=dev, dtype=torch.float32)
    _mhc_boundary_expand_kernel[(splits, t_blocks)](
        out.contiguous(),
        residual.contiguous(),
        post.contiguous().float(),
        comb.contiguous().float(),
        fn.contiguous().float(),
        new,
        part,
        tokens,
        blocks_per_split,
        HC=hc,
        MIX=mix,
        MP=mp,
        HD=hidden,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        BF16_SPLIT=residual.dtype == torch.bfloat16,
        PRECISION=LOGIT_DOT,
        num_warps=4,
        num_stages=PREFILL_STAGES,
        **LAUNCH,
    )
    # the whole row first: mhc_pre's finish (the same kernel, two passes of 1024 channels after
    # the Sinkhorn) took 139 us per call at 8,192 tokens in an H200 profile (12.5 ms in 90 calls,
    # docs/notebook/2026-11-29_2026-12-03.md): 57% of the HBM's bandwidth for one read of the
    # streams and the write of x, its loads waiting for the Sinkhorn
    row_first = triton.next_power_of_2(hc) * triton.next_power_of_2(hidden) <= PREFILL_FINISH_ROW
    args = (base, scale, iters, eps, norm_eps, weight, rms_eps, post2, comb2, x)
    # 64 partials per step whatever the split count (masked): one compiled variant for every
    # token count, which the warm-up's prefills then meet
    _pre_finish(part, new, *args, row_first=row_first, splits_block=64)
    return new, post2, comb2, x


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
    """kernels.mhc.mhc_boundary_reference: the expansion of `out` onto the streams, then the
    next collapse with its RMSNorm. Up to BOUNDARY_MAX_TOKENS tokens in one launch: programs of
    (token block, BOUNDARY_BLOCK_H channels of every stream) write the new streams and their
    partial logits and sums of squares; the last program of a token block to arrive (counter:
    the call site's int32 buffer, at least cdiv(T, boundary_block_t(T)) zeros, which the kernel
    leaves zero) sums them in a fixed order, runs the Sinkhorn and collapses + normalises.
    Larger batches: mhc_boundary_prefill (two launches, no counters) where PREFILL_BOUNDARY,
    else mhc_post then mhc_pre."""
    tokens, hc, hidden = residual.shape
    if tokens > BOUNDARY_MAX_TOKENS:
        args = (fn, base, scale, iters, eps, norm_eps, weight, rms_eps)
        if PREFILL_BOUNDARY:
            return mhc_boundary_prefill(out, residual, post, comb, *args)
        new = mhc_post(out, residual, post, comb)
        return new, *mhc_pre(new, *args)
    mix = fn.shape[0]
    assert mix == (2 + hc) * hc and fn.shape[1] == hc * hidden, (fn.shape, residual.shape)
    assert weight.dtype == residual.dtype, "the RMSNorm weight is held in the streams' dtype"
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
        fn.contiguous().float(),
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
        num_warps=8,
        **LAUNCH,
    )
    return new, post2, comb2, x

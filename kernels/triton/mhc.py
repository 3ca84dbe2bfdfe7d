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
  token: 2.5 ms per call at 8,192 tokens, two per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The mixing logits' dot: three TF32 tensor-core products (the hi/lo split of each operand) keep
# float32's accuracy; IEEE float32 on CUDA cores made the prefill's collapse compute-bound
# (1.3 ms per call at 8,192 tokens of the real size, a third of the chunk).
LOGIT_DOT = "tf32x3"


@triton.jit
def _sinkhorn(logits, m, iters, eps):
    """The [P, P] mixing logits (valid where m) -> row softmax + eps, then iters column/row
    normalisations (the last is a column one), as kernels.mhc's reference."""
    logits = tl.where(m, logits, float("-inf"))
    logits = logits - tl.max(logits, axis=1)[:, None]
    e = tl.where(m, tl.exp(logits), 0.0)
    comb = tl.where(m, e / tl.sum(e, axis=1)[:, None] + eps, 0.0)
    comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
    return comb


@triton.jit
def _collapse(base, pre, i, h, h_mask, dt, HC: tl.constexpr, HD: tl.constexpr):
    """sum_j pre[j] * streams[j, h] for one token's block of channels h, rounded to the
    stream dtype as the reference's collapse is (float32 out)."""
    col = tl.zeros(h.shape, dtype=tl.float32)
    for j in tl.static_range(HC):
        pj = tl.sum(tl.where(i == j, pre, 0.0))
        col += pj * tl.load(base + j * HD + h, mask=h_mask, other=0.0).to(tl.float32)
    return col.to(dt).to(tl.float32)


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


@triton.jit
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
):
    t = tl.program_id(0)
    i = tl.arange(0, P)
    vec_mask = i < HC
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

    dt = out_ptr.dtype.element_ty
    base = x_ptr + t.to(tl.int64) * (HC * HD)
    ss = tl.zeros([BLOCK_H], dtype=tl.float32)
    for h0 in range(0, HD, BLOCK_H):  # pass 1: the collapse's sum of squares
        h = h0 + tl.arange(0, BLOCK_H)
        h_mask = h < HD
        col = _collapse(base, pre, i, h, h_mask, dt, HC, HD)
        ss += col * col
    rms = 1.0 / tl.sqrt(tl.sum(ss) / HD + rms_eps)
    for h0 in range(0, HD, BLOCK_H):  # pass 2: the same collapse, normalised and scaled
        h = h0 + tl.arange(0, BLOCK_H)
        h_mask = h < HD
        col = _collapse(base, pre, i, h, h_mask, dt, HC, HD)
        normed = (col * rms).to(dt).to(tl.float32)
        w = tl.load(nw_ptr + h, mask=h_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t.to(tl.int64) * HD + h, (w * normed).to(dt), mask=h_mask)


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
    )
    _mhc_pre_finish_kernel[(tokens,)](
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
        BLOCK_H=min(1024, triton.next_power_of_2(hidden)),
        SPLITS=min(64, triton.next_power_of_2(splits)),
        num_warps=4,
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
    HD: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
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
    )
    return new

"""Triton DSA indexer: pool scoring straight from the paged pooled-key cache, top-k selection
with the reference's tie rule, expansion to token positions, and kpool compression.

Public functions (semantics of kernels/indexer.py unless said otherwise):

    score_pools_paged(q, head_weights, index_keys, req_to_token, req_rows, positions,
                      kpool, max_pools, softmax_scale) -> scores [N, max_pools] float32
        q [N, Hi, D] (any float dtype), head_weights [N, Hi] (already times Hi^-0.5),
        index_keys [slots // kpool, D] (the layer's pooled-key cache), req_to_token
        [rows, max_context] int64, req_rows [N] int64 request row of each query, positions [N]
        int64. Pool p of query n is read from index_keys[req_to_token[row, p*kpool] // kpool]
        and scored sum_h w[n,h] * relu(scale * q[n,h] . k[p]) in fp32; pools that are not
        complete and visible ((p+1)*kpool - 1 > position[n]) get -inf and are never read.
        Equals kernels.indexer.score_pools on the gathered keys wherever a pool is visible.

    select_tokens(scores, positions, kpool, select_pools, select_tail) -> [N, width] int64
        Same signature and exact output as kernels.indexer.select_tokens (masking of invisible
        pools included), without a full sort: each score becomes a unique int64 key
        (order-preserving float bits << 32 | (2^32 - 1 - pool)), so torch.topk over distinct
        keys returns the pools by descending score with the lower pool index first among equal
        scores -- the reference's stable-sort tie rule, whatever topk's own tie behaviour.
        -0.0 is folded into +0.0 first, as the float comparison does.

    index_select_paged(q, head_weights, index_keys, req_to_token, req_rows, positions, kpool,
                       max_pools, softmax_scale, select_pools, select_tail) -> [N, width] int64
        score_pools_paged then select_tokens: what the model's indexer returns per query.

    kpool_compress(keys, gates, ape) -> [M, D]
        keys, gates [M, kpool, D], ape [kpool, D]; as kernels.indexer.kpool_compress.

Everything is shape-driven (no host sync), so the decode path captures in CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _score_queries(
    q_ptr,
    w_ptr,
    keys_ptr,
    r2t_ptr,
    out_ptr,
    n0,
    row,
    pos_max,
    pos_q,
    q_valid,
    offs_p,
    N,
    HI,
    D,
    max_pools,
    ctx_len,
    stride_qn,
    stride_qh,
    stride_wn,
    stride_key,
    stride_r2t,
    stride_on,
    scale,
    KPOOL: tl.constexpr,
    QB: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Scores of QB consecutive queries n0.. that share request row `row`, on BLOCK_P pools:
    one key gather, one [QB*BLOCK_H, D] x [D, BLOCK_P] dot."""
    in_range = (offs_p < max_pools) & (offs_p * KPOOL < ctx_len)
    load_p = in_range & ((offs_p + 1) * KPOOL - 1 <= pos_max)
    slot = tl.load(r2t_ptr + row * stride_r2t + offs_p * KPOOL, mask=load_p, other=0)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    k = tl.load(
        keys_ptr + (slot // KPOOL)[:, None] * stride_key + offs_d[None, :],
        mask=load_p[:, None] & d_mask[None, :],
        other=0.0,
    )
    offs_m = tl.arange(0, QB * BLOCK_H)
    qi = n0 + offs_m // BLOCK_H
    hi = offs_m % BLOCK_H
    m_mask = (hi < HI) & (qi < N)
    q = tl.load(
        q_ptr + qi[:, None] * stride_qn + hi[:, None] * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    w = tl.load(w_ptr + qi * stride_wn + hi, mask=m_mask, other=0.0).to(tl.float32)
    logits = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC)  # [QB*BH, BP]
    logits = w[:, None] * tl.maximum(logits * scale, 0.0)
    s = tl.sum(tl.reshape(logits, [QB, BLOCK_H, BLOCK_P]), axis=1)  # [QB, BP]
    vis = in_range[None, :] & ((offs_p[None, :] + 1) * KPOOL - 1 <= pos_q[:, None])
    s = tl.where(vis, s, float("-inf"))
    offs_q = n0 + tl.arange(0, QB)
    tl.store(
        out_ptr + offs_q[:, None] * stride_on + offs_p[None, :],
        s,
        mask=q_valid[:, None] & (offs_p < max_pools)[None, :],
    )


@triton.jit
def _score_pools_kernel(
    q_ptr,
    w_ptr,
    keys_ptr,
    r2t_ptr,
    rows_ptr,
    pos_ptr,
    out_ptr,
    N,
    HI,
    D,
    max_pools,
    ctx_len,
    stride_qn,
    stride_qh,
    stride_wn,
    stride_key,
    stride_r2t,
    stride_on,
    scale,
    KPOOL: tl.constexpr,
    QB: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Program = (block of QB queries, block of BLOCK_P pools). When the block's queries share
    one request row (extend chunks, EAGLE verify) its pooled keys are gathered once for all of
    them; otherwise each query runs on its own."""
    n0 = (tl.program_id(0) * QB).to(tl.int64)
    offs_p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_q = n0 + tl.arange(0, QB)
    q_valid = offs_q < N
    row0 = tl.load(rows_ptr + n0)
    rows = tl.load(rows_ptr + offs_q, mask=q_valid, other=row0)
    pos = tl.load(pos_ptr + offs_q, mask=q_valid, other=-1)
    if QB == 1:
        _score_queries(
            q_ptr,
            w_ptr,
            keys_ptr,
            r2t_ptr,
            out_ptr,
            n0,
            row0,
            tl.max(pos, axis=0),
            pos,
            q_valid,
            offs_p,
            N,
            HI,
            D,
            max_pools,
            ctx_len,
            stride_qn,
            stride_qh,
            stride_wn,
            stride_key,
            stride_r2t,
            stride_on,
            scale,
            KPOOL,
            QB,
            BLOCK_H,
            BLOCK_D,
            BLOCK_P,
            DOT_PREC,
        )
    else:
        if tl.min(rows, axis=0) == tl.max(rows, axis=0):
            _score_queries(
                q_ptr,
                w_ptr,
                keys_ptr,
                r2t_ptr,
                out_ptr,
                n0,
                row0,
                tl.max(pos, axis=0),
                pos,
                q_valid,
                offs_p,
                N,
                HI,
                D,
                max_pools,
                ctx_len,
                stride_qn,
                stride_qh,
                stride_wn,
                stride_key,
                stride_r2t,
                stride_on,
                scale,
                KPOOL,
                QB,
                BLOCK_H,
                BLOCK_D,
                BLOCK_P,
                DOT_PREC,
            )
        else:
            for i in tl.static_range(QB):
                if n0 + i < N:
                    row_i = tl.load(rows_ptr + n0 + i)
                    pos_i = tl.load(pos_ptr + n0 + i)
                    _score_queries(
                        q_ptr,
                        w_ptr,
                        keys_ptr,
                        r2t_ptr,
                        out_ptr,
                        n0 + i,
                        row_i,
                        pos_i,
                        tl.full([1], pos_i, tl.int64),
                        tl.full([1], 1, tl.int1),
                        offs_p,
                        N,
                        HI,
                        D,
                        max_pools,
                        ctx_len,
                        stride_qn,
                        stride_qh,
                        stride_wn,
                        stride_key,
                        stride_r2t,
                        stride_on,
                        scale,
                        KPOOL,
                        1,
                        BLOCK_H,
                        BLOCK_D,
                        BLOCK_P,
                        DOT_PREC,
                    )


@triton.jit
def _topk_keys_kernel(
    scores_ptr,
    pos_ptr,
    keys_ptr,
    P,
    stride_sn,
    KPOOL: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Unique order-preserving int64 keys; invisible pools -> -inf first, as the reference."""
    n = tl.program_id(0).to(tl.int64)
    offs_p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    mask = offs_p < P
    pos = tl.load(pos_ptr + n)
    s = tl.load(scores_ptr + n * stride_sn + offs_p, mask=mask, other=0.0).to(tl.float32)
    s = tl.where((offs_p + 1) * KPOOL - 1 <= pos, s, float("-inf"))
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 -> +0.0: equal floats must get equal high bits
    bits = s.to(tl.int32, bitcast=True)
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = (bits.to(tl.int64) << 32) | (0xFFFFFFFF - offs_p.to(tl.int64))
    tl.store(keys_ptr + n * P + offs_p, key, mask=mask)


@triton.jit
def _expand_kernel(
    order_ptr,
    pos_ptr,
    out_ptr,
    take,
    width,
    out_w,
    KPOOL: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    pos = tl.load(pos_ptr + n)
    in_pools = j < take * KPOOL
    pool = tl.load(order_ptr + n * take + j // KPOOL, mask=in_pools, other=-1)
    ok = in_pools & ((pool + 1) * KPOOL - 1 <= pos)
    val = tl.where(ok, pool * KPOOL + j % KPOOL, -1)
    tj = j - width
    in_tail = (tj >= 0) & (tj < TAIL)
    tail = ((pos + 1) // KPOOL) * KPOOL + tj
    val = tl.where(in_tail, tl.where(tail <= pos, tail, -1), val)
    tl.store(out_ptr + n * out_w + j, val, mask=j < out_w)


@triton.jit
def _kpool_compress_kernel(
    keys_ptr,
    gates_ptr,
    ape_ptr,
    out_ptr,
    D,
    KPOOL: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (offs_k[:, None] < KPOOL) & (offs_d[None, :] < D)
    idx = offs_k[:, None] * D + offs_d[None, :]
    g = tl.load(gates_ptr + m * KPOOL * D + idx, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(ape_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    x = tl.where(offs_k[:, None] < KPOOL, g + a, float("-inf"))  # padded columns stay 0
    x = x - tl.max(x, axis=0)[None, :]
    e = tl.where(mask, tl.exp(x), 0.0)
    denom = tl.sum(e, axis=0)
    prob = e / tl.where(denom > 0.0, denom, 1.0)[None, :]  # padded columns: 0, not 0/0
    keys = tl.load(keys_ptr + m * KPOOL * D + idx, mask=mask, other=0.0)
    # the reference rounds prob and each product to the keys' dtype, then sums in fp32
    prod = (prob.to(keys.dtype).to(tl.float32) * keys.to(tl.float32)).to(keys.dtype)
    pooled = tl.sum(prod.to(tl.float32), axis=0)
    tl.store(out_ptr + m * D + offs_d, pooled.to(out_ptr.dtype.element_ty), mask=offs_d < D)


def score_pools_paged(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    index_keys: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    positions: torch.Tensor,
    kpool: int,
    max_pools: int,
    softmax_scale: float,
    out: torch.Tensor | None = None,
    query_block: int | None = None,
    block_p: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Scores [N, max_pools] float32 of every query's pools, read from the paged cache.

    out: optional destination. query_block (queries per program; those of one request row
    share the key gather), block_p and num_warps override the launch plan (tuning only).
    """
    n, heads, dim = q.shape
    if out is None:
        out = torch.empty(n, max_pools, device=q.device, dtype=torch.float32)
    assert out.shape == (n, max_pools) and out.stride(1) == 1
    if n == 0 or max_pools == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    head_weights = head_weights.contiguous()
    assert index_keys.stride(1) == 1 and req_to_token.stride(1) == 1
    req_rows = req_rows.to(torch.int64).contiguous()
    positions = positions.to(torch.int64).contiguous()
    block_h = max(16, triton.next_power_of_2(heads))
    block_d = max(16, triton.next_power_of_2(dim))
    if query_block is None:
        query_block = max(1, 128 // block_h) if n >= 1024 else 1
    if block_p is None:
        block_p = 64 if block_h * block_d >= 32 * 128 else 32
    if num_warps is None:
        num_warps = 8 if query_block * block_h >= 128 else 4
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(n, query_block), triton.cdiv(max_pools, block_p))
    _score_pools_kernel[grid](
        q,
        head_weights,
        index_keys,
        req_to_token,
        req_rows,
        positions,
        out,
        n,
        heads,
        dim,
        max_pools,
        req_to_token.shape[1],
        q.stride(0),
        q.stride(1),
        head_weights.stride(0),
        index_keys.stride(0),
        req_to_token.stride(0),
        out.stride(0),
        softmax_scale,
        KPOOL=kpool,
        QB=query_block,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_P=block_p,
        DOT_PREC=prec,
        num_warps=num_warps,
    )
    return out


def select_tokens(
    scores: torch.Tensor,
    positions: torch.Tensor,
    kpool: int,
    select_pools: int,
    select_tail: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """As kernels.indexer.select_tokens (same output, same tie rule), via unique-key top-k."""
    n, num_pools = scores.shape
    positions = positions.to(torch.int64).contiguous()
    take = min(select_pools, num_pools)
    width = select_pools * kpool
    tail = kpool - 1 if select_tail and kpool > 1 else 0
    out_w = width + tail
    if out is None:
        out = torch.empty(n, out_w, device=scores.device, dtype=torch.int64)
    assert out.shape == (n, out_w) and out.is_contiguous()
    if n == 0:
        return out
    if take > 0:
        if scores.stride(1) != 1:
            scores = scores.contiguous()
        keys = torch.empty(n, num_pools, device=scores.device, dtype=torch.int64)
        block_p = 256
        _topk_keys_kernel[(n, triton.cdiv(num_pools, block_p))](
            scores,
            positions,
            keys,
            num_pools,
            scores.stride(0),
            KPOOL=kpool,
            BLOCK_P=block_p,
            num_warps=4,
        )
        order = torch.topk(keys, take, dim=-1, largest=True, sorted=True).indices.contiguous()
    else:
        order = out  # unused: take == 0
    block = 256
    _expand_kernel[(n, triton.cdiv(out_w, block))](
        order,
        positions,
        out,
        take,
        width,
        out_w,
        KPOOL=kpool,
        TAIL=tail,
        BLOCK=block,
        num_warps=4,
    )
    return out


def index_select_paged(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    index_keys: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    positions: torch.Tensor,
    kpool: int,
    max_pools: int,
    softmax_scale: float,
    select_pools: int,
    select_tail: bool,
) -> torch.Tensor:
    """Selected token positions [N, select_pools*kpool (+ kpool-1)] int64, -1 = empty."""
    scores = score_pools_paged(
        q,
        head_weights,
        index_keys,
        req_to_token,
        req_rows,
        positions,
        kpool,
        max_pools,
        softmax_scale,
    )
    return select_tokens(scores, positions, kpool, select_pools, select_tail)


def kpool_compress(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """keys, gates: [M, kpool, D]; ape: [kpool, D]. Returns pooled keys [M, D] in keys' dtype."""
    m, kpool, dim = keys.shape
    out = torch.empty(m, dim, device=keys.device, dtype=keys.dtype)
    if m == 0:
        return out
    keys, gates, ape = keys.contiguous(), gates.contiguous(), ape.contiguous()
    block_d = min(128, triton.next_power_of_2(dim))
    _kpool_compress_kernel[(m, triton.cdiv(dim, block_d))](
        keys,
        gates,
        ape,
        out,
        dim,
        KPOOL=kpool,
        BLOCK_K=triton.next_power_of_2(kpool),
        BLOCK_D=block_d,
        num_warps=4,
    )
    return out

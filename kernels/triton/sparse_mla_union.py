"""Triton sparse MLA over the union of a tile of queries' selections (extend at few heads).

    sparse_mla_union(q, latent, mask, scale, req_to_token, query_rows, tiles, *, block_n=None,
                     num_warps=None, num_stages=None, page_size=1, skip_empty=False,
                     out=None) -> [N, H, R]
    selection_mask(positions, ctx_len) -> [N, ctx_len] uint8

Same signatures and semantics as kernels.sparse_mla_union's (tiles from its union_tiles with
block_queries(H, dtype) queries a tile; page_size is this kernel's own: below). The mask is a
zero fill and one scatter launch straight from the indexer's positions (H100, an 8k chunk at 8
heads: 0.121 ms against the torch twin's 0.283; the mask + union kernel 2.29 ms against 3.10
when the extend path made its positions slots and the mask came from the slots).

Design. One program per tile: QB = block_queries(H, dtype) consecutive queries of one
request, their QB x H (query, head) rows stacked into one [64, R] query tile (8 queries x 8 heads
at TP8; no head padding when H is a power of two). The program walks its request's positions
0..key_end in blocks of BLOCK_N, gathers each block's latent rows once for all its queries,
computes S = Q K^T on the tensor cores, masks each row with its query's mask bytes and keeps an
online softmax per row (fp32 m, l and the [64, R] accumulator), as kernels/triton/sparse_mla.py
does per query. Rows of queries past a short tile's end are masked throughout, never stored.
Every in-range row of a block is gathered, marked or not (the blocks of an 8k chunk without
prefix are nearly all marked by some query of a tile). skip_empty skips a block no query of the
tile marks (a branch per block: it pays only on selections that leave whole blocks unmarked).

Registers / shared memory (R = 512, bf16), as the gather kernel at BLOCK_H = 64: the fp32
accumulator 64 x 512 (128 registers a thread over 8 warps), the query tile 64 KiB and the key
block 64 KiB in shared memory; 2 stages. fp32 inputs (tests) use 32-row tiles (block_queries of
the dtype), BLOCK_N = 16, 1 stage and IEEE dots; bf16 inputs use bf16 dots with fp32
accumulation and round P to bf16 before P @ V, like the reference.

Pipelining (Triton 3.6's sm_90a TTGIR, scratch-compiled on a CPU): at the default the latent
loads are asynchronous copies one block ahead, but each waits for its block's slot load, so a
block's gather and its dots do not overlap (from 3 stages the slot loads are asynchronous too).
Where the cache's pages hold whole key blocks (page_size a multiple of BLOCK_N: serving's 64)
a block's latent rows are addressed from its first slot, carried from the block before, so the
latent load needs no load of its own iteration: from 3 stages one copy stays in flight during
the dots (BLOCK_N 32: 164 KB of shared memory; 64 would need 257 KB). H100, an 8k chunk at 8
heads (bench.kernels_dsa --sweep): BLOCK_N 64, 2 stages 2.018 ms with whole pages against 2.202
gathered; 32 / 3 stages 2.761 against 2.858; so the default stays 64 / 2. 255 registers and a
24-byte stack frame at the default (16 with whole pages); skip_empty's frame is 704 bytes
(bf16). Why the loop is as it is: masking the gather to the columns some query marks holds a
per-column predicate through the dots (~1.2 KB of spills).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.sparse_mla_union import block_queries
from kernels.triton import INTERPRETER
from kernels.triton.online_softmax import online_softmax_update

_LOG2E = 1.4426950408889634


@triton.jit
def _key_block(
    q, kv_ptr, slot, stride_kv, offs_r, r_mask, in_range, marked, m_i, l_i, acc, qk_scale_log2,
    DOT_PREC: tl.constexpr,
):  # fmt: skip
    """One key block: gather its latent rows (at `slot`, every position of the request's context
    in it) once, fold them into every row's online softmax; rows that mark none of them keep
    their state."""
    kv = tl.load(
        kv_ptr + slot[:, None] * stride_kv + offs_r[None, :],
        mask=in_range[:, None] & r_mask[None, :],
        other=0.0,
    )
    s = tl.dot(q, tl.trans(kv), input_precision=DOT_PREC) * qk_scale_log2
    s = tl.where(marked, s, float("-inf"))
    return online_softmax_update(s, kv, m_i, l_i, acc, DOT_PREC)


@triton.jit
def _union_kernel(
    q_ptr,
    kv_ptr,
    mask_ptr,
    r2t_ptr,
    rows_ptr,
    tiles_ptr,
    out_ptr,
    H,
    stride_qn,
    stride_qh,
    stride_kv,
    stride_mn,
    stride_r2t,
    stride_on,
    stride_oh,
    qk_scale_log2,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HP: tl.constexpr,
    QB: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SKIP_EMPTY: tl.constexpr,
    DOT_PREC: tl.constexpr,
    CONTIG: tl.constexpr,
):
    t = tl.program_id(0)
    first = tl.load(tiles_ptr + t * 3)
    end = tl.load(tiles_ptr + t * 3 + 1)
    key_end = tl.load(tiles_ptr + t * 3 + 2)
    row = tl.load(rows_ptr + first)

    offs_m = tl.arange(0, QB * HP)
    qi = first + offs_m // HP
    hh = offs_m % HP
    m_ok = (qi < end) & (hh < H)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    q = tl.load(
        q_ptr + qi[:, None] * stride_qn + hh[:, None] * stride_qh + offs_r[None, :],
        mask=m_ok[:, None] & r_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([QB * HP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([QB * HP], dtype=tl.float32)
    acc = tl.zeros([QB * HP, BLOCK_R], dtype=tl.float32)
    q_ids = first + tl.arange(0, QB)
    r2t_row = r2t_ptr + row * stride_r2t
    if CONTIG:
        base = tl.load(r2t_row)  # the first key block's first slot
    for kb in range(0, key_end, BLOCK_N):
        offs_n = kb + tl.arange(0, BLOCK_N)
        in_range = offs_n < key_end
        if CONTIG:  # the block's positions lie in one page: consecutive slots from its first
            slot = base + tl.arange(0, BLOCK_N)
            # the next block's first slot, carried: the latent load's address needs no load of
            # its iteration, so the pipeliner issues it stages ahead
            base = tl.load(r2t_row + tl.minimum(kb + BLOCK_N, key_end - 1))
        else:
            slot = tl.load(r2t_row + offs_n, mask=in_range, other=0)
        # one mask row per query (not per head: fewer 64-bit pointers held), spread to its rows
        marked_q = tl.load(
            mask_ptr + q_ids[:, None] * stride_mn + offs_n[None, :],
            mask=(q_ids < end)[:, None] & in_range[None, :],
            other=0,
        ).to(tl.int32)
        marked = tl.reshape(
            tl.broadcast_to(marked_q[:, None, :], (QB, HP, BLOCK_N)), (QB * HP, BLOCK_N)
        )
        marked = marked != 0
        if SKIP_EMPTY:
            if tl.max(tl.max(marked_q, axis=1), axis=0) > 0:
                m_i, l_i, acc = _key_block(
                    q, kv_ptr, slot, stride_kv, offs_r, r_mask, in_range, marked, m_i, l_i, acc,
                    qk_scale_log2, DOT_PREC,
                )  # fmt: skip
        else:
            m_i, l_i, acc = _key_block(
                q, kv_ptr, slot, stride_kv, offs_r, r_mask, in_range, marked, m_i, l_i, acc,
                qk_scale_log2, DOT_PREC,
            )  # fmt: skip

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + qi[:, None] * stride_on + hh[:, None] * stride_oh + offs_r[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & r_mask[None, :],
    )


@triton.jit
def _mark_kernel(pos_ptr, mask_ptr, W, stride_p, stride_m, BLOCK: tl.constexpr):
    """mask[n, positions[n, j]] = 1 for the program's block of row n's entries (-1: none).
    Every store is a 1, so duplicates and the programs' order do not matter."""
    n = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    p = tl.load(pos_ptr + n * stride_p + j, mask=j < W, other=-1)
    tl.store(mask_ptr + n * stride_m + p, tl.full([BLOCK], 1, tl.uint8), mask=p >= 0)


MARK_BLOCK = 1024


def selection_mask(positions: torch.Tensor, ctx_len: int) -> torch.Tensor:
    """As kernels.sparse_mla_union.selection_mask: positions [N, W] (-1 = empty, every other
    entry below ctx_len) -> mask [N, ctx_len] uint8."""
    n, width = positions.shape
    mask = torch.zeros(n, ctx_len, dtype=torch.uint8, device=positions.device)
    if n and width:
        if positions.stride(1) != 1:
            positions = positions.contiguous()
        _mark_kernel[(n, triton.cdiv(width, MARK_BLOCK))](
            positions, mask, width, positions.stride(0), mask.stride(0), BLOCK=MARK_BLOCK
        )
    return mask


def sparse_mla_union(
    q: torch.Tensor,
    latent: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    req_to_token: torch.Tensor,
    query_rows: torch.Tensor,
    tiles: torch.Tensor,
    *,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    page_size: int = 1,
    skip_empty: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """As kernels.sparse_mla_union.sparse_mla_union; tiles must hold at most
    block_queries(H, q.dtype) queries each. page_size: every page_size-aligned run of a
    request's positions sits in consecutive cache slots (serving's pages; 1: no guarantee).
    Where it is a multiple of the key block, each block's latent rows are addressed from one
    slot carried from the block before, not gathered through a slot load of its own (H100, an
    8k chunk at 8 heads: 2.018 against 2.203 ms at the default launch; from 3 stages Triton
    then keeps a latent copy in flight during a block's dots). Hazard: a wrong page_size reads
    other requests' latents. The other keywords override the launch (tests and tuning only)."""
    n, heads, rank = q.shape
    assert latent.shape[1] == rank and latent.stride(1) == 1 and mask.stride(1) == 1
    assert req_to_token.stride(1) == 1
    if q.stride(2) != 1:
        q = q.contiguous()
    tiles = tiles.to(torch.int64).contiguous()
    query_rows = query_rows.to(torch.int64).contiguous()
    if out is None:
        out = torch.empty(n, heads, rank, device=q.device, dtype=q.dtype)
    assert out.shape == q.shape and out.stride(2) == 1
    if n == 0 or tiles.shape[0] == 0:
        return out
    fp32 = q.dtype == torch.float32
    hp = triton.next_power_of_2(heads)
    qb = block_queries(heads, q.dtype)
    # ptxas -v, sm_90a, 8 warps: fp32 spills nothing at 1 stage and ~0.4 KB at 2
    stages = {} if INTERPRETER else {"num_stages": num_stages or (1 if fp32 else 2)}
    block_n = block_n or (16 if fp32 else 64)
    _union_kernel[(tiles.shape[0],)](
        q,
        latent,
        mask,
        req_to_token,
        query_rows,
        tiles,
        out,
        heads,
        q.stride(0),
        q.stride(1),
        latent.stride(0),
        mask.stride(0),
        req_to_token.stride(0),
        out.stride(0),
        out.stride(1),
        scale * _LOG2E,
        R=rank,
        BLOCK_R=triton.next_power_of_2(rank),
        HP=hp,
        QB=qb,
        BLOCK_N=block_n,
        SKIP_EMPTY=skip_empty,
        CONTIG=page_size % block_n == 0,
        DOT_PREC="ieee" if fp32 else "tf32",
        num_warps=num_warps or (8 if qb * hp * rank >= 16 * 512 else 4),
        **stages,
    )
    return out

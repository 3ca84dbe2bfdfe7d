"""Triton sparse MLA attention (absorbed / MQA form) over selected slots of the paged latent cache.

    sparse_mla_attention(q, latent, slots, scale, *, num_splits=None, block_h=None,
                         block_w=None, num_warps=None, num_stages=None, out=None)
        -> out [N, H, R] in q.dtype

Same semantics as kernels.sparse_mla.sparse_mla_attention: q [N, H, R] absorbed queries,
latent [S, R] cache rows, slots [N, W] int64 cache slots (-1 = empty; every row has at least one
valid slot), out[n, h] = sum_w softmax_w(scale * q[n,h] . c_w) * c_w with c_w = latent[slots[n,w]].

Design. One program per (query, block of BLOCK_H heads, split of W). Each program walks its
slots BLOCK_W at a time, gathers those latent rows straight from the cache (one contiguous row of
R values per slot, so the loads coalesce; empty slots are masked and read nothing), computes
S = Q K^T on the tensor cores, and keeps an online softmax in fp32 (running max m, sum l and the
[BLOCK_H, R] accumulator). The gathered tile is used twice (scores and P @ V), so no [N, W, R]
tensor ever exists in HBM.

Decode (N = batch, or batch * (draft+1) under EAGLE verify) has too few (query, head-block)
programs to fill 132 SMs, so W is split (flash-decoding): each split writes a normalised partial
output and its log-sum-exp (fp32), and a second kernel merges the splits. Extend (many queries)
runs one split per program and writes the output directly. Splits are chosen from shapes only
(no host sync), so the decode path is CUDA-graph capturable.

Registers / shared memory (R = kv_lora_rank = 512, bf16). Default BLOCK_H = 64 (all heads of
the real model in one program, so each gathered row is read from HBM once), BLOCK_W = 64,
8 warps, 3 stages. The fp32 accumulator is 64 x 512 x 4 B = 128 KiB, i.e. 128 registers per
thread over 256 threads; the query tile (64 KiB bf16) and the gathered tiles (64 rows x 1 KiB =
64 KiB per stage) live in shared memory. BLOCK_H = 32 (64 accumulator registers, two head blocks
whose second gather hits L2) compiles too, but on the H200 sweep (bench/kernels_dsa.py --sweep)
the 64-head block was faster for decode and extend alike, so it is the default. R is not
tiled: both dots need the whole row, and re-gathering a row per R tile would multiply the gather
traffic. fp32 inputs (tests, tiny model) use BLOCK_H <= 32,
BLOCK_W = 16, 2 stages and IEEE dots; bf16 inputs use bf16 tensor-core dots with fp32
accumulation, and P is rounded to bf16 before P @ V like the reference's softmax(...).to(dtype).

Measured on one H200 (torch 2.11, triton 3.6; H = 64, R = 512, W = 2063), graph replay:
decode batch 1 20 us, batch 32 64 us (1.1 TB/s of gathered latents, 26% of copy bandwidth),
batch 128 190 us (1.5 TB/s, 36%); extend, 8,192 queries, 10.9 ms (180-200 TFLOP/s counted on
valid slots). With 64 heads the decode kernel does ~128 FLOP per gathered byte, close to the
H200's ridge, so it is bound by the mma.sync tensor-core rate Triton reaches here, not by HBM;
closing the gap to 70% of bandwidth needs a wgmma / warp-specialised kernel (FlashMLA-style).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.triton import INTERPRETER
from kernels.triton.online_softmax import online_softmax_update

_LOG2E = 1.4426950408889634
_MIN_SPLIT_LEN = 128  # slots per split at least: below that the partial writes dominate


@triton.jit
def _sparse_mla_kernel(
    q_ptr,
    kv_ptr,
    slots_ptr,
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    H,
    W,
    num_splits,
    stride_qn,
    stride_qh,
    stride_kv,
    stride_sn,
    stride_on,
    stride_oh,
    qk_scale_log2,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_W: tl.constexpr,
    NUM_ITERS: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_hb = tl.cdiv(H, BLOCK_H)
    n = pid // num_hb
    hb = pid % num_hb

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    h_mask = offs_h < H
    r_mask = offs_r < R
    n64 = n.to(tl.int64)
    q = tl.load(
        q_ptr + n64 * stride_qn + offs_h[:, None] * stride_qh + offs_r[None, :],
        mask=h_mask[:, None] & r_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)

    w_start = split * (NUM_ITERS * BLOCK_W)
    # constexpr trip count: a handful of values per model (W is fixed, splits follow N)
    for it in range(NUM_ITERS):
        offs_w = w_start + it * BLOCK_W + tl.arange(0, BLOCK_W)
        slot = tl.load(slots_ptr + n64 * stride_sn + offs_w, mask=offs_w < W, other=-1)
        valid = slot >= 0
        kv = tl.load(
            kv_ptr + slot[:, None] * stride_kv + offs_r[None, :],
            mask=valid[:, None] & r_mask[None, :],
            other=0.0,
        )
        s = tl.dot(q, tl.trans(kv), input_precision=DOT_PREC) * qk_scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_update(s, kv, m_i, l_i, acc, DOT_PREC)

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if SPLIT:
        # partial layout [N, H, splits, R] fp32 and lse [N, H, splits] (log2 domain)
        row = (n64 * H + offs_h) * num_splits + split
        tl.store(
            part_o_ptr + row[:, None] * R + offs_r[None, :],
            o,
            mask=h_mask[:, None] & r_mask[None, :],
        )
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=h_mask)
    else:
        tl.store(
            out_ptr + n64 * stride_on + offs_h[:, None] * stride_oh + offs_r[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=h_mask[:, None] & r_mask[None, :],
        )


@triton.jit
def _combine_kernel(
    part_o_ptr,
    part_lse_ptr,
    out_ptr,
    H,
    stride_on,
    stride_oh,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    pid = tl.program_id(0)  # one program per (query, head)
    n = pid // H
    h = pid % H
    base = pid.to(tl.int64) * NUM_SPLITS
    offs_s = tl.arange(0, BLOCK_S)
    lse = tl.load(part_lse_ptr + base + offs_s, mask=offs_s < NUM_SPLITS, other=float("-inf"))
    m = tl.max(lse, axis=0)  # finite: every row has a valid slot
    wts = tl.exp2(lse - m)
    wts = wts / tl.sum(wts, axis=0)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for s in range(NUM_SPLITS):
        w_s = tl.sum(tl.where(offs_s == s, wts, 0.0), axis=0)
        part = tl.load(part_o_ptr + (base + s) * R + offs_r, mask=r_mask, other=0.0)
        acc += w_s * part
    tl.store(
        out_ptr + n.to(tl.int64) * stride_on + h * stride_oh + offs_r,
        acc.to(out_ptr.dtype.element_ty),
        mask=r_mask,
    )


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: any small number exercises the split path


class Plan(NamedTuple):
    block_h: int
    block_w: int
    num_splits: int
    split_len: int
    num_warps: int
    num_stages: int


def plan(
    n: int,
    heads: int,
    width: int,
    rank: int,
    dtype: torch.dtype,
    device: torch.device,
    num_splits: int | None = None,
    block_h: int | None = None,
    block_w: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> Plan:
    """The launch plan for a problem, from shapes only (no host sync); None = default."""
    wide = dtype == torch.float32 or rank > 512
    if block_h is None:
        # bf16, R = 512: all 64 heads in one block read each gathered row once (measured best
        # on H200 for decode and extend); fp32 halves it to stay inside shared memory.
        block_h = 32 if wide and rank >= 256 else 64
        block_h = max(16, min(block_h, triton.next_power_of_2(heads)))
    num_hb = triton.cdiv(heads, block_h)
    programs = n * num_hb
    sms = _num_sms(device)
    if block_w is None:
        block_w = 16 if wide else 64
        if rank <= 64:
            block_w = 32
    if num_splits is None:
        # about one wave of programs (H200 sweep: batch 32 -> 4 splits, batch 1 -> 16..32)
        if programs >= sms:
            num_splits = 1
        else:
            num_splits = min(max(1, sms // programs), triton.cdiv(width, _MIN_SPLIT_LEN))
    num_splits = max(1, min(num_splits, triton.cdiv(width, block_w)))
    split_len = triton.cdiv(triton.cdiv(width, num_splits), block_w) * block_w
    num_splits = triton.cdiv(width, split_len)
    if num_warps is None:
        num_warps = 8 if block_h * triton.next_power_of_2(rank) >= 16 * 512 else 4
    if num_stages is None:
        num_stages = 2 if wide else 3
    return Plan(block_h, block_w, num_splits, split_len, num_warps, num_stages)


def sparse_mla_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    block_h: int | None = None,
    block_w: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [N, H, R]; latent: [S, R]; slots: [N, W] int64 (-1 = none). Returns [N, H, R] q.dtype.

    out: optional [N, H, R] destination (last dim contiguous). num_splits, block_h, block_w,
    num_warps and num_stages override the launch plan (tests and tuning only).
    """
    n, heads, rank = q.shape
    width = slots.shape[1]
    assert latent.shape[1] == rank and latent.stride(1) == 1
    if q.stride(2) != 1:
        q = q.contiguous()
    if slots.stride(1) != 1 or slots.dtype != torch.int64:
        slots = slots.to(torch.int64).contiguous()
    if out is None:
        out = torch.empty(n, heads, rank, device=q.device, dtype=q.dtype)
    assert out.shape == q.shape and out.stride(2) == 1
    if n == 0:
        return out
    pl = plan(
        n,
        heads,
        width,
        rank,
        q.dtype,
        q.device,
        num_splits,
        block_h,
        block_w,
        num_warps,
        num_stages,
    )
    splits = pl.num_splits
    num_hb = triton.cdiv(heads, pl.block_h)
    block_r = triton.next_power_of_2(rank)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    stages = {} if INTERPRETER else {"num_stages": pl.num_stages}
    if splits > 1:
        part_o = torch.empty(n, heads, splits, rank, device=q.device, dtype=torch.float32)
        part_lse = torch.empty(n, heads, splits, device=q.device, dtype=torch.float32)
    else:
        part_o = part_lse = out  # unused
    _sparse_mla_kernel[(n * num_hb, splits)](
        q,
        latent,
        slots,
        out,
        part_o,
        part_lse,
        heads,
        width,
        splits,
        q.stride(0),
        q.stride(1),
        latent.stride(0),
        slots.stride(0),
        out.stride(0),
        out.stride(1),
        scale * _LOG2E,
        R=rank,
        BLOCK_R=block_r,
        BLOCK_H=pl.block_h,
        BLOCK_W=pl.block_w,
        NUM_ITERS=pl.split_len // pl.block_w,
        SPLIT=splits > 1,
        DOT_PREC=prec,
        num_warps=pl.num_warps,
        **stages,
    )
    if splits > 1:
        _combine_kernel[(n * heads,)](
            part_o,
            part_lse,
            out,
            heads,
            out.stride(0),
            out.stride(1),
            R=rank,
            BLOCK_R=block_r,
            NUM_SPLITS=splits,
            BLOCK_S=triton.next_power_of_2(splits),
            num_warps=4,
        )
    return out

"""KDA on CUDA: fla-core's KDA kernels and a Triton causal conv, with kernels.kda's signatures.

Conventions (checked against kernels.kda, the torch oracle):
- g: our g is already the per-channel log-decay (serving/models/kda.py computes
  lower_bound * sigmoid(exp(A_log) * (f + dt_bias)) or -exp(A_log) * softplus(f + dt_bias)),
  so it goes to fla as `g` with use_gate_in_kernel=False (fla then uses it as is).
- beta: ours is post-sigmoid; fla's use_beta_sigmoid_in_kernel=False takes it as is.
- l2norm: ours is x / sqrt(sum(x^2) + 1e-6) on q and k; fla's use_qk_l2norm_in_kernel=True
  does exactly that (eps 1e-6 inside the sqrt, both in chunk's l2norm_fwd and in the fused
  recurrent kernel). q is scaled after the norm by `scale`, which we pass as Dk ** -0.5.
  The chunked path normalizes with our own kernel (_l2norm, the same arithmetic) and passes
  use_qk_l2norm_in_kernel=False: fla's l2norm_fwd is autotuned (25 configs) per bucket of
  T*H / 65536, so every new prefill size class (and each snapshot pass's) tuned anew under
  a user's request, about 10 s on an H200 (the prefix cache's first H200 run in
  docs/notebook/2026-11-29_2026-12-03.md).
- state: ours [rows, H, Dk, Dv] float32, decay along Dk, update state += k (x) delta: fla's
  default K-first layout [N, HV, K, V] (state_v_first=False), float32.

fla is imported inside the functions, so importing this module never needs fla (CPU
machines). The causal conv is our own Triton kernel: fla's causal_conv1d keeps a [N, D, W]
cache of the last W inputs, ours is [R, C, K-1].
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from itertools import accumulate
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.fp8 import BLOCK as FP8_BLOCK
from kernels.kda import ForgetGate, KDAWeights, forget_gate
from kernels.triton.e4m3 import quant_rows
from kernels.triton.pdl import LAUNCH, grid_dependency

# Every ragged extend runs the conv with this many tokens per program, whatever its lengths: a
# block size picked from the batch (a short last segment of a snapshot pass, a short prompt)
# would be one more compiled variant, met first under a user's request.
EXTEND_BLOCK_T = 32

# ---------------------------------------------------------------------------------------------
# causal conv
# ---------------------------------------------------------------------------------------------


@triton.jit
def _conv_taps(
    x_ptr, stride_x, w_ptr, state_ptr, row, start, t, c, t_mask, c_mask, stride_sr, stride_sc,
    C: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    WITH_STATE: tl.constexpr,
):  # fmt: skip
    """sum_j w[c, j] * input[t + j - (K-1), c] in float32, j in order; an input position < 0
    reads the old state (WITH_STATE; without it, those taps are zeros: the caller masks the
    rows that need them)."""
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):
        w = tl.load(w_ptr + c * K + j, mask=c_mask, other=0.0).to(tl.float32)
        p = t + j - (K - 1)  # input position inside the request; < 0 reads the old state
        tap = tl.load(
            x_ptr + (start + p)[:, None].to(tl.int64) * stride_x + c[None, :],
            mask=(t_mask & (p >= 0))[:, None] & c_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        if WITH_STATE:  # exactly one of the two is nonzero: the sum is the tap itself
            tap += tl.load(
                state_ptr + row * stride_sr + c[None, :] * stride_sc + (p + K - 1)[:, None],
                mask=(t_mask & (p < 0))[:, None] & c_mask[None, :],
                other=0.0,
            ).to(tl.float32)
        acc += tap * w[None, :]
    return acc


@triton.jit(do_not_specialize=["total"])
def _conv_kernel(
    x_ptr,  # [T, C] inputs of all requests back to back, rows X_ALIGN * stride_x_units apart
    stride_x_units,
    w_ptr,  # [C, K] float32
    state_ptr,  # [R, C, K-1] conv state (read only here)
    rows_ptr,  # [B] state row of each request
    cu_ptr,  # [B+1] token offsets
    out_ptr,  # [T, C], or with SPLIT_QKV [3, T, C/3]
    stride_sr,
    stride_sc,
    total,  # T
    C: tl.constexpr,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SPLIT_QKV: tl.constexpr,  # BLOCK_C is one head: each third apart, q's and k's l2-normed
    X_ALIGN: tl.constexpr,  # the row stride's power-of-two factor (<= 8): 16-byte bf16 loads
    KP: tl.constexpr,  # next_power_of_2(K - 1): the rows of a request's first tile
):
    b = tl.program_id(0)
    pid_t = tl.program_id(1)
    pid_c = tl.program_id(2)
    start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - start
    if pid_t * BLOCK_T >= n:
        return
    row = tl.load(rows_ptr + b).to(tl.int64)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    t_mask = t < n
    c_mask = c < C
    # the stride as a multiple of X_ALIGN, so the compiler knows each row's alignment (an odd
    # multiple of 8, e.g. the stacked KDA projection's 3,336 columns, is not specialized)
    stride_x = stride_x_units * X_ALIGN
    if pid_t * BLOCK_T < K - 1:
        # a request's first K-1 tokens read the old state too: a tile of their own, so the
        # state's loads (strided, 2 bytes each) and their registers stay out of the main tile
        ts = tl.arange(0, KP)
        ts_mask = (
            (ts < K - 1) & (ts < n) & (ts >= pid_t * BLOCK_T) & (ts < pid_t * BLOCK_T + BLOCK_T)
        )
        acc = _conv_taps(
            x_ptr, stride_x, w_ptr, state_ptr, row, start, ts, c, ts_mask, c_mask, stride_sr,
            stride_sc, C, K, KP, BLOCK_C, True,
        )  # fmt: skip
        _conv_store(
            acc, ts, ts_mask, c, c_mask, start, pid_c, total, out_ptr, C, BLOCK_C, SPLIT_QKV
        )
        t_mask = t_mask & (t >= K - 1)
    acc = _conv_taps(
        x_ptr, stride_x, w_ptr, state_ptr, row, start, t, c, t_mask, c_mask, stride_sr,
        stride_sc, C, K, BLOCK_T, BLOCK_C, False,
    )  # fmt: skip
    _conv_store(acc, t, t_mask, c, c_mask, start, pid_c, total, out_ptr, C, BLOCK_C, SPLIT_QKV)


@triton.jit
def _conv_store(
    acc, t, t_mask, c, c_mask, start, pid_c, total, out_ptr, C: tl.constexpr,
    BLOCK_C: tl.constexpr, SPLIT_QKV: tl.constexpr,
):  # fmt: skip
    """SiLU of the taps' sum, then (SPLIT_QKV) q's and k's rows l2-normed, stored."""
    out = acc * tl.sigmoid(acc)
    if SPLIT_QKV:
        width = C // 3
        third = (pid_c * BLOCK_C) // width
        # rounded as the unfused conv's output, then normed as _l2norm norms it
        out = out.to(out_ptr.dtype.element_ty).to(tl.float32)
        if third < 2:
            out = out * (1 / tl.sqrt(tl.sum(out * out, 1) + 1e-6))[:, None]
        dst = out_ptr + (third.to(tl.int64) * total + start + t)[:, None] * width
        dst += (c - third * width)[None, :]
    else:
        dst = out_ptr + (start + t)[:, None].to(tl.int64) * C + c[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & c_mask[None, :])


@triton.jit
def _conv_state_kernel(
    x_ptr,
    stride_x,
    state_ptr,
    rows_ptr,
    cu_ptr,
    stride_sr,
    stride_sc,
    C: tl.constexpr,
    KM1: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """conv_state[rows[b]] <- last K-1 of (old state ++ request b's inputs)."""
    b = tl.program_id(0)
    pid_c = tl.program_id(1)
    start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - start
    row = tl.load(rows_ptr + b).to(tl.int64)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    i = tl.arange(0, BLOCK_K)
    c_mask = c < C
    i_mask = i < KM1
    p = n - KM1 + i  # input position of new state slot i; < 0 keeps an old state slot
    from_x = tl.load(
        x_ptr + (start + p)[None, :].to(tl.int64) * stride_x + c[:, None],
        mask=c_mask[:, None] & (i_mask & (p >= 0))[None, :],
        other=0.0,
    )
    base = state_ptr + row * stride_sr + c[:, None] * stride_sc
    from_s = tl.load(
        base + (p + KM1)[None, :], mask=c_mask[:, None] & (i_mask & (p < 0))[None, :], other=0.0
    )
    new = tl.where((p >= 0)[None, :], from_x.to(tl.float32), from_s.to(tl.float32))
    tl.debug_barrier()  # every old slot is read before any is overwritten
    tl.store(
        base + i[None, :],
        new.to(state_ptr.dtype.element_ty),
        mask=c_mask[:, None] & i_mask[None, :],
    )


def _conv_run(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    rows: torch.Tensor,
    cu: torch.Tensor,
    num_reqs: int,
    max_len: int,
    block_t: int,
    heads: int | None = None,
) -> torch.Tensor:
    """block_t: tokens per program, a constexpr: each value is its own compiled kernel. x may
    be a view with a row stride of its own (q | k | v as columns of the stacked projection's
    output): only its last dim must be contiguous. heads: x is q | k | v of this many heads
    each; the result is [3, T, heads, D] (conv_qkv_extend's)."""
    chans, kernel = weight.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    assert conv_state.stride(2) == 1, "conv_state's last dim must be contiguous"
    if heads is None:
        out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
        block_c = min(128, triton.next_power_of_2(chans))
    else:
        block_c = chans // 3 // heads  # one program's channels: one head
        assert block_c * 3 * heads == chans and block_c == triton.next_power_of_2(block_c)
        out = torch.empty(3, x.shape[0], heads, block_c, device=x.device, dtype=x.dtype)
    grid = (num_reqs, triton.cdiv(max_len, block_t), triton.cdiv(chans, block_c))
    x_align = math.gcd(x.stride(0), 8)
    _conv_kernel[grid](
        x,
        x.stride(0) // x_align,
        weight,
        conv_state,
        rows,
        cu,
        out,
        conv_state.stride(0),
        conv_state.stride(1),
        x.shape[0],
        C=chans,
        K=kernel,
        BLOCK_T=block_t,
        BLOCK_C=block_c,
        SPLIT_QKV=heads is not None,
        X_ALIGN=x_align,
        KP=triton.next_power_of_2(max(1, kernel - 1)),
        num_warps=4,
    )
    if kernel > 1:
        _conv_state_kernel[(num_reqs, triton.cdiv(chans, block_c))](
            x,
            x.stride(0),
            conv_state,
            rows,
            cu,
            conv_state.stride(0),
            conv_state.stride(1),
            C=chans,
            KM1=kernel - 1,
            BLOCK_K=triton.next_power_of_2(kernel - 1),
            BLOCK_C=block_c,
            num_warps=4,
        )
    return out


def _uniform_cu(num_reqs: int, step_len: int, device) -> torch.Tensor:
    return torch.arange(num_reqs + 1, device=device, dtype=torch.int64) * step_len


def _conv_history(x, weight, conv_state, rows, lens: list[int]) -> torch.Tensor:
    """[B, C, K-1+max_len] = old state ++ inputs (zero padded), as kernels.kda builds it."""
    kernel = weight.shape[-1]
    num_reqs, max_len, chans = len(lens), max(lens), x.shape[-1]
    seq = x.new_zeros(num_reqs, chans, kernel - 1 + max_len, dtype=weight.dtype)
    seq[:, :, : kernel - 1] = conv_state[rows].to(weight.dtype)
    if all(n == max_len for n in lens):
        seq[:, :, kernel - 1 :] = x.view(num_reqs, max_len, chans).transpose(1, 2)
        return seq
    offset = 0
    for b, n in enumerate(lens):
        seq[b, :, kernel - 1 : kernel - 1 + n] = x[offset : offset + n].T.to(weight.dtype)
        offset += n
    return seq


# ---------------------------------------------------------------------------------------------
# ragged-batch metadata
# ---------------------------------------------------------------------------------------------

FLA_CHUNK = 64  # fla's chunked KDA: tokens per chunk (chunk_kda's default)
_VARLEN_CACHE = 16  # batch shapes kept (each a few hundred bytes on the device)


class Varlen(NamedTuple):
    """A ragged batch's offsets for the kernels: cu [B+1] and fla's chunk_indices [NT, 2]
    ((sequence, chunk within it) of each FLA_CHUNK-token chunk) on the device, cu_cpu on the
    host. Read only: shared by every KDA layer (and later steps) of the same lengths."""

    cu: torch.Tensor
    cu_cpu: torch.Tensor
    chunk_indices: torch.Tensor


_varlens: OrderedDict[tuple, Varlen] = OrderedDict()


def varlen(lens: list[int], device: torch.device) -> Varlen:
    """The metadata of a batch with these lengths, built on the host and copied once, through
    pinned memory, without waiting for the device: fla's own prepare_chunk_indices builds it on
    the host too but copies it with a blocking .to() (a stream sync, once per layer)."""
    key = (device, tuple(lens))
    hit = _varlens.get(key)
    if hit is not None:
        _varlens.move_to_end(key)
        return hit
    cu = [0, *accumulate(lens)]
    chunks = [v for b, n in enumerate(lens) for i in range(-(-n // FLA_CHUNK)) for v in (b, i)]
    pinned = torch.device(device).type == "cuda"  # the CPU (Triton's interpreter) has no pinning
    host = torch.tensor(cu + chunks, dtype=torch.int64, pin_memory=pinned)
    packed = host.to(device, non_blocking=True)
    meta = Varlen(packed[: len(cu)], host[: len(cu)].clone(), packed[len(cu) :].view(-1, 2))
    _varlens[key] = meta
    if len(_varlens) > _VARLEN_CACHE:
        _varlens.popitem(last=False)
    return meta


def causal_conv_extend(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    rows: torch.Tensor,
    lens: list[int],
    history: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Depthwise causal conv + SiLU over a ragged batch, continuing from `conv_state[rows]`.

    Same contract as kernels.kda.causal_conv_extend (x [T, C]; weight [C, K]; conv_state
    [R, C, K-1] updated in place; history receives [B, C, K-1+max_len]).
    """
    if history is not None:
        history.append(_conv_history(x, weight, conv_state, rows, lens))
    cu = varlen(lens, x.device).cu
    return _conv_run(x, weight, conv_state, rows, cu, len(lens), max(lens), EXTEND_BLOCK_T)


def conv_qkv_extend(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    rows: torch.Tensor,
    lens: list[int],
    heads: int,
    history: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """kernels.kda.conv_qkv_extend in one kernel (and the conv state's): each program one head
    of q, k or v, written to its third of [3, T, H, D], q's and k's rows l2-normed (so neither
    an l2norm pass nor a copy of v runs before fla's chunk kernel)."""
    if history is not None:
        history.append(_conv_history(x, weight, conv_state, rows, lens))
    cu = varlen(lens, x.device).cu
    return _conv_run(x, weight, conv_state, rows, cu, len(lens), max(lens), EXTEND_BLOCK_T, heads)


def causal_conv_uniform(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    rows: torch.Tensor,
    step_len: int,
    history: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """causal_conv_extend for a batch where every request adds step_len tokens. Graph-safe."""
    num_reqs = x.shape[0] // step_len
    if history is not None:
        history.append(_conv_history(x, weight, conv_state, rows, [step_len] * num_reqs))
    cu = _uniform_cu(num_reqs, step_len, x.device)
    block_t = min(EXTEND_BLOCK_T, triton.next_power_of_2(step_len))
    return _conv_run(x, weight, conv_state, rows, cu, num_reqs, step_len, block_t)


def causal_conv_decode(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """One token per request. x: [B, C]; conv_state[rows] shifts by one. Graph-safe."""
    cu = _uniform_cu(x.shape[0], 1, x.device)
    return _conv_run(x, weight, conv_state, rows, cu, x.shape[0], 1, 1)


# ---------------------------------------------------------------------------------------------
# KDA recurrence through fla-core
# ---------------------------------------------------------------------------------------------

L2NORM_ROWS = 16  # rows per program of _l2norm: fixed, so it is one compiled kernel per D


@triton.jit(do_not_specialize=["rows"])
def _l2norm_kernel(
    x_ptr, y_ptr, rows, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    mask = (r < rows)[:, None] & (d < D)[None, :]
    offs = r[:, None].to(tl.int64) * D + d[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1 / tl.sqrt(tl.sum(x * x, 1) + 1e-6)
    tl.store(y_ptr + offs, (x * rstd[:, None]).to(y_ptr.dtype.element_ty), mask=mask)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dim, computed in float32, in x's dtype: fla's
    l2norm_fwd's arithmetic without its size-keyed autotuning."""
    x = x.contiguous()
    dim = x.shape[-1]
    y = torch.empty_like(x)
    rows = x.numel() // dim
    if rows:
        _l2norm_kernel[(triton.cdiv(rows, L2NORM_ROWS),)](
            x, y, rows, D=dim, BLOCK_R=L2NORM_ROWS, BLOCK_D=triton.next_power_of_2(dim),
            num_warps=4,
        )  # fmt: skip
    return y


GATED_NORM_ROWS = 16  # (token, head) rows per program of _gated_norm_kernel: one variant per D


@triton.jit(do_not_specialize=["rows"])
def _gated_norm_kernel(
    o_ptr, gate_ptr, w_ptr, out_ptr, rows, eps, D: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """out = o * rsqrt(mean(o^2) + eps) * w * sigmoid(gate) per row of D, in float32, rounded
    once to out's dtype, in kernels.kda.gated_norm's order of operations."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    mask = (r < rows)[:, None] & dm[None, :]
    offs = r[:, None].to(tl.int64) * D + d[None, :]
    o = tl.load(o_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(o * o, 1) / D + eps)
    w = tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = o * rstd[:, None] * w[None, :] * tl.sigmoid(gate)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def gated_norm(
    o: torch.Tensor, gate: torch.Tensor, o_norm: torch.Tensor, eps: float
) -> torch.Tensor:
    """kernels.kda.gated_norm in one pass (o [T, H, Dv], gate [T, H*Dv]; [T, H*Dv] in o's
    dtype): the reference's float32 temporaries (some 60 bytes an element through HBM in about
    ten launches) become 6 bytes in one."""
    tokens, heads, dim = o.shape
    o, gate = o.contiguous(), gate.contiguous()
    assert gate.shape == (tokens, heads * dim)
    out = torch.empty(tokens, heads * dim, device=o.device, dtype=o.dtype)
    rows = tokens * heads
    if rows:
        _gated_norm_kernel[(triton.cdiv(rows, GATED_NORM_ROWS),)](
            o, gate, o_norm, out, rows, eps, D=dim, BLOCK_R=GATED_NORM_ROWS,
            BLOCK_D=triton.next_power_of_2(dim), num_warps=4,
        )  # fmt: skip
    return out


def _check_state(state: torch.Tensor) -> None:
    assert state.dtype == torch.float32, "KDA state must be float32"
    h, dk, dv = state.shape[1:]
    assert state.stride()[1:] == (dk * dv, dv, 1), "each state row must be contiguous"


def _recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    indices: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    qk_normed: bool = False,
) -> torch.Tensor:
    """fla's fused recurrent KDA, in place on `states`: each sequence n starts from
    states[indices[n, 0]] and writes its state after token t to states[indices[n, t]];
    qk_normed: q and k come l2-normed (the kernel's l2norm off).

    q, k, v, g: [N, L, H, D] (or [1, T, H, D] with cu_seqlens); beta [N, L, H].
    Returns o shaped like v, in q's dtype.
    """
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    out = torch.empty(v.shape, device=v.device, dtype=q.dtype)
    o, _ = fused_recurrent_kda_fwd(
        q=q.contiguous(),
        k=k.contiguous(),
        v=v.contiguous(),
        g=g.float().contiguous(),
        beta=beta.float().contiguous(),
        initial_state=states,
        scale=q.shape[-1] ** -0.5,
        inplace_final_state=True,
        cu_seqlens=cu_seqlens,
        ssm_state_indices=indices,
        use_qk_l2norm_in_kernel=not qk_normed,
        use_gate_in_kernel=False,
        use_beta_sigmoid_in_kernel=False,
        out=out,
    )
    return o


def kda_extend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor,
    lens: list[int],
    history: list[torch.Tensor] | None = None,
    *,
    gate: ForgetGate | None = None,
    qk_normed: bool = False,
    safe_gate: bool = False,
) -> torch.Tensor:
    """KDA over a ragged batch starting from `state[rows]` (updated in place).

    Same contract as kernels.kda.kda_extend. Without history: fla's chunked KDA over the
    varlen batch (cu_seqlens), initial states gathered from state[rows], final states written
    back. With history (speculative verify): fla's fused recurrent kernel writing the state
    after every token into a [T, H, Dk, Dv] buffer, cut into [B, max_len, H, Dk, Dv] (positions
    past a request's length repeat its last state, as the reference does).
    gate: g holds the forget gate's logits (kernels.kda.kda_extend's contract); the chunked
    path hands them to fla with use_gate_in_kernel, whose chunk-cumsum kernel applies the gate
    in float32 as forget_gate does (no [T, H, Dk] float32 decay through HBM), the recurrent path
    applies forget_gate first. qk_normed: q and k come l2-normed (conv_qkv_extend's).
    safe_gate: pass True only when every g lies in [-5, 0) (the model's lower_bound gate with
    lower_bound >= -5): fla then uses tensor-core sub-chunks.
    """
    _check_state(state)
    if gate is not None and history is not None:
        g, gate = forget_gate(g.flatten(1), *gate, q.shape[1]), None
    max_len, total = max(lens), q.shape[0]
    dev = q.device
    meta = varlen(lens, dev)
    cu = meta.cu
    if history is not None:
        per_token = torch.empty(total, *state.shape[1:], device=dev, dtype=torch.float32)
        starts = cu[:-1]
        per_token[starts] = state[rows]
        steps = torch.arange(max_len, device=dev)
        indices = (starts[:, None] + steps[None, :]).clamp(max=total - 1)
        o = _recurrent(
            q.unsqueeze(0),
            k.unsqueeze(0),
            v.unsqueeze(0),
            g.unsqueeze(0),
            beta.unsqueeze(0),
            per_token,
            indices,
            cu,
            qk_normed,
        )[0]
        lens_t = cu[1:] - starts
        last = starts[:, None] + torch.minimum(steps[None, :], lens_t[:, None] - 1)
        hist = per_token[last]  # [B, max_len, H, Dk, Dv]
        history.append(hist)
        state[rows] = hist[:, -1]
        return o

    o, final = _chunk(q, k, v, g, beta, state[rows].contiguous(), meta, gate, qk_normed, safe_gate)
    state[rows] = final
    return o.to(q.dtype)


def _chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial: torch.Tensor,
    meta: Varlen,
    gate: ForgetGate | None,
    qk_normed: bool,
    safe_gate: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's chunked KDA over the sequences of `meta`, each from its row of `initial`
    [N, H, Dk, Dv] (float32, contiguous): (o [T, H, Dv] in v's dtype, final states
    [N, H, Dk, Dv] float32)."""
    # fla's chunk_kda minus its entry checks and its blocking chunk_indices copy: its forward
    # is chunk_kda_fwd with these arguments (fla-core 0.6.0) when the l2norm and the beta
    # sigmoid stay outside the kernel; the inputs must be contiguous (chunk_kda's input_guard)
    from fla.ops.kda.chunk_fwd import chunk_kda_fwd

    in_kernel = {}
    if gate is not None:  # fla's kda_gate_chunk_cumsum: tuned on (H, Dk, chunk), not T
        g, in_kernel = g.contiguous(), dict(
            use_gate_in_kernel=True, A_log=gate.a_log, dt_bias=gate.dt_bias,
            lower_bound=gate.lower_bound,
        )  # fmt: skip
    else:
        g = g.float().contiguous()
    with torch.no_grad(), _on(q.device):
        o, final = chunk_kda_fwd(
            q=(q.contiguous() if qk_normed else _l2norm(q)).unsqueeze(0),  # ours: not tuned on T
            k=(k.contiguous() if qk_normed else _l2norm(k)).unsqueeze(0),
            v=v.contiguous().unsqueeze(0),
            g=g.unsqueeze(0),
            beta=beta.float().contiguous().unsqueeze(0),
            scale=q.shape[-1] ** -0.5,
            initial_state=initial,
            output_final_state=True,
            cu_seqlens=meta.cu,
            cu_seqlens_cpu=meta.cu_cpu,
            chunk_indices=meta.chunk_indices,
            chunk_size=FLA_CHUNK,
            safe_gate=safe_gate,
            **in_kernel,
        )[:2]
    return o[0], final


def _on(device: torch.device):
    """fla launches on the current CUDA device (a TP rank's may not be cuda:0); CPU tensors
    (the interpreter) have none."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def kda_uniform(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor,
    step_len: int,
    history: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """kda_extend for a batch where every request adds step_len tokens. Graph-safe.

    One fused recurrent launch. Without history the state is updated in place at state[rows]
    (every step writes the row); with history the steps write history [B, L, H, Dk, Dv]
    (seeded with state[rows] at step 0) and state[rows] takes its last step.
    """
    _check_state(state)
    heads, dk, dv = state.shape[1:]
    num_reqs = q.shape[0] // step_len

    def per_req(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(num_reqs, step_len, *t.shape[1:])

    args = (per_req(q), per_req(k), per_req(v), per_req(g), per_req(beta))
    if history is None:
        indices = rows.reshape(num_reqs, 1).expand(num_reqs, step_len).contiguous()
        o = _recurrent(*args, state, indices, None)
    else:
        hist = torch.empty(num_reqs, step_len, heads, dk, dv, device=q.device, dtype=torch.float32)
        hist[:, 0] = state[rows]
        indices = torch.arange(num_reqs * step_len, device=q.device).view(num_reqs, step_len)
        o = _recurrent(*args, hist.view(-1, heads, dk, dv), indices, None)
        history.append(hist)
        state[rows] = hist[:, -1]
    return o.reshape(-1, heads, v.shape[-1])


def kda_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor,
) -> torch.Tensor:
    """One token per request (q, k, g [B, H, Dk]; v [B, H, Dv]; beta [B, H]). Graph-safe:
    fla's fused recurrent kernel reads and writes state[rows] in place."""
    _check_state(state)
    o = _recurrent(
        q.unsqueeze(1),
        k.unsqueeze(1),
        v.unsqueeze(1),
        g.unsqueeze(1),
        beta.unsqueeze(1),
        state,
        rows,
        None,
    )
    return o[:, 0]


# ---------------------------------------------------------------------------------------------
# A KDA layer's decode core in one kernel
# ---------------------------------------------------------------------------------------------


@triton.jit
def _head_rows(w_ptr, n, n_mask, r, r_mask, R: tl.constexpr):
    """Rows n of a [*, R] projection's weight, as stored (the model's dtype, or e4m3)."""
    return tl.load(w_ptr + n[:, None] * R + r[None, :], mask=n_mask[:, None] & r_mask[None, :],
                   other=0.0)  # fmt: skip


@triton.jit
def _head_projection(a, w, s_ptr, stride_s, n, n_mask, dt, FP8: tl.constexpr):
    """A [*, R] projection's rows n (w, from _head_rows) applied to one token's a [BLOCK_R]
    (float32 holding the dtype's values): sum_r a[r] W[n, r] in float32, rounded to dt as the
    layer's Linear rounds its output. FP8: W8A8 as kernels.fp8.block_fp8_linear (a quantized per
    token in one group of <= 128, W's block scales per 128 rows), products and sums in float32."""
    w = w.to(tl.float32)
    if FP8:
        q, scale = quant_rows(a[None, :])
        a = tl.sum(q * scale[:, None], axis=0)  # the one group's dequantized values
        w = w * tl.load(s_ptr + (n // 128) * stride_s, mask=n_mask, other=0.0)[:, None]
    return tl.sum(w * a[None, :], axis=1).to(dt).to(tl.float32)


@triton.jit
def _conv_inputs(old, x_ptr, tok0, stride_x, ch, mask, jj, cdt, p0: tl.constexpr,
                 K: tl.constexpr):  # fmt: skip
    """Columns p0 .. p0+K-2 of a channel block's conv inputs, the old state's K-1 columns
    (`old` [BLOCK, BLOCK_K], oldest first) then the step's tokens (rows tok0, tok0+1, ... of
    x_ptr, rounded to the conv state's dtype cdt as the state holds them), as a [BLOCK,
    BLOCK_K] tile of float32: token t's window starts at p0 = t, the state the step leaves at
    p0 = T."""
    out = tl.zeros_like(old)
    for c in tl.static_range(K - 1):
        p = p0 + c  # constexpr: the branch below is resolved at compile time
        if p < K - 1:
            col = tl.sum(tl.where(jj[None, :] == p, old, 0.0), 1)
        else:
            col = tl.load(x_ptr + (tok0 + p - (K - 1)) * stride_x + ch, mask=mask, other=0.0)
            col = col.to(cdt).to(tl.float32)
        out = tl.where(jj[None, :] == c, col[:, None], out)
    return out


@triton.jit
def _conv_silu(window, x, w_old, w_last):
    """One token's causal conv + SiLU from its window's K-1 earlier inputs and its own x, in
    float32, unrounded (the caller rounds as the unfused conv's output is rounded)."""
    acc = tl.sum(window * w_old, 1) + x * w_last
    return acc * tl.sigmoid(acc)


@triton.jit
def _kda_decode_layer_kernel(
    q_ptr, k_ptr, v_ptr, stride_x,  # [B*T, H*D] each (views of one projection), rows stride_x apart
    fa_ptr, stride_fa, ga_ptr, stride_ga,  # [B*T, R] each: f_a_proj's and g_a_proj's outputs
    fb_ptr, gb_ptr,  # [H*D, R] f_b_proj's and g_b_proj's weights (the model's dtype, or e4m3)
    fbs_ptr, gbs_ptr, stride_ws,  # FP8: their block scales [ceil(H*D/128), ceil(R/128)]
    b_ptr, stride_b,  # [B*T, H] beta logits
    w_ptr,  # [3*H*D, K] float32 conv weights, q | k | v
    dt_bias_ptr, a_log_ptr, o_norm_ptr,  # [H*D], [H], [D] float32
    conv_ptr, stride_cr, stride_cc,  # [R, 3*H*D, K-1]
    state_ptr, stride_sr,  # [R, H, D, D] float32
    rows_ptr, out_ptr,  # [B]; [B*T, H*D] contiguous
    gate_ptr,  # [B*T, H*D] float32 scratch: sigmoid of the output gate
    counter_ptr,  # [>= B*H] int32, zero between calls (SPLITS > 1)
    conv_hist_ptr, state_hist_ptr,  # HISTORY: [B, 3*H*D, K-1+T] float32, [B, T, H, D, D] float32
    scale, lower_bound, eps,
    T: tl.constexpr, HISTORY: tl.constexpr,
    H: tl.constexpr, D: tl.constexpr, K: tl.constexpr, R: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BOUNDED: tl.constexpr, FP8: tl.constexpr,
    SPLITS: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)  # the request
    h = tl.program_id(1)
    split = tl.program_id(2)  # this program's columns of the head's state (its Dv block)
    BLOCK_V: tl.constexpr = BLOCK_D // SPLITS
    row = tl.load(rows_ptr + i).to(tl.int64)
    tok0 = i.to(tl.int64) * T
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    ch = h * D + d  # the head's channels of q and of k (all of Dk)
    dv = split * BLOCK_V + tl.arange(0, BLOCK_V)
    vm = dv < D
    chv = h * D + dv  # this program's channels of v
    jj = tl.arange(0, BLOCK_K)
    jmask = jj < K - 1
    conv = conv_ptr + row * stride_cr
    cdt = conv_ptr.dtype.element_ty
    q_slots = conv + ch[:, None] * stride_cc + jj[None, :]
    k_slots = conv + (H * D + ch)[:, None] * stride_cc + jj[None, :]
    v_slots = conv + (2 * H * D + chv)[:, None] * stride_cc + jj[None, :]
    qk_mask = dm[:, None] & jmask[None, :]
    v_mask = vm[:, None] & jmask[None, :]
    # every program reads the old q/k conv state; the last to finish writes it (below)
    old_q = tl.load(q_slots, mask=qk_mask, other=0.0).to(tl.float32)
    old_k = tl.load(k_slots, mask=qk_mask, other=0.0).to(tl.float32)
    old_v = tl.load(v_slots, mask=v_mask, other=0.0).to(tl.float32)
    wq = tl.load(w_ptr + ch[:, None] * K + jj[None, :], mask=qk_mask, other=0.0)
    wk = tl.load(w_ptr + (H * D + ch)[:, None] * K + jj[None, :], mask=qk_mask, other=0.0)
    wv = tl.load(w_ptr + (2 * H * D + chv)[:, None] * K + jj[None, :], mask=v_mask, other=0.0)
    wq_last = tl.load(w_ptr + ch * K + (K - 1), mask=dm, other=0.0)
    wk_last = tl.load(w_ptr + (H * D + ch) * K + (K - 1), mask=dm, other=0.0)
    wv_last = tl.load(w_ptr + (2 * H * D + chv) * K + (K - 1), mask=vm, other=0.0)
    rate = tl.exp(tl.load(a_log_ptr + h))
    dt_bias = tl.load(dt_bias_ptr + ch, mask=dm)
    sm = dm[:, None] & vm[None, :]
    s_ptrs = state_ptr + row * stride_sr + h * D * D + d[:, None] * D + dv[None, :]
    s = tl.load(s_ptrs, mask=sm, other=0.0)  # [Dk, BLOCK_V] of the state, kept across the steps
    r = tl.arange(0, BLOCK_R)
    rm = r < R
    # this head's rows of f_b_proj (all of Dk) and this program's of g_b_proj, for every step
    f_b = _head_rows(fb_ptr, ch, dm, r, rm, R)
    g_b = _head_rows(gb_ptr, chv, vm, r, rm, R)
    # everything above came before the PDL wait: the request row, weights and this layer's conv
    # and recurrent state, which the kernel before this one (the layer's input projection) never
    # writes (kernels/triton/pdl.py). H200, rank 0 at batch 1 with the boundary's and the MoE's
    # batch-1 changes: the step 4.94 -> 4.13 ms; H100, one KDA layer: 29.8 -> 24.7 us
    grid_dependency()
    hist_w = K - 1 + T  # conv history columns: the old state, then the step's inputs
    conv_hist = conv_hist_ptr + i.to(tl.int64) * (3 * H * D * hist_w)
    hist_dtype = conv_hist_ptr.dtype.element_ty  # the conv weights' (float32)
    if HISTORY:
        if split == 0:  # q and k: one program writes them (a buffer of its own: no race)
            tl.store(conv_hist + ch[:, None] * hist_w + jj[None, :], old_q.to(hist_dtype),
                     mask=qk_mask)  # fmt: skip
            tl.store(conv_hist + (H * D + ch)[:, None] * hist_w + jj[None, :],
                     old_k.to(hist_dtype), mask=qk_mask)  # fmt: skip
        tl.store(conv_hist + (2 * H * D + chv)[:, None] * hist_w + jj[None, :],
                 old_v.to(hist_dtype), mask=v_mask)  # fmt: skip
    dt = q_ptr.dtype.element_ty
    for t in tl.static_range(T):
        tok = tok0 + t
        x = tok * stride_x
        xq = tl.load(q_ptr + x + ch, mask=dm, other=0.0)
        xk = tl.load(k_ptr + x + ch, mask=dm, other=0.0)
        xv = tl.load(v_ptr + x + chv, mask=vm, other=0.0)
        if HISTORY:
            col = K - 1 + t
            if split == 0:
                tl.store(conv_hist + ch * hist_w + col, xq.to(hist_dtype), mask=dm)
                tl.store(conv_hist + (H * D + ch) * hist_w + col, xk.to(hist_dtype), mask=dm)
            tl.store(conv_hist + (2 * H * D + chv) * hist_w + col, xv.to(hist_dtype), mask=vm)
        q = _conv_silu(_conv_inputs(old_q, q_ptr, tok0, stride_x, ch, dm, jj, cdt, t, K),
                       xq.to(tl.float32), wq, wq_last)  # fmt: skip
        k = _conv_silu(_conv_inputs(old_k, k_ptr, tok0, stride_x, ch, dm, jj, cdt, t, K),
                       xk.to(tl.float32), wk, wk_last)  # fmt: skip
        v = _conv_silu(_conv_inputs(old_v, v_ptr, tok0, stride_x, chv, vm, jj, cdt, t, K),
                       xv.to(tl.float32), wv, wv_last)  # fmt: skip
        # the conv outputs round to the inputs' dtype, as the unfused path's conv returns them
        q = q.to(xq.dtype).to(tl.float32)
        k = k.to(xq.dtype).to(tl.float32)
        v = v.to(xq.dtype).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6) * scale
        k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
        # the forget gate's per-channel log decay (f_b_proj: this head's rows of it), and beta
        # (sigmoid in the logits' dtype)
        f_a = tl.load(fa_ptr + tok * stride_fa + r, mask=rm, other=0.0).to(tl.float32)
        f = _head_projection(f_a, f_b, fbs_ptr, stride_ws, ch, dm, dt, FP8)
        f = f + dt_bias
        if BOUNDED:
            g = lower_bound * tl.sigmoid(rate * f)
        else:  # softplus with torch's threshold 20
            g = -rate * tl.where(f > 20.0, f, tl.maximum(f, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(f))))
        b_raw = tl.load(b_ptr + tok * stride_b + h)
        beta = tl.sigmoid(b_raw.to(tl.float32)).to(b_raw.dtype).to(tl.float32)
        # the gated delta rule, on this program's columns
        s = s * tl.exp(g)[:, None]
        delta = (v - tl.sum(s * k[:, None], 0)) * beta
        s = s + k[:, None] * delta[None, :]
        if HISTORY:
            hist_s = state_hist_ptr + (tok * H + h) * D * D + d[:, None] * D + dv[None, :]
            tl.store(hist_s, s, mask=sm)
        o = tl.sum(s * q[:, None], 0).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + tok * (H * D) + chv, o, mask=vm)  # before the norm (the finish)
        g_a = tl.load(ga_ptr + tok * stride_ga + r, mask=rm, other=0.0).to(tl.float32)
        gate = _head_projection(g_a, g_b, gbs_ptr, stride_ws, chv, vm, dt, FP8)
        tl.store(gate_ptr + tok * (H * D) + chv, tl.sigmoid(gate), mask=vm)
    tl.store(s_ptrs, s, mask=sm)
    tl.store(v_slots, _conv_inputs(old_v, v_ptr, tok0, stride_x, chv, vm, jj, cdt, T, K).to(cdt),
             mask=v_mask)  # fmt: skip
    last = True
    if SPLITS > 1:
        # the head's last program to arrive finishes it: every thread's stores are issued before
        # the (one-thread) release, and the acquire orders the reads below after every other
        # program's stores and q/k state reads; outputs and gates are read past L1 (.cg)
        tl.debug_barrier()
        count = tl.atomic_add(counter_ptr + i * H + h, 1, sem="acq_rel")
        last = count == SPLITS - 1
    if last:
        if SPLITS > 1:
            tl.store(counter_ptr + i * H + h, 0)  # for the next call (a graph replay)
        tl.debug_barrier()  # this program's own stores, from other threads, before the reads
        new_q = _conv_inputs(old_q, q_ptr, tok0, stride_x, ch, dm, jj, cdt, T, K)
        tl.store(q_slots, new_q.to(cdt), mask=qk_mask)
        new_k = _conv_inputs(old_k, k_ptr, tok0, stride_x, ch, dm, jj, cdt, T, K)
        tl.store(k_slots, new_k.to(cdt), mask=qk_mask)
        w_norm = tl.load(o_norm_ptr + d, mask=dm)
        for tt in tl.static_range(T):  # the gated RMSNorm of the head, per token
            at = (tok0 + tt) * (H * D) + ch
            y = tl.load(out_ptr + at, mask=dm, other=0.0, cache_modifier=".cg").to(tl.float32)
            y = y * tl.rsqrt(tl.sum(y * y, 0) / D + eps) * w_norm
            y = y * tl.load(gate_ptr + at, mask=dm, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + at, y.to(out_ptr.dtype.element_ty), mask=dm)


# The fused decode core splits each head's state columns over up to DV_SPLITS_MAX programs, so a
# small batch still spreads over the SMs (batch 1 at rank 0: 8 heads -> 32 programs, not 8):
# splits double while the grid has fewer than DECODE_PROGRAMS programs. 1: a program per head.
DV_SPLITS_MAX = 4
DECODE_PROGRAMS = 128


def dv_splits(num_reqs: int, heads: int, block_d: int) -> int:
    """Programs per (request, head) of the fused decode core: a power of two, at most
    DV_SPLITS_MAX and block_d / 4 columns each, doubled while the grid is under
    DECODE_PROGRAMS."""
    splits = 1
    while (
        splits < DV_SPLITS_MAX
        and block_d // (2 * splits) >= 4
        and num_reqs * heads * splits < DECODE_PROGRAMS
    ):
        splits *= 2
    return splits


# device -> int32 zeros, a counter per (request, head) of the fused decode core: one buffer for
# every KDA layer (its launches run one after another on the forward's stream, and a PDL launch
# waits for the previous grid before touching it). Grown for a larger batch (the CUDA graphs'
# warm-ups run before their capture, largest batch first); a replaced buffer stays referenced,
# as a graph captured earlier may still use it.
_DECODE_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def _decode_counters(device: torch.device, n: int) -> torch.Tensor:
    held = _DECODE_COUNTERS.setdefault(device, [])
    if not held or held[-1].numel() < n:
        size = max(4096, triton.next_power_of_2(n))
        held.append(torch.zeros(size, device=device, dtype=torch.int32))
    return held[-1]


def kda_decode_layer(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    f_a: torch.Tensor,
    b: torch.Tensor,
    g_a: torch.Tensor,
    weights: KDAWeights,
    conv_state: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor,
    step_len: int = 1,
    history: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """kernels.kda.kda_decode_layer in one kernel: programs of (request, head, block of the
    head's state columns: dv_splits), each looping over the request's step_len tokens (1, or a
    speculative verify's draft tokens), in order: the causal conv + SiLU of q, k (the head's
    all) and of its v channels, the head's rows of f_b_proj(f_a) (a 128 x 128 product at the
    real size; bf16 or block-FP8 weights, W8A8 as the Linear), the forget gate's log decay
    (+ dt_bias, A_log), beta = sigmoid(b), the l2-normed gated delta rule on its columns of
    state[rows] (in place), its columns of the output and of sigmoid(g_b_proj(g_a)). The last
    program of a head to arrive (an int32 counter per request and head, left zero) writes the
    q/k conv state (every program of the head reads it first) and the per-head RMSNorm of the
    output gated by the sigmoid. q, k, v: [B*step_len, H*D] with a contiguous last dim (views
    of one projection's output); f_a, g_a: [B*step_len, R] with contiguous last dims, row
    strides of their own (a stack whose parts run in different precisions hands back separate
    tensors); b: [B*step_len, H]. Hazard: the request rows, weights, conv state and state are
    read before the kernel's PDL wait (kernels/triton/pdl.py), so the kernel launched right
    before it must not write them (here it is the layer's input projection).
    Returns [B*step_len, H*D] in q's dtype. With history, appends what the reference's
    (kda_uniform and causal_conv_uniform's) history holds, for a verify's roll-back: the conv
    inputs [B, 3*H*D, K-1+step_len] (old state ++ the step's inputs) and the state after each
    token [B, step_len, H, D, D], both float32. It rounds where the reference rounds: the conv
    outputs, the two projections and the recurrence's output to q's dtype, beta's sigmoid in
    b's dtype. Graph-safe."""
    _check_state(state)
    tokens, width = q.shape
    heads, dim = state.shape[1], state.shape[2]
    rank = f_a.shape[1]
    fp8 = weights.f_b_scale is not None
    assert width == heads * dim and k.stride() == v.stride() == q.stride() and q.stride(1) == 1
    assert f_a.stride(1) == g_a.stride(1) == b.stride(1) == 1
    assert weights.f_b.shape == weights.g_b.shape == (width, rank)
    assert weights.f_b.is_contiguous() and weights.g_b.is_contiguous()
    assert (weights.g_b_scale is not None) == fp8, "f_b and g_b are held alike"
    assert not fp8 or (
        rank <= FP8_BLOCK and weights.f_b_scale.stride() == weights.g_b_scale.stride()
    ), "FP8 gates: one activation group (R <= 128) and like-shaped scales"
    assert conv_state.stride(2) == 1 and tokens % step_len == 0
    num_reqs, ksize = tokens // step_len, weights.conv.shape[1]
    out = torch.empty(tokens, width, device=q.device, dtype=q.dtype)
    conv_hist = state_hist = out  # unused without history
    if history is not None:
        conv_hist = torch.empty(
            num_reqs, 3 * width, ksize - 1 + step_len, device=q.device, dtype=weights.conv.dtype
        )
        state_hist = torch.empty(num_reqs, step_len, heads, dim, dim, device=q.device,
                                 dtype=torch.float32)  # fmt: skip
        history += [conv_hist, state_hist]
    if num_reqs == 0:
        return out
    f_scale = weights.f_b_scale if fp8 else weights.f_b  # unused without FP8
    g_scale = weights.g_b_scale if fp8 else weights.g_b
    block_d = triton.next_power_of_2(dim)
    splits = dv_splits(num_reqs, heads, block_d)
    gate = torch.empty(tokens, width, device=q.device, dtype=torch.float32)
    counters = _decode_counters(q.device, num_reqs * heads) if splits > 1 else gate
    _kda_decode_layer_kernel[(num_reqs, heads, splits)](
        q, k, v, q.stride(0), f_a, f_a.stride(0), g_a, g_a.stride(0), weights.f_b, weights.g_b,
        f_scale, g_scale, f_scale.stride(0) if fp8 else 0, b, b.stride(0),
        weights.conv, weights.dt_bias, weights.a_log, weights.o_norm,
        conv_state, conv_state.stride(0), conv_state.stride(1), state, state.stride(0),
        rows, out, gate, counters, conv_hist, state_hist, dim**-0.5, weights.lower_bound or 0.0,
        weights.eps, T=step_len, HISTORY=history is not None,
        H=heads, D=dim, K=ksize, R=rank, BLOCK_D=block_d,
        BLOCK_K=triton.next_power_of_2(ksize - 1), BLOCK_R=triton.next_power_of_2(rank),
        BOUNDED=weights.lower_bound is not None, FP8=fp8, SPLITS=splits,
        num_warps=8 if dim >= 128 else 4,
        **LAUNCH,
    )  # fmt: skip
    return out

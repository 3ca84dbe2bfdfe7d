"""MoE at decode batch sizes (T <= MAX_TOKENS) in three launches, no align and no sort: same
signatures and results as kernels/moe_small.py (route_slots, experts_slots, moe_small).

1. route (one launch): programs of (block of BLOCK_E experts, K split) compute router logits
   x @ W^T with fp32 accumulators (bf16 products are exact in fp32; float32 inputs use IEEE
   dots) into per-split partials, each program one dot over its whole K range (its weight tile
   is loaded before the PDL wait, so after it come only x's load and the dot). The last program
   of the grid (one counter) sums the splits in order and selects: sigmoid, + correction bias
   for the choice only, top-k by k row maxima over one int64
   key per (token, expert) (the choice's order-preserving bits above the inverted expert id: ties
   go to the lowest id, as kernels/triton/route.py), normalise, x scaling, and writes the slots:
   the distinct picked experts of this rank in ascending local id (EP: others' experts are not
   this rank's slots), then E_local in the unused slots, and slot_weight [S, T] (0 where a token
   did not pick the slot's expert, and in unused slots).
2. gate/up + SwiGLU (one launch): programs of (block of BLOCK_N intermediate columns, K split of
   Hd) loop over the used slots (their count is read from slot_expert, so no program is spent on
   an unused slot), each program reading its gate and up tiles of every picked expert once for
   all T tokens (tokens padded to one 16-row tl.dot tile; up to GEMV_MAX_TOKENS tokens of dense
   weights in the GEMV form instead, kernels/triton/skinny_gemm.gemv_rows: [BLOCK_N, BLOCK_K]
   tiles along K multiplied on the CUDA cores, tokens in a power-of-two block of rows, no
   shared-memory staging). The shared expert is one more expert of weight 1, in
   programs of its own. Each program stores float32 partial gate/up sums; the last program of
   each 128-column group (a counter per group, over its column blocks and K splits) sums the
   splits in order, applies silu(min(gate, limit)) * clamp(up, -limit, limit), rounds to x's
   dtype and stores the intermediate h, in FP8 quantized per row group of 128 (the group is
   whole there, so the quantization happens once).
3. down + combine (one launch): programs of (block of BLOCK_N output columns, K split of I) loop
   over the used slots and the shared expert (one token: the GEMV form too), adding
   weight[t] * (h @ w2[e]^T) in float32 in slot order; with several K splits the last program
   of a column block (a counter per block) sums the splits in order and stores the output in
   x's dtype. No float atomics: deterministic.
BLOCK_T: 16 tokens in the tl.dot form; in the GEMV form next_power_of_2(T), so a token's bits
depend on T's bucket (1, 2, 4, 8: the CUDA graphs' batch sizes), never on T itself.

Block FP8 (W8A8 as kernels.moe.experts_fp8): x is quantized per token group of 128 (the code of
kernels/triton/e4m3.quant_rows, bit-equal to kernels.fp8.quantize_act) once, by the router's
launch (moe_small; X_FP8_IN_ROUTE), or, for experts_slots called alone, in the gate/up K loop
(each K step one group); e4m3 dots add dot * a_scale * w_scale per K step. The shared expert's
gate/up and down may each be FP8 or in x's dtype (serving/models/fp8_choice.py keeps a shape
dense where FP8 is not faster); the routed experts are one or the other as a whole.

Tile sizes and split counts are host functions of the shapes (never of T or of device values),
so nothing is autotuned and every launch is capturable in a CUDA graph; T is a run-time argument
(one compiled kernel per shape and dtype, plus the JIT's own T = 1 specialisation; the router's
select compiles per next_pow2(T)).

Invariants and hazards:
- Last-program reductions: a program writes its partials, then tl.debug_barrier() (Triton
  issues a scalar atomic from one thread only, so every thread's stores must precede it), then
  tl.atomic_add(counter, 1, sem="acq_rel"); the program that sees count == contributors - 1
  reads the partials (cache_modifier ".cg": from L2, never a stale L1 line) and resets the
  counter to 0, so the next launch (a graph replay) starts clean. Integer atomics only.
- counters: one int32 zeros buffer of counters_size(...) per call site (serving/layers/mlp.MoE
  owns one per layer), split here between the three kernels. Two launches that may run at the
  same time (two streams, or programmatic dependent launch) must not share one.
- MAX_TOKENS: tokens sit in one 16-row tile; more would need row blocks (use the align path).
- Offsets inside one expert are int32 (the host checks they fit); expert bases are int64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.fp8 import BLOCK as GROUP
from kernels.fp8 import FP8, blocks
from kernels.moe_small import Experts, SharedExpert, num_slots
from kernels.triton.e4m3 import quant_rows
from kernels.triton.pdl import LAUNCH, grid_dependency
from kernels.triton.skinny_gemm import GEMV_ROWS_LIMIT, gemv_rows

MAX_TOKENS = 16  # one tl.dot M tile of tokens
BLOCK_T = 16
BLOCK_E = 16  # router: experts per program
BLOCK_N = 16  # gate/up: intermediate columns per program; down: output columns (divides GROUP)
# The most programs each grid may hold (the K split counts are chosen up to them), for the H200's
# 132 SMs: a grid within one resident wave, with several programs per SM keeping enough weight
# bytes in flight (one picked expert is 33.5 MB of gate/up in bf16). Registers a thread, from
# Triton 3.6's sm_90 compile (4 warps): gate/up 96 in bf16 (5 programs fit an SM) and 150 in FP8
# (its K loop quantizes x: 3 fit); down 64-72 (7 fit); the router 48-150 up to 8 tokens and 187
# at 16 (8 warps: 1 fits), so its grid stays within one program per SM (72 at rank 0's shape:
# K ranges of 1,024, the 32 KB tiles of ROUTE_TILE_BYTES). Set by the rank's
# A/B (bench.fast_path --variant), the one-layer sweep (python -m bench.decode_moe --sweep) beside.
# The GEMV form (GEMV_MAX_TOKENS) has grids of its own. The tl.dot form in bf16: 660 x 792, was
# 528 x 528 (one layer at 4 / 8 tokens, H100 sweep: 139.3 / 232.4 -> 123.8 / 194.3 us; rank 0 cut
# to 28 layers, H100, medians of three interleaved: EAGLE's step at batch 1 (its 2-token verify)
# 5.125 -> 4.934 ms, decode at batch 2 3.743 -> 3.566, at batch 1 unchanged; the A/B's row:
# docs/notebook/benchmarks_real_size_archive.md, rank28).
# FP8: gate/up 528, was 396 (one layer at 1 token 68.98 -> 59.06 us; the FP8 28-layer rank's
# decode at batch 1 2.992 -> 2.883 ms, medians of three); its down stays 528 (792: 2.961).
ROUTE_PROGRAMS = 132
ROUTE_COUNTERS = 1  # the router's: its programs done
ROUTE_TILE_BYTES = 32768  # the router's x tile (BLOCK_T rows) and weight tile (BLOCK_E columns)
GATE_UP_PROGRAMS = 660
GATE_UP_PROGRAMS_FP8 = 528
DOWN_PROGRAMS = 792
DOWN_PROGRAMS_FP8 = 528
GEMV_GATE_UP_PROGRAMS = 528
GEMV_DOWN_PROGRAMS = 528
# tokens up to which a dense call runs gate/up and down in the GEMV form (skinny_gemm.gemv_rows;
# 0: the tl.dot form at every count; at most skinny_gemm.GEMV_ROWS_LIMIT). One MoE layer of
# rank 0 at one token, H100 (bench.decode_moe): 46.7 -> 34.6 us; the H200's rank-0 step with
# the KDA core's and the mHC boundary's early loads: 4.94 -> 4.13 ms at batch 1. Block FP8
# keeps the tl.dot form: its GEMV form (W8A8, both scales folded into the activation) made the
# FP8 rank's step slower (H200 2026-12-05: 4.555 / 4.520 against 4.451 / 4.443 ms at batch 1).
GEMV_MAX_TOKENS = 1
# the GEMV form's K step (the tl.dot forms step one 128-wide FP8 group) and whether gate/up runs
# gate and up in one loop (both weights' tiles in flight): a program's time at one token is its
# chain of dependent loads (the H200's trace, PDL off: gate/up 20.6 us a layer for ~8 us of
# bytes, 2 x 11 steps of 4 KB a program). One layer at one token, H100 (bench.decode_moe --sweep,
# 2026-12-05), us at the default grids / the best grid: apart 32.6 / 29.2, paired 28.8 / 26.4;
# K 256 paired 29.0 / 26.5 (so K stays 128).
GEMV_BLOCK_K = 128
GEMV_PAIR = True
# gate/up's columns a program in the tl.dot form when its weights are block FP8 (a multiple of 16
# dividing GROUP). Each K step loads [GROUP, BLOCK_N] e4m3 tiles: at 16 columns 2 KB each, 11
# steps a program at rank 0's shape; with x quantized in the K loop (before X_FP8_IN_ROUTE) the
# FP8 rank's gate/up at one token ran slower than bf16's (H100, 28-layer rank 0, PDL off,
# traced: 24.6 against 17.3 us a layer, for half the bytes). Wider tiles trade steps for
# programs (more K splits). With the in-loop quantization (sm_90a: 32 columns 128 registers and
# 61 KB of shared memory, 64: 167 and 110 KB; no spills) the H100 28-layer FP8 rank's decode at
# 1 / 8 rows, graphs per variant, ran 2.557 / 4.918 ms at 32 against 2.788 / 4.943 at 16 (64:
# 2.728 / 5.099) in one process, 2.694 / 5.121 against 2.686 / 4.876 in the next: the runs'
# spread as large as the effect, undecided (scratch/s38_fp8.sh's bn32 variant).
GATE_UP_BLOCK_N_FP8 = 16
# moe_small with FP8 gate/up weights: x quantized once, by the router's launch (its programs,
# a 128-group each, after the select's release), instead of in every gate/up program at every
# K step (quant_rows: an amax reduction, two IEEE divisions and the e4m3 rounding of a 16-row
# tile, 11 times a program at rank 0's shape). The FP8 down, whose operand the gate/up's finish
# quantizes once, ran faster than bf16's (8.6 against 9.9 us a layer); its gate/up slower.
# Same bits either way. The 28-layer FP8 rank on an H100 (session 39, two processes): decode at
# 1 row 2.571 / 2.658 ms against 2.781 / 2.900 with x quantized in the K loop, equal at 8.
X_FP8_IN_ROUTE = True
_PICKED = tl.constexpr(-(2**63))  # a picked expert's select key: below every real key


@dataclass(frozen=True)
class _Split:
    """A K dimension cut into `splits` ranges of `k_split` (a multiple of block_k)."""

    splits: int
    k_split: int
    block_k: int


def _split(k: int, column_blocks: int, programs: int, widest: int = GROUP) -> _Split:
    """Split K into as many ranges as column_blocks * splits <= programs allows (at least one;
    host ints only), in steps of block_k = min(widest, next_power_of_2(k)), at least 32. widest
    GROUP (the tl.dot forms): block_k divides it, so in FP8 a K step never straddles a scale
    group, and is >= 32 (e4m3 dots); the GEMV form's GEMV_BLOCK_K may be wider."""
    block_k = max(32, min(widest, triton.next_power_of_2(k)))
    steps = triton.cdiv(k, block_k)
    splits = max(1, min(steps, programs // column_blocks))
    k_split = triton.cdiv(steps, splits) * block_k
    return _Split(triton.cdiv(k, k_split), k_split, block_k)


def _route_split(hidden: int, expert_blocks: int, itemsize: int) -> tuple[int, int]:
    """(splits, k_split) of the router's K: one power-of-two range a program, loaded whole, as
    many as expert_blocks * splits <= ROUTE_PROGRAMS allows, each operand's tile at most
    ROUTE_TILE_BYTES (more splits where it would be more)."""
    k_split = triton.next_power_of_2(triton.cdiv(hidden, max(1, ROUTE_PROGRAMS // expert_blocks)))
    k_split = max(32, min(k_split, ROUTE_TILE_BYTES // (BLOCK_T * itemsize)))
    return triton.cdiv(hidden, k_split), k_split


def gemv_form(tokens: int, any_fp8: bool) -> bool:
    """Whether gate/up and down run the GEMV form (up to GEMV_MAX_TOKENS tokens, dense only)."""
    assert GEMV_MAX_TOKENS <= GEMV_ROWS_LIMIT, GEMV_MAX_TOKENS
    return tokens <= GEMV_MAX_TOKENS and not any_fp8


def expert_counters(hidden: int, inter: int, shared_inter: int) -> int:
    return blocks(inter) + blocks(shared_inter) + triton.cdiv(hidden, BLOCK_N)


def counters_size(hidden: int, inter: int, shared_inter: int) -> int:
    """int32 counters moe_small needs: inter and shared_inter this rank's intermediate sizes (0:
    no shared expert in the kernels)."""
    return ROUTE_COUNTERS + expert_counters(hidden, inter, shared_inter)


# ---------------------------------------------------------------------------------------------
# 1. route
# ---------------------------------------------------------------------------------------------


@triton.jit
def _route_kernel(
    x_ptr,  # [T, HD]
    w_ptr,  # [E, HD]
    bias_ptr,  # [E] float32
    part_ptr,  # [SPLITS, T, NEB * BLOCK_E] float32: partial logits
    counters_ptr,  # [1] int32: programs done
    slot_expert_ptr,  # [SLOTS] int32
    slot_weight_ptr,  # [SLOTS, T] float32
    xq_ptr,  # QUANT_X: [T, HD] e4m3 out, x quantized per 128-group (the FP8 gate/up's operand)
    xs_ptr,  # QUANT_X: [T, KB] float32 out, its scales
    T,
    SLOTS,
    first,
    scaling,
    E: tl.constexpr,
    NEB: tl.constexpr,
    HD: tl.constexpr,
    KB: tl.constexpr,
    E_LOCAL: tl.constexpr,
    TOPK: tl.constexpr,
    NORMALIZE: tl.constexpr,
    IEEE: tl.constexpr,
    QUANT_X: tl.constexpr,
    SPLITS: tl.constexpr,
    K_SPLIT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    TP: tl.constexpr,
    EP: tl.constexpr,
    SP: tl.constexpr,
    GROUP: tl.constexpr,
):
    b = tl.program_id(0) // SPLITS
    s = tl.program_id(0) % SPLITS
    t = tl.arange(0, BLOCK_T)
    c = tl.arange(0, BLOCK_E)
    e = b * BLOCK_E + c
    kk = s * K_SPLIT + tl.arange(0, K_SPLIT)
    k_mask = kk < HD
    # the program's whole weight tile before the wait (a weight: kernels/triton/pdl.py's
    # exception), so after it only x's load and one dot stand between the wait and the release
    w = tl.load(
        w_ptr + e[None, :] * HD + kk[:, None],
        mask=(e < E)[None, :] & k_mask[:, None],
        other=0.0,
    )
    grid_dependency()
    a = tl.load(
        x_ptr + t[:, None] * HD + kk[None, :], mask=(t < T)[:, None] & k_mask[None, :], other=0.0
    )
    if IEEE:
        acc = tl.dot(a, w, input_precision="ieee")
    else:
        acc = tl.dot(a, w)
    stride: tl.constexpr = NEB * BLOCK_E
    tl.store(part_ptr + (s * T + t[:, None]) * stride + e[None, :], acc, mask=(t < T)[:, None])
    tl.debug_barrier()  # every thread's partial precedes the release below
    if tl.atomic_add(counters_ptr, 1, sem="acq_rel") == NEB * SPLITS - 1:
        # the last program of the grid sums every split in order (deterministic) and selects
        tp = tl.arange(0, TP)
        ep = tl.arange(0, EP)
        mask = (tp < T)[:, None] & (ep < E)[None, :]
        rows = part_ptr + tp[:, None] * stride + ep[None, :]
        logits = tl.zeros([TP, EP], dtype=tl.float32)
        for i in tl.static_range(SPLITS):
            logits += tl.load(rows + i * T * stride, mask=mask, other=0.0, cache_modifier=".cg")
        _select(
            logits,
            bias_ptr,
            slot_expert_ptr,
            slot_weight_ptr,
            T,
            SLOTS,
            first,
            scaling,
            E,
            E_LOCAL,
            TOPK,
            NORMALIZE,
            TP,
            EP,
            SP,
        )
        tl.store(counters_ptr, 0)
    if QUANT_X:
        # after the release, beside the select: x's 128-groups spread over the grid, program p
        # quantizing groups p, p + programs, ... (one at most at rank 0's shape: 72 programs, 32
        # groups). The gate/up kernel reads them after its PDL wait, when this grid has finished
        _quantize_groups(x_ptr, xq_ptr, xs_ptr, T, tl.program_id(0), NEB * SPLITS, HD, KB,
                         BLOCK_T, GROUP)  # fmt: skip


@triton.jit
def _quantize_groups(
    x_ptr,  # [T, HD]
    xq_ptr,  # [T, HD] e4m3 out
    xs_ptr,  # [T, KB] float32 out
    T,
    first,
    stride,
    HD: tl.constexpr,
    KB: tl.constexpr,
    BLOCK_T: tl.constexpr,
    GROUP: tl.constexpr,
):
    """x's 128-groups first, first + stride, ... quantized as kernels.fp8.quantize_act (the bits
    the gate/up kernel's own quant_rows of the same tile gives)."""
    t = tl.arange(0, BLOCK_T)
    c = tl.arange(0, GROUP)
    t_mask = t < T
    for g in range(first, KB, stride):
        k = g * GROUP + c
        mask = t_mask[:, None] & (k < HD)[None, :]
        a = tl.load(x_ptr + t[:, None] * HD + k[None, :], mask=mask, other=0.0)
        q, scale = quant_rows(a.to(tl.float32))
        tl.store(xq_ptr + t[:, None] * HD + k[None, :], q.to(xq_ptr.dtype.element_ty), mask=mask)
        tl.store(xs_ptr + t * KB + g, scale, mask=t_mask)


@triton.jit
def _select(
    logits,  # [TP, EP] float32 (rows from T and columns from E: any value)
    bias_ptr,
    slot_expert_ptr,
    slot_weight_ptr,
    T,
    SLOTS,
    first,
    scaling,
    E: tl.constexpr,
    E_LOCAL: tl.constexpr,
    TOPK: tl.constexpr,
    NORMALIZE: tl.constexpr,
    TP: tl.constexpr,
    EP: tl.constexpr,
    SP: tl.constexpr,
):
    t = tl.arange(0, TP)
    e = tl.arange(0, EP)
    t_mask = t < T
    e_mask = e < E
    scores = tl.sigmoid(logits)
    choice = scores + tl.load(bias_ptr + e, mask=e_mask, other=0.0)[None, :]
    choice = tl.where(e_mask[None, :], choice, float("-inf"))
    # int32 bits that order as the floats do, above EP - 1 - e: one row max per pick finds the
    # best choice and, among equal ones, the lowest id
    bits = choice.to(tl.int32, bitcast=True)
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
    key = ordered * 4294967296 + (EP - 1 - e)[None, :]
    for _ in tl.static_range(TOPK):
        best = tl.max(key, axis=1)
        key = tl.where(key == best[:, None], _PICKED, key)
    picked = (key == _PICKED) & t_mask[:, None]
    w = tl.where(picked, scores, 0.0)
    if NORMALIZE:
        total = tl.zeros_like(w) + (tl.sum(w, axis=1) + 1e-20)[:, None]
        w = tl.math.div_rn(w, total)
    w = w * scaling
    # this rank's picked experts, in ascending id, become the slots
    mine = e_mask & (e >= first) & (e < first + E_LOCAL)
    active = (tl.max(picked.to(tl.int32), axis=0) > 0) & mine
    slot = tl.cumsum(active.to(tl.int32), axis=0) - 1
    used = tl.sum(active.to(tl.int32), axis=0)
    tl.store(slot_expert_ptr + slot, e - first, mask=active)
    tl.store(
        slot_weight_ptr + slot[None, :] * T + t[:, None],
        w,
        mask=active[None, :] & t_mask[:, None],
    )
    j = tl.arange(0, SP)
    spare = (j >= used) & (j < SLOTS)
    tl.store(slot_expert_ptr + j, tl.full([SP], E_LOCAL, tl.int32), mask=spare)
    tl.store(
        slot_weight_ptr + j[:, None] * T + t[None, :],
        tl.zeros([SP, TP], dtype=tl.float32),
        mask=spare[:, None] & t_mask[None, :],
    )


def route_slots(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    normalize: bool,
    scaling: float,
    local: tuple[int, int] | None,
    counters: torch.Tensor,
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.moe_small.route_slots in one launch; counters: ROUTE_COUNTERS int32 zeros.
    x_fp8: ([T, Hd] e4m3, [T, blocks(Hd)] float32) buffers the launch also fills with x
    quantized as kernels.fp8.quantize_act, for experts_slots' FP8 gate/up."""
    tokens, hidden = x.shape
    experts = gate_weight.shape[0]
    first, num_local = local if local is not None else (0, experts)
    slots = num_slots(tokens, top_k, num_local)
    dev = x.device
    slot_expert = torch.empty(slots, device=dev, dtype=torch.int32)
    slot_weight = torch.empty(slots, tokens, device=dev, dtype=torch.float32)
    if tokens == 0:
        return slot_expert, slot_weight
    assert tokens <= MAX_TOKENS, f"{tokens} tokens: the small MoE takes at most {MAX_TOKENS}"
    assert top_k <= experts and gate_weight.dtype == x.dtype, (top_k, gate_weight.dtype)
    neb = triton.cdiv(experts, BLOCK_E)
    assert counters.dtype == torch.int32 and counters.numel() >= ROUTE_COUNTERS
    splits, k_split = _route_split(hidden, neb, x.element_size())
    part = torch.empty(splits, tokens, neb * BLOCK_E, device=dev, dtype=torch.float32)
    tp = max(2, triton.next_power_of_2(tokens))
    if x_fp8 is not None:
        assert x_fp8[0].shape == x.shape and x_fp8[0].dtype == FP8, x_fp8[0].shape
        assert x_fp8[1].shape == (tokens, blocks(hidden)) and x_fp8[1].dtype == torch.float32
    xq, xs = x_fp8 if x_fp8 is not None else (x, x)
    _route_kernel[(neb * splits,)](
        x.contiguous(),
        gate_weight.contiguous(),
        correction_bias.contiguous().float(),
        part,
        counters,
        slot_expert,
        slot_weight,
        xq,
        xs,
        tokens,
        slots,
        first,
        float(scaling),
        E=experts,
        NEB=neb,
        HD=hidden,
        KB=blocks(hidden),
        E_LOCAL=num_local,
        TOPK=top_k,
        NORMALIZE=normalize,
        IEEE=x.dtype == torch.float32,
        QUANT_X=x_fp8 is not None,
        SPLITS=splits,
        K_SPLIT=k_split,
        BLOCK_T=BLOCK_T,
        BLOCK_E=BLOCK_E,
        TP=tp,
        EP=triton.next_power_of_2(experts),
        SP=triton.next_power_of_2(num_local),
        GROUP=GROUP,
        num_warps=8 if tp >= 16 else 4,  # the select's [TP, EP] int64 keys
        **LAUNCH,
    )
    return slot_expert, slot_weight


# ---------------------------------------------------------------------------------------------
# 2. gate/up + SwiGLU
# ---------------------------------------------------------------------------------------------


@triton.jit
def _gate_up_acc(
    x_ptr,
    xq_ptr,  # X_FP8: [T, HD] x in e4m3 (route_slots' x_fp8)
    xs_ptr,  # X_FP8: [T, KB] its scales
    T,
    wg_ptr,  # [INTER, HD] gate rows of one expert
    wu_ptr,  # [INTER, HD] up rows
    sg_ptr,  # FP8: [ceil(INTER / GROUP), KB] gate block scales
    su_ptr,  # FP8: up block scales
    n0,
    k_lo,
    INTER: tl.constexpr,
    HD: tl.constexpr,
    KB: tl.constexpr,
    K_SPLIT: tl.constexpr,
    FP8: tl.constexpr,
    X_FP8: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN: tl.constexpr,
    GEMV: tl.constexpr,
    GEMV_PAIR: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
):
    """x @ [gate; up]^T for columns n0 .. n0 + BLOCK_N over K range k_lo .. k_lo + K_SPLIT. FP8
    weights: x's tile quantized at each K step, or (X_FP8) read quantized from xq / xs."""
    t = tl.arange(0, BLOCK_T)
    n = n0 + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    if GEMV:  # dense; BLOCK_T rows, those past T reading row T - 1
        k_hi = tl.minimum(k_lo + K_SPLIT, HD)
        if GEMV_PAIR:  # gate and up in one loop: both tiles in flight
            return gemv_rows(x_ptr, HD, T, wg_ptr, wu_ptr, n0, kk, k_lo, k_hi, INTER, HD, EVEN,
                             False, True, BLOCK_T, BLOCK_N, BLOCK_K)  # fmt: skip
        acc_g, _ = gemv_rows(x_ptr, HD, T, wg_ptr, wg_ptr, n0, kk, k_lo, k_hi, INTER, HD, EVEN,
                             False, False, BLOCK_T, BLOCK_N, BLOCK_K)  # fmt: skip
        acc_u, _ = gemv_rows(x_ptr, HD, T, wu_ptr, wu_ptr, n0, kk, k_lo, k_hi, INTER, HD, EVEN,
                             False, False, BLOCK_T, BLOCK_N, BLOCK_K)  # fmt: skip
        return acc_g, acc_u
    t_mask = t < T
    n_mask = n < INTER
    a_ptrs = x_ptr + t[:, None] * HD + kk[None, :]
    w_offs = n[None, :] * HD + kk[:, None]
    acc_g = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    if FP8 and X_FP8:
        a_ptrs = xq_ptr + t[:, None] * HD + kk[None, :]
    for k0 in range(k_lo, tl.minimum(k_lo + K_SPLIT, HD), BLOCK_K):
        if EVEN:  # whole tiles: the weights unmasked
            a = tl.load(a_ptrs + k0, mask=t_mask[:, None], other=0.0)
            wg = tl.load(wg_ptr + k0 + w_offs)
            wu = tl.load(wu_ptr + k0 + w_offs)
        else:
            k_mask = (k0 + kk) < HD
            w_mask = n_mask[None, :] & k_mask[:, None]
            a = tl.load(a_ptrs + k0, mask=t_mask[:, None] & k_mask[None, :], other=0.0)
            wg = tl.load(wg_ptr + k0 + w_offs, mask=w_mask, other=0.0)
            wu = tl.load(wu_ptr + k0 + w_offs, mask=w_mask, other=0.0)
        if FP8 and X_FP8:  # the K step is one whole group: x's, quantized once by the router
            a8 = a
            a_s = tl.load(xs_ptr + t * KB + k0 // GROUP, mask=t_mask, other=0.0)
        elif FP8:  # quantize x's tile here (rows past T: zeros)
            qa, a_s = quant_rows(a.to(tl.float32))
            a8 = qa.to(wg_ptr.dtype.element_ty)  # exact: qa is on the e4m3 grid
        if FP8:
            g_s = tl.load(sg_ptr + (n0 // GROUP) * KB + k0 // GROUP)
            u_s = tl.load(su_ptr + (n0 // GROUP) * KB + k0 // GROUP)
            acc_g += tl.dot(a8, wg) * (a_s[:, None] * g_s)
            acc_u += tl.dot(a8, wu) * (a_s[:, None] * u_s)
        elif IEEE:
            acc_g = tl.dot(a, wg, acc_g, input_precision="ieee")
            acc_u = tl.dot(a, wu, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, wg, acc_g)
            acc_u = tl.dot(a, wu, acc_u)
    return acc_g, acc_u


@triton.jit
def _store_gate_up(
    part_ptr,
    s,
    T,
    n0,
    acc_g,
    acc_u,
    INTER: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Partials of one expert: part [SPLITS, T, 2 * INTER], gate columns then up columns."""
    t = tl.arange(0, BLOCK_T)
    n = n0 + tl.arange(0, BLOCK_N)
    mask = (t < T)[:, None] & (n < INTER)[None, :]
    ptrs = part_ptr + (s * T + t[:, None]) * (2 * INTER) + n[None, :]
    tl.store(ptrs, acc_g, mask=mask)
    tl.store(ptrs + INTER, acc_u, mask=mask)


@triton.jit
def _finish_group(
    part_ptr,  # [SPLITS, T, 2 * INTER] float32 of one expert
    h_ptr,  # [T, INTER]: x's dtype, or e4m3 (QUANT)
    hs_ptr,  # QUANT: [T, NB] float32
    x_ptr,  # for its dtype: the SwiGLU output is rounded to it
    T,
    g,
    limit,
    INTER: tl.constexpr,
    NB: tl.constexpr,
    SPLITS: tl.constexpr,
    QUANT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    GROUP: tl.constexpr,
):
    """Column group g of one expert: splits summed in order, clamped SwiGLU, h stored."""
    t = tl.arange(0, BLOCK_T)
    col = g * GROUP + tl.arange(0, GROUP)
    mask = (t < T)[:, None] & (col < INTER)[None, :]
    gate = tl.zeros([BLOCK_T, GROUP], dtype=tl.float32)
    up = tl.zeros([BLOCK_T, GROUP], dtype=tl.float32)
    for i in tl.static_range(SPLITS):
        ptrs = part_ptr + (i * T + t[:, None]) * (2 * INTER) + col[None, :]
        gate += tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
        up += tl.load(ptrs + INTER, mask=mask, other=0.0, cache_modifier=".cg")
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    h = (gate * tl.sigmoid(gate) * up).to(x_ptr.dtype.element_ty)
    out = h_ptr + t[:, None] * INTER + col[None, :]
    if QUANT:  # the whole group is here (columns past INTER: zeros, as quantize_act pads)
        q, scale = quant_rows(h.to(tl.float32))
        tl.store(out, q.to(h_ptr.dtype.element_ty), mask=mask)
        tl.store(hs_ptr + t * NB + g, scale, mask=t < T)
    else:
        tl.store(out, h, mask=mask)


@triton.jit
def _used_slots(slot_expert_ptr, j_offs, SLOTS, E_LOCAL: tl.constexpr):
    """The slots' local expert ids (E_LOCAL past SLOTS) and how many are used: the used ones
    are packed first (route_slots' order), the rest hold E_LOCAL."""
    slot_experts = tl.load(slot_expert_ptr + j_offs, mask=j_offs < SLOTS, other=E_LOCAL)
    return slot_experts, tl.sum((slot_experts < E_LOCAL).to(tl.int32), axis=0)


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, HD]
    xq_ptr,  # X_FP8: [T, HD] e4m3, x quantized by route_slots
    xs_ptr,  # X_FP8: [T, KB] float32
    slot_expert_ptr,  # [SLOTS] int32
    w13_ptr,  # [E_LOCAL, 2 * INTER, HD]
    w13_scale_ptr,  # FP8: [E_LOCAL, 2 * NB, KB]
    sg_ptr,  # shared gate [INTER_SH, HD]
    su_ptr,  # shared up [INTER_SH, HD]
    sg_scale_ptr,  # SH_FP8: [NB_SH, KB]
    su_scale_ptr,
    part_ptr,  # [SLOTS, SPLITS, T, 2 * INTER] float32
    part_sh_ptr,  # [SPLITS, T, 2 * INTER_SH] float32
    h_ptr,  # [SLOTS, T, INTER]
    h_scale_ptr,  # H_FP8: [SLOTS, T, NB]
    h_sh_ptr,  # [T, INTER_SH]
    h_sh_scale_ptr,  # H_SH_FP8: [T, NB_SH]
    counters_ptr,  # [NB + NB_SH] int32: programs done per column group
    T,
    SLOTS,
    limit,
    HD: tl.constexpr,
    INTER: tl.constexpr,
    INTER_SH: tl.constexpr,
    NB: tl.constexpr,
    NB_SH: tl.constexpr,
    KB: tl.constexpr,
    E_LOCAL: tl.constexpr,
    N_BLOCKS: tl.constexpr,
    N_BLOCKS_SH: tl.constexpr,
    SPLITS: tl.constexpr,
    K_SPLIT: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    W_FP8: tl.constexpr,
    SH_FP8: tl.constexpr,
    H_SH_FP8: tl.constexpr,
    X_FP8: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN: tl.constexpr,
    EVEN_SH: tl.constexpr,
    GEMV: tl.constexpr,
    GEMV_PAIR: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    SP: tl.constexpr,
):
    # program: (column block, K split), K splits fastest (neighbours stream neighbouring bytes);
    # the routed column blocks first, then the shared expert's
    grid_dependency()  # first: kernels/triton/pdl.py
    blk = tl.program_id(0) // SPLITS
    s = tl.program_id(0) % SPLITS
    k_lo = s * K_SPLIT
    per_group: tl.constexpr = GROUP // BLOCK_N
    tl.static_assert(GROUP % BLOCK_N == 0)
    if blk < N_BLOCKS:
        n0 = blk * BLOCK_N
        j_offs = tl.arange(0, SP)
        slot_experts, used = _used_slots(slot_expert_ptr, j_offs, SLOTS, E_LOCAL)
        part_stride = SPLITS * T * 2 * INTER
        for j in range(0, used):
            e = tl.sum(tl.where(j_offs == j, slot_experts, 0), axis=0).to(tl.int64)
            wg_ptr = w13_ptr + e * (2 * INTER * HD)
            sg = w13_scale_ptr + e * (2 * NB * KB)
            acc_g, acc_u = _gate_up_acc(
                x_ptr,
                xq_ptr,
                xs_ptr,
                T,
                wg_ptr,
                wg_ptr + INTER * HD,
                sg,
                sg + NB * KB,
                n0,
                k_lo,
                INTER,
                HD,
                KB,
                K_SPLIT,
                W_FP8,
                X_FP8,
                IEEE,
                EVEN,
                GEMV,
                GEMV_PAIR,
                BLOCK_T,
                BLOCK_N,
                BLOCK_K,
                GROUP,
            )
            _store_gate_up(
                part_ptr + j * part_stride, s, T, n0, acc_g, acc_u, INTER, BLOCK_T, BLOCK_N
            )
        g = n0 // GROUP
        contributors = tl.minimum(per_group, N_BLOCKS - g * per_group) * SPLITS
        tl.debug_barrier()  # every thread's partials precede the release below
        if tl.atomic_add(counters_ptr + g, 1, sem="acq_rel") == contributors - 1:
            for j in range(0, used):
                _finish_group(
                    part_ptr + j * part_stride,
                    h_ptr + j * T * INTER,
                    h_scale_ptr + j * T * NB,
                    x_ptr,
                    T,
                    g,
                    limit,
                    INTER,
                    NB,
                    SPLITS,
                    W_FP8,
                    BLOCK_T,
                    GROUP,
                )
            tl.store(counters_ptr + g, 0)
    elif HAS_SHARED:
        n0 = (blk - N_BLOCKS) * BLOCK_N
        acc_g, acc_u = _gate_up_acc(
            x_ptr,
            xq_ptr,
            xs_ptr,
            T,
            sg_ptr,
            su_ptr,
            sg_scale_ptr,
            su_scale_ptr,
            n0,
            k_lo,
            INTER_SH,
            HD,
            KB,
            K_SPLIT,
            SH_FP8,
            X_FP8,
            IEEE,
            EVEN_SH,
            GEMV,
            GEMV_PAIR,
            BLOCK_T,
            BLOCK_N,
            BLOCK_K,
            GROUP,
        )
        _store_gate_up(part_sh_ptr, s, T, n0, acc_g, acc_u, INTER_SH, BLOCK_T, BLOCK_N)
        g = n0 // GROUP
        contributors = tl.minimum(per_group, N_BLOCKS_SH - g * per_group) * SPLITS
        tl.debug_barrier()
        if tl.atomic_add(counters_ptr + NB + g, 1, sem="acq_rel") == contributors - 1:
            _finish_group(
                part_sh_ptr,
                h_sh_ptr,
                h_sh_scale_ptr,
                x_ptr,
                T,
                g,
                limit,
                INTER_SH,
                NB_SH,
                SPLITS,
                H_SH_FP8,
                BLOCK_T,
                GROUP,
            )
            tl.store(counters_ptr + NB + g, 0)


# ---------------------------------------------------------------------------------------------
# 3. down + combine
# ---------------------------------------------------------------------------------------------


@triton.jit
def _down_acc(
    a_ptr,  # [T, K]: the SwiGLU output of one expert (x's dtype, or e4m3)
    as_ptr,  # FP8: [T, KB] its scales
    T,
    w_ptr,  # [HD, K]
    ws_ptr,  # FP8: [ceil(HD / GROUP), KB]
    n0,
    k_lo,
    K: tl.constexpr,
    KB: tl.constexpr,
    HD: tl.constexpr,
    K_SPLIT: tl.constexpr,
    FP8: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN: tl.constexpr,
    GEMV: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
):
    """a @ w^T for output columns n0 .. n0 + BLOCK_N over K range k_lo .. k_lo + K_SPLIT."""
    t = tl.arange(0, BLOCK_T)
    n = n0 + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    if GEMV:  # dense; BLOCK_T rows, those past T reading row T - 1
        k_hi = tl.minimum(k_lo + K_SPLIT, K)
        y, _ = gemv_rows(a_ptr, K, T, w_ptr, w_ptr, n0, kk, k_lo, k_hi, HD, K, EVEN, False, False,
                         BLOCK_T, BLOCK_N, BLOCK_K)  # fmt: skip
        return y
    t_mask = t < T
    a_ptrs = a_ptr + t[:, None] * K + kk[None, :]
    w_offs = n[None, :] * K + kk[:, None]
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, tl.minimum(k_lo + K_SPLIT, K), BLOCK_K):
        if EVEN:
            a = tl.load(a_ptrs + k0, mask=t_mask[:, None], other=0.0)
            w = tl.load(w_ptr + k0 + w_offs)
        else:
            k_mask = (k0 + kk) < K
            a = tl.load(a_ptrs + k0, mask=t_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptr + k0 + w_offs, mask=(n < HD)[None, :] & k_mask[:, None], other=0.0)
        if FP8:
            a_s = tl.load(as_ptr + t * KB + k0 // GROUP, mask=t_mask, other=0.0)
            w_s = tl.load(ws_ptr + (n0 // GROUP) * KB + k0 // GROUP)
            acc += tl.dot(a, w) * (a_s[:, None] * w_s)
        elif IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def _down_kernel(
    h_ptr,  # [SLOTS, T, INTER]
    h_scale_ptr,  # W_FP8: [SLOTS, T, NB]
    h_sh_ptr,  # [T, INTER_SH]
    h_sh_scale_ptr,  # SH_FP8: [T, NB_SH]
    w2_ptr,  # [E_LOCAL, HD, INTER]
    w2_scale_ptr,  # W_FP8: [E_LOCAL, HB, NB]
    sd_ptr,  # shared down [HD, INTER_SH]
    sd_scale_ptr,  # SH_FP8: [HB, NB_SH]
    slot_expert_ptr,  # [SLOTS] int32
    slot_weight_ptr,  # [SLOTS, T] float32
    part_ptr,  # [SPLITS, T, HD] float32 (SPLITS > 1)
    out_ptr,  # [T, HD]
    counters_ptr,  # [N_BLOCKS] int32: K splits done per column block
    T,
    SLOTS,
    HD: tl.constexpr,
    INTER: tl.constexpr,
    INTER_SH: tl.constexpr,
    NB: tl.constexpr,
    NB_SH: tl.constexpr,
    HB: tl.constexpr,
    E_LOCAL: tl.constexpr,
    SPLITS: tl.constexpr,
    K_SPLIT: tl.constexpr,
    K_SPLIT_SH: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    W_FP8: tl.constexpr,
    SH_FP8: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN: tl.constexpr,
    EVEN_SH: tl.constexpr,
    GEMV: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_K_SH: tl.constexpr,
    GROUP: tl.constexpr,
    SP: tl.constexpr,
):
    blk = tl.program_id(0) // SPLITS
    s = tl.program_id(0) % SPLITS
    n0 = blk * BLOCK_N
    t = tl.arange(0, BLOCK_T)
    t_mask = t < T
    j_offs = tl.arange(0, SP)
    grid_dependency()  # first: kernels/triton/pdl.py
    slot_experts, used = _used_slots(slot_expert_ptr, j_offs, SLOTS, E_LOCAL)
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for j in range(0, used):  # slot order: a fixed summation order
        e = tl.sum(tl.where(j_offs == j, slot_experts, 0), axis=0).to(tl.int64)
        y = _down_acc(
            h_ptr + j * T * INTER,
            h_scale_ptr + j * T * NB,
            T,
            w2_ptr + e * (HD * INTER),
            w2_scale_ptr + e * (HB * NB),
            n0,
            s * K_SPLIT,
            INTER,
            NB,
            HD,
            K_SPLIT,
            W_FP8,
            IEEE,
            EVEN,
            GEMV,
            BLOCK_T,
            BLOCK_N,
            BLOCK_K,
            GROUP,
        )
        weight = tl.load(slot_weight_ptr + j * T + t, mask=t_mask, other=0.0)
        acc += y * weight[:, None]
    # the shared expert (weight 1); its K splits, of its own size, may end before the last split
    # (the GEMV form loads a split's first tile before its loop: never past K)
    if HAS_SHARED:
        if s * K_SPLIT_SH < INTER_SH:
            acc += _down_acc(
                h_sh_ptr,
                h_sh_scale_ptr,
                T,
                sd_ptr,
                sd_scale_ptr,
                n0,
                s * K_SPLIT_SH,
                INTER_SH,
                NB_SH,
                HD,
                K_SPLIT_SH,
                SH_FP8,
                IEEE,
                EVEN_SH,
                GEMV,
                BLOCK_T,
                BLOCK_N,
                BLOCK_K_SH,
                GROUP,
            )
    n = n0 + tl.arange(0, BLOCK_N)
    mask = t_mask[:, None] & (n < HD)[None, :]
    out_ptrs = out_ptr + t[:, None] * HD + n[None, :]
    if SPLITS == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = part_ptr + t[:, None] * HD + n[None, :]
        tl.store(part + s * T * HD, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial precedes the release below
        if tl.atomic_add(counters_ptr + blk, 1, sem="acq_rel") == SPLITS - 1:
            total = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
            for i in tl.static_range(SPLITS):  # fixed order: deterministic
                total += tl.load(part + i * T * HD, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(counters_ptr + blk, 0)


def experts_slots(
    x: torch.Tensor,
    slot_expert: torch.Tensor,
    slot_weight: torch.Tensor,
    experts: Experts,
    shared: SharedExpert | None,
    limit: float,
    counters: torch.Tensor,
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """kernels.moe_small.experts_slots in two launches; counters: expert_counters(Hd, I, Is)
    int32 zeros (Is 0 without a shared expert). x_fp8: x quantized (route_slots' x_fp8, filled
    by the launch before), read by the FP8 gate/up instead of quantizing x's tile each K step."""
    tokens, hidden = x.shape
    out = torch.empty_like(x)
    if tokens == 0:
        return out
    assert tokens <= MAX_TOKENS, f"{tokens} tokens: the small MoE takes at most {MAX_TOKENS}"
    w13, w2, w13_scale, w2_scale = experts
    num_local, two_inter, _ = w13.shape
    inter = two_inter // 2
    slots = slot_expert.shape[0]
    w_fp8 = w13_scale is not None
    assert w13.dtype == w2.dtype == (FP8 if w_fp8 else x.dtype), (w13.dtype, w2.dtype, x.dtype)
    dev = x.device
    if shared is None:
        inter_sh = 0
        sg = su = sd = x
        sg_scale = su_scale = sd_scale = None
    else:
        sg, su, sd, sg_scale, su_scale, sd_scale = shared
        inter_sh = sg.shape[0]
        assert (sg_scale is None) == (su_scale is None) and sg.dtype == su.dtype
        for w, scale in ((sg, sg_scale), (sd, sd_scale)):
            assert w.dtype == (FP8 if scale is not None else x.dtype), (w.dtype, x.dtype)
    sh_fp8, sd_fp8 = sg_scale is not None, sd_scale is not None
    gemv = gemv_form(tokens, w_fp8 or sh_fp8 or sd_fp8)
    block_t = triton.next_power_of_2(tokens) if gemv else BLOCK_T
    nb, nb_sh, kb, hb = blocks(inter), blocks(inter_sh), blocks(hidden), blocks(hidden)
    assert counters.dtype == torch.int32
    assert counters.numel() >= expert_counters(hidden, inter, inter_sh)
    ieee = x.dtype == torch.float32
    sp = triton.next_power_of_2(num_local)
    x = x.contiguous()
    dummy = x

    fp8_gate_up = w_fp8 or sh_fp8
    block_n = GATE_UP_BLOCK_N_FP8 if fp8_gate_up else BLOCK_N
    assert GROUP % block_n == 0 and block_n % 16 == 0, block_n
    n_blocks, n_blocks_sh = triton.cdiv(inter, block_n), triton.cdiv(inter_sh, block_n)
    widest = GEMV_BLOCK_K if gemv else GROUP
    if gemv:
        gate_up_programs, down_programs = GEMV_GATE_UP_PROGRAMS, GEMV_DOWN_PROGRAMS
    else:
        gate_up_programs = GATE_UP_PROGRAMS_FP8 if fp8_gate_up else GATE_UP_PROGRAMS
        down_programs = DOWN_PROGRAMS_FP8 if w_fp8 or sd_fp8 else DOWN_PROGRAMS
    gu = _split(hidden, n_blocks + n_blocks_sh, gate_up_programs, widest)
    assert 2 * max(inter, inter_sh) * hidden < 2**31, "int32 offsets inside one expert"
    assert slots * gu.splits * tokens * 2 * inter < 2**31, "int32 offsets of the partials"
    part = torch.empty(slots, gu.splits, tokens, 2 * inter, device=dev, dtype=torch.float32)
    h = torch.empty(slots, tokens, inter, device=dev, dtype=FP8 if w_fp8 else x.dtype)
    h_scale = torch.empty(slots, tokens, nb, device=dev, dtype=torch.float32) if w_fp8 else dummy
    if shared is not None:
        part_sh = torch.empty(gu.splits, tokens, 2 * inter_sh, device=dev, dtype=torch.float32)
        h_sh = torch.empty(tokens, inter_sh, device=dev, dtype=FP8 if sd_fp8 else x.dtype)
        h_sh_scale = torch.empty(tokens, nb_sh, device=dev, dtype=torch.float32) if sd_fp8 else x
    else:
        part_sh = h_sh = h_sh_scale = dummy
    even_k = hidden % gu.k_split == 0 and gu.k_split % gu.block_k == 0
    x_fp8 = x_fp8 if fp8_gate_up else None  # FP8 never runs the GEMV form
    xq, xs = x_fp8 if x_fp8 is not None else (x, x)
    _gate_up_kernel[((n_blocks + n_blocks_sh) * gu.splits,)](
        x,
        xq,
        xs,
        slot_expert,
        w13.contiguous(),
        w13_scale.contiguous() if w_fp8 else dummy,
        sg.contiguous(),
        su.contiguous(),
        sg_scale.contiguous() if sh_fp8 else dummy,
        su_scale.contiguous() if sh_fp8 else dummy,
        part,
        part_sh,
        h,
        h_scale,
        h_sh,
        h_sh_scale,
        counters,
        tokens,
        slots,
        float(limit),
        HD=hidden,
        INTER=inter,
        INTER_SH=inter_sh,
        NB=nb,
        NB_SH=nb_sh,
        KB=kb,
        E_LOCAL=num_local,
        N_BLOCKS=n_blocks,
        N_BLOCKS_SH=n_blocks_sh,
        SPLITS=gu.splits,
        K_SPLIT=gu.k_split,
        HAS_SHARED=shared is not None,
        W_FP8=w_fp8,
        SH_FP8=sh_fp8,
        H_SH_FP8=sd_fp8,
        X_FP8=x_fp8 is not None,
        IEEE=ieee,
        EVEN=even_k and inter % block_n == 0,
        EVEN_SH=even_k and inter_sh % block_n == 0,
        GEMV=gemv,
        GEMV_PAIR=GEMV_PAIR,
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        BLOCK_K=gu.block_k,
        GROUP=GROUP,
        SP=sp,
        num_warps=4,
        num_stages=3 if ieee else 4,
        **LAUNCH,
    )

    d_blocks = triton.cdiv(hidden, BLOCK_N)
    dn = _split(inter, d_blocks, down_programs, widest)
    # the shared expert's K (its own intermediate size) in as many splits
    block_k_sh = max(32, min(widest, triton.next_power_of_2(max(inter_sh, 1))))
    k_split_sh = max(1, triton.cdiv(triton.cdiv(inter_sh, dn.splits), block_k_sh)) * block_k_sh
    d_part = (
        torch.empty(dn.splits, tokens, hidden, device=dev, dtype=torch.float32)
        if dn.splits > 1
        else dummy
    )
    even_n = hidden % BLOCK_N == 0
    _down_kernel[(d_blocks * dn.splits,)](
        h,
        h_scale,
        h_sh,
        h_sh_scale,
        w2.contiguous(),
        w2_scale.contiguous() if w_fp8 else dummy,
        sd.contiguous(),
        sd_scale.contiguous() if sd_fp8 else dummy,
        slot_expert,
        slot_weight,
        d_part,
        out,
        counters[blocks(inter) + blocks(inter_sh) :],
        tokens,
        slots,
        HD=hidden,
        INTER=inter,
        INTER_SH=inter_sh,
        NB=nb,
        NB_SH=nb_sh,
        HB=hb,
        E_LOCAL=num_local,
        SPLITS=dn.splits,
        K_SPLIT=dn.k_split,
        K_SPLIT_SH=k_split_sh,
        HAS_SHARED=shared is not None,
        W_FP8=w_fp8,
        SH_FP8=sd_fp8,
        IEEE=ieee,
        EVEN=even_n and inter % dn.k_split == 0 and dn.k_split % dn.block_k == 0,
        EVEN_SH=even_n and inter_sh % k_split_sh == 0,
        GEMV=gemv,
        BLOCK_T=block_t,
        BLOCK_N=BLOCK_N,
        BLOCK_K=dn.block_k,
        BLOCK_K_SH=block_k_sh,
        GROUP=GROUP,
        SP=sp,
        num_warps=4,
        num_stages=3 if ieee else 4,
        **LAUNCH,
    )
    return out


def moe_small(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    normalize: bool,
    scaling: float,
    local: tuple[int, int] | None,
    experts: Experts,
    shared: SharedExpert | None,
    limit: float,
    counters: torch.Tensor,
) -> torch.Tensor:
    """kernels.moe_small.moe_small in three launches; counters: counters_size(Hd, I, Is)
    int32 zeros, owned by the call site. With FP8 gate/up weights (routed or shared) and
    X_FP8_IN_ROUTE, the router's launch also quantizes x for the gate/up."""
    tokens, hidden = x.shape
    fp8_gate_up = experts[2] is not None or (shared is not None and shared[3] is not None)
    x_fp8 = None
    if X_FP8_IN_ROUTE and fp8_gate_up and tokens:
        xq = torch.empty(tokens, hidden, device=x.device, dtype=FP8)
        x_fp8 = (xq, torch.empty(tokens, blocks(hidden), device=x.device, dtype=torch.float32))
    slot_expert, slot_weight = route_slots(
        x, gate_weight, correction_bias, top_k, normalize, scaling, local,
        counters[:ROUTE_COUNTERS], x_fp8,
    )  # fmt: skip
    return experts_slots(
        x, slot_expert, slot_weight, experts, shared, limit, counters[ROUTE_COUNTERS:], x_fp8
    )

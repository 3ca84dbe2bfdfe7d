"""The small-batch MoE (kernels/triton/moe_small.py: route in one launch, gate/up + SwiGLU in
one, down + combine + shared expert in one) against its torch references (kernels/moe_small.py),
the references against the pair-based MoE (kernels/moe.py), and the wiring in
serving/layers/mlp.MoE.

CPU cases run only under TRITON_INTERPRET=1 (tests/triton_interp; tiny shapes, Triton's
interpreter runs programs one after another, so every last-program reduction is exercised);
GPU cases (`@pytest.mark.gpu`) run the bench preset (hidden 2048, 64 experts, I 768, top-4,
shared 768) and a rank of TP8/EP8 at the real size (hidden 4096, 36 local experts of 288,
I 2048, top-8, shared 256). Inputs are random, outputs come from memory filled with NaN just
before (_poison), and the counters must be back at zero after every call.

Tolerances (relative to the reference's largest magnitude, on the same inputs):
- route_slots: equal slots; weights within 1e-5 (float32 sums in another order; sigmoid on the
  GPU is approximate to about 1e-7). Rows with a near-tie among their top k + 1 choices (float64
  gap < 1e-5) could pick differently in another summation order: seeds are chosen without them.
- experts/moe_small, float32: 1e-5 (IEEE dots; FP8 too under the interpreter: the same e4m3
  operands, fp32 sums); FP8 on the GPU 1e-3 (Hopper's e4m3 MMA accumulates in reduced
  precision inside a K step; 2e-4 measured for the FP8 linear).
- bf16 (and FP8 with bf16 activations): 2e-2 max, 1e-2 relative Frobenius, as the fused MoE's
  tests (tests/test_triton_kernels_moe_kda.py, test_triton_kernels_fp8.py): the kernel and the
  reference round the SwiGLU output to bf16 at the same point, but their fp32 gate/up sums
  differ in order, so a value may land on the other side of a bf16 (or, FP8, e4m3) rounding.
- the layer's small path against its align path (bf16): the same 2e-2 / 1e-2; float32 1e-5.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from kernels import fp8 as fp8_ref  # noqa: E402
from kernels import moe as moe_ref  # noqa: E402
from kernels import moe_small as ref  # noqa: E402
from tests.triton_interp import patch_triton_interpreter  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
cpu_interp = pytest.mark.skipif(not INTERPRET, reason="CPU cases need TRITON_INTERPRET=1")
if INTERPRET:
    patch_triton_interpreter()

# (hidden, router experts, local experts, moe_intermediate, top_k, shared intermediate)
TINY = (64, 12, 6, 32, 2, 32)  # EP-style: 6 of 12 experts local
ODD = (200, 10, 10, 136, 3, 40)  # partial 128-blocks everywhere, no EP
BENCH = (2048, 64, 64, 768, 4, 768)
REAL = (4096, 288, 36, 2048, 8, 256)  # rank 3 of EP8 (local experts 108..143), shared TP8
REAL_HBM = pytest.mark.xdist_group("real_moe")
DTYPES = [torch.float32, torch.bfloat16]
# FP8 layouts: routed experts FP8 or not; the shared expert's gate/up and down each FP8 or not
MODES = {
    "dense": (False, False, False),
    "fp8": (True, False, False),  # routed FP8, shared dense (what the timed load keeps at TP8)
    "fp8_all": (True, True, True),
    "fp8_shared_gu": (True, True, False),
}


def _poison(device) -> None:
    """Fill recently freed allocator memory with NaN so that torch.empty outputs start as NaN."""
    if torch.device(device).type == "cuda":
        junk = torch.full((64 << 20,), float("nan"), device=device)  # 256 MiB
        del junk


def _rel_max(out, ref_):
    return ((out.float() - ref_.float()).abs().max() / ref_.float().abs().max()).item()


def _rel_fro(out, ref_):
    return ((out.float() - ref_.float()).norm() / ref_.float().norm()).item()


def _check_close(out, ref_, dtype, fp32_tol=1e-5):
    assert not out.isnan().any()
    if dtype == torch.float32:
        assert _rel_max(out, ref_) <= fp32_tol, _rel_max(out, ref_)
    else:
        assert _rel_max(out, ref_) <= 2e-2 and _rel_fro(out, ref_) <= 1e-2, (
            _rel_max(out, ref_),
            _rel_fro(out, ref_),
        )


def _local(shape):
    """EP's (first, count) of a shape with fewer local experts than the router's: rank 3's, or
    the last rank's if there are fewer ranks."""
    _, experts, num_local, *_ = shape
    return (
        None if num_local == experts else (min(3, experts // num_local - 1) * num_local, num_local)
    )


def _counters(shape, device, experts_only=False, shared=True):
    from kernels.triton.moe_small import counters_size, expert_counters

    hidden, _, _, inter, _, inter_sh = shape
    inter_sh = inter_sh if shared else 0
    if experts_only:
        size = expert_counters(hidden, inter, inter_sh)
    else:
        size = counters_size(hidden, inter, inter_sh)
    return torch.zeros(size, dtype=torch.int32, device=device)


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------


def _near_ties(x, gate, bias, top_k):
    """Rows whose selection scores (float64) have two of their top k + 1 within 1e-5."""
    choice = F.linear(x.double(), gate.double()).sigmoid() + bias.double()
    top = choice.topk(top_k + 1, dim=-1).values
    return (top[:, :-1] - top[:, 1:]).min(-1).values < 1e-5


def _router(tokens, shape, dtype, device, seed=0):
    """x, router weight and bias on `device`, random from `seed`; x is _tie_free."""
    hidden, experts, *_ = shape
    gen = torch.Generator(device="cpu").manual_seed(seed)
    gate = (torch.randn(experts, hidden, generator=gen) * hidden**-0.5).to(dtype)
    bias = torch.randn(experts, generator=gen) * 0.1
    x = _tie_free(tokens, gate, bias, shape[4], seed)
    return x.to(device), gate.to(device), bias.to(device)


def _tie_free(tokens, gate, bias, top_k, seed):
    """Random x [tokens, hidden] (CPU) from the first seed from `seed` whose rows have no
    near-tie under this router (decided in float64 on the CPU: every device gets the same x)."""
    gate, bias = gate.cpu(), bias.cpu()
    for s in range(seed, seed + 20):
        gen = torch.Generator(device="cpu").manual_seed(1000 + s)
        x = torch.randn(tokens, gate.shape[1], generator=gen).to(gate.dtype)
        if not _near_ties(x, gate, bias, top_k).any():
            return x
    raise AssertionError("no tie-free seed")


_WEIGHTS: dict = {}


def _fp8_pair(rows, cols, device, gen, std):
    return fp8_ref.quantize_weight(
        torch.randn(rows, cols, device=device, generator=gen, dtype=torch.float32) * std
    )


def _weights(shape, mode, dtype, device):
    """(Experts, SharedExpert) of random weights made on the device and kept (the real shape is
    1.8 GB in bf16); FP8 weights are quantized per 128 x 128 block (gate and up apart, as the
    checkpoint stores them)."""
    key = (shape, mode, dtype, str(device))
    if key not in _WEIGHTS:
        if len(_WEIGHTS) >= 2:
            _WEIGHTS.clear()
        hidden, _, num_local, inter, _, inter_sh = shape
        routed_fp8, shared_gu_fp8, shared_d_fp8 = MODES[mode]
        gen = torch.Generator(device=device).manual_seed(1234)
        gu_std, d_std = 2 * hidden**-0.5, inter**-0.5
        if routed_fp8:
            nb = fp8_ref.blocks(inter)
            w13 = torch.empty(num_local, 2 * inter, hidden, device=device, dtype=fp8_ref.FP8)
            w2 = torch.empty(num_local, hidden, inter, device=device, dtype=fp8_ref.FP8)
            s13 = torch.empty(num_local, 2 * nb, fp8_ref.blocks(hidden), device=device)
            s2 = torch.empty(num_local, fp8_ref.blocks(hidden), nb, device=device)
            for e in range(num_local):
                w13[e, :inter], s13[e, :nb] = _fp8_pair(inter, hidden, device, gen, gu_std)
                w13[e, inter:], s13[e, nb:] = _fp8_pair(inter, hidden, device, gen, gu_std)
                w2[e], s2[e] = _fp8_pair(hidden, inter, device, gen, d_std)
            experts = ref.Experts(w13, w2, s13, s2)
        else:
            w13 = torch.randn(num_local, 2 * inter, hidden, device=device, generator=gen) * gu_std
            w2 = torch.randn(num_local, hidden, inter, device=device, generator=gen) * d_std
            experts = ref.Experts(w13.to(dtype), w2.to(dtype))
        sd_std = inter_sh**-0.5
        if shared_gu_fp8:
            (g, gs), (u, us) = (_fp8_pair(inter_sh, hidden, device, gen, gu_std) for _ in "gu")
        else:
            g, u = (
                (torch.randn(inter_sh, hidden, device=device, generator=gen) * gu_std).to(dtype)
                for _ in "gu"
            )
            gs = us = None
        if shared_d_fp8:
            d, ds = _fp8_pair(hidden, inter_sh, device, gen, sd_std)
        else:
            d = (torch.randn(hidden, inter_sh, device=device, generator=gen) * sd_std).to(dtype)
            ds = None
        _WEIGHTS[key] = (experts, ref.SharedExpert(g, u, d, gs, us, ds))
    return _WEIGHTS[key]


# ---------------------------------------------------------------------------------------------
# the references (CPU, no Triton)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("local", [None, (4, 6)], ids=["all", "ep"])
def test_reference_slots_hold_the_routes_pairs(local):
    """route_slots lists each picked local expert once, ascending, and its slot row holds
    exactly the weights route gives the (token, expert) pairs; unused slots: E_local, weight 0."""
    x, gate, bias = _router(7, TINY, torch.float32, "cpu")
    slot_expert, slot_weight = ref.route_slots(x, gate, bias, 2, True, 2.5, local)
    weights, ids = moe_ref.route(x, gate, bias, 2, 1, 1, True, 2.5, local)
    num_local = 12 if local is None else local[1]
    picked = sorted(set(ids[ids < num_local].tolist()))
    assert slot_expert.shape == (min(7 * 2, num_local),) and slot_weight.shape == (
        len(slot_expert),
        7,
    )
    assert slot_expert[: len(picked)].tolist() == picked
    assert (slot_expert[len(picked) :] == num_local).all() and not slot_weight[len(picked) :].any()
    dense = torch.zeros(7, num_local + 1).scatter_(1, ids, weights)[:, :num_local]
    assert torch.equal(slot_weight[: len(picked)], dense[:, picked].T)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_the_pair_moe(dtype):
    """moe_small (references) equals route + kernels.moe.experts + the shared SwiGLU in float32,
    and the fp8 reference equals kernels.moe.experts_fp8 + block_fp8_linear SwiGLU."""
    shape, local = TINY, (6, 6)
    x, gate, bias = _router(5, shape, dtype, "cpu")
    for mode in ("dense", "fp8_all"):
        experts, shared = _weights(shape, mode, dtype, "cpu")
        got = ref.moe_small(x, gate, bias, 2, True, 2.5, local, experts, shared, 0.7)
        weights, ids = moe_ref.route(x, gate, bias, 2, 1, 1, True, 2.5, local)
        if mode == "dense":
            routed = moe_ref.experts(
                x.float(), *[w.float() for w in experts[:2]], weights, ids, 0.7
            )
            g, u, d = (w.float() for w in shared[:3])
            h = moe_ref.swiglu(x.float() @ g.T, x.float() @ u.T, 0.7).to(dtype).float()
            want = routed + h @ d.T
        else:
            routed = moe_ref.experts_fp8(x, *experts, weights, ids, 0.7)
            lin = fp8_ref.block_fp8_linear
            h = moe_ref.swiglu(
                lin(x, shared.gate, shared.gate_scale), lin(x, shared.up, shared.up_scale), 0.7
            )
            want = routed.float() + lin(h, shared.down, shared.down_scale).float()
        _check_close(got, want, dtype)


# ---------------------------------------------------------------------------------------------
# the kernels against the references
# ---------------------------------------------------------------------------------------------


def _check_route(tokens, shape, dtype, device, normalize=True, seed=0):
    from kernels.triton import moe_small as tms

    x, gate, bias = _router(tokens, shape, dtype, device, seed)
    top_k, local = shape[4], _local(shape)
    counters = _counters(shape, device)
    _poison(device)
    for _ in range(2):  # the counters are reset: a second call is right too
        got = tms.route_slots(x, gate, bias, top_k, normalize, 2.5, local, counters)
        want = ref.route_slots(x, gate, bias, top_k, normalize, 2.5, local)
        assert not counters.any()
        assert got[0].dtype == torch.int32 and got[1].dtype == torch.float32
        assert torch.equal(got[0], want[0]), (got[0], want[0])
        assert torch.allclose(got[1], want[1], rtol=1e-5, atol=1e-6)
    return got


def _check_experts(tokens, shape, mode, dtype, device, slots=None, shared=True):
    """experts_slots against its reference, on the reference route's slots (or given ones)."""
    from kernels.triton import moe_small as tms

    experts, shared_w = _weights(shape, mode, dtype, device)
    x, gate, bias = _router(tokens, shape, dtype, device, seed=tokens)
    if slots is None:
        slots = ref.route_slots(x, gate, bias, shape[4], True, 2.5, _local(shape))
    shared_w = shared_w if shared else None
    counters = _counters(shape, device, experts_only=True, shared=shared)
    _poison(device)
    out = tms.experts_slots(x, *slots, experts, shared_w, 10.0, counters)
    assert out.dtype == dtype and out.shape == x.shape
    assert not counters.any()
    # Hopper's e4m3 MMA accumulates in reduced precision inside a K step (the kernel promotes
    # to float32 between steps): 2e-4 measured for the FP8 linear (test_triton_kernels_fp8.py)
    fp8_mma = torch.device(device).type == "cuda" and mode != "dense"
    want = ref.experts_slots(x, *slots, experts, shared_w, 10.0)
    _check_close(out, want, dtype, 1e-3 if fp8_mma else 1e-5)
    return out


@cpu_interp
@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_route_interpreter(tokens, dtype):
    # 12 experts (6 local: ids of the other 6 map to E_local), top 2; 8 tokens pick every local
    # expert at least twice over
    _check_route(tokens, TINY, dtype, "cpu")
    _check_route(tokens, ODD, dtype, "cpu", normalize=False)  # 10 of 10 local, K 200


TOP8 = (256, 40, 10, 32, 8, 32)  # 8 picks of 40 experts, 10 local


@cpu_interp
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_route_eight_picks_and_ties_interpreter(tokens):
    """8 picks of 40 experts against the reference, float32 and bf16; and with exact ties
    (zero router rows: equal logits) on top, the 8 lowest ids among the equal ones."""
    from kernels.triton import moe_small as tms

    _check_route(tokens, TOP8, torch.float32, "cpu")
    _check_route(tokens, TOP8, torch.bfloat16, "cpu", normalize=False)
    x, gate, bias = _router(tokens, TOP8, torch.float32, "cpu", seed=5)
    first, local = _local(TOP8)  # experts 30..39
    gate[first : first + local] = 0.0  # 10 zero rows: logits exactly 0 in any summation order
    bias[first:] = bias[first] + 5.0  # and above every other expert's choice
    counters = _counters(TOP8, "cpu")
    slot_expert, slot_weight = tms.route_slots(
        x, gate, bias, 8, True, 2.5, (first, local), counters
    )
    assert slot_expert.tolist()[:8] == list(range(8)), slot_expert  # the 8 lowest ids of the 10
    assert torch.allclose(slot_weight[:8], torch.full_like(slot_weight[:8], 2.5 / 8)), slot_weight


@cpu_interp
@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["dense", "fp8"])
def test_experts_interpreter(tokens, dtype, mode):
    _check_experts(tokens, TINY, mode, dtype, "cpu")


@cpu_interp
@pytest.mark.parametrize("mode", ["fp8_all", "fp8_shared_gu"])
def test_experts_interpreter_fp8_shared(mode):
    _check_experts(3, TINY, mode, torch.bfloat16, "cpu")


@cpu_interp
@pytest.mark.parametrize("block_n", [32, 64])
@pytest.mark.parametrize("shape,mode", [(TINY, "fp8"), (ODD, "fp8_all")], ids=["tiny", "odd"])
def test_experts_interpreter_fp8_wide_gate_up(shape, mode, block_n, monkeypatch):
    """FP8 gate/up in wider column tiles (GATE_UP_BLOCK_N_FP8): a 128-group finished by the last
    of fewer column blocks; ODD's intermediates (136, shared 40) mask partial tiles."""
    from kernels.triton import moe_small as tms

    monkeypatch.setattr(tms, "GATE_UP_BLOCK_N_FP8", block_n)
    _check_experts(3, shape, mode, torch.float32, "cpu")


@cpu_interp
def test_experts_interpreter_hand_slots():
    """One expert picked by every token and one by a single token (the others' weights 0), the
    rest unused (E_local); no shared expert; float32 exact."""
    slot_expert = torch.tensor([1, 4, 6, 6, 6, 6], dtype=torch.int32)
    gen = torch.Generator().manual_seed(5)
    slot_weight = torch.zeros(6, 3)
    slot_weight[0] = torch.rand(3, generator=gen) + 0.1
    slot_weight[1, 2] = 0.7
    _check_experts(3, TINY, "dense", torch.float32, "cpu", (slot_expert, slot_weight), False)


@cpu_interp
@pytest.mark.parametrize("mode", ["dense", "fp8_all"])
def test_experts_interpreter_odd_shapes(mode):
    # hidden 200, I 136, shared 40: partial tiles, K steps and 128-groups everywhere
    _check_experts(2, ODD, mode, torch.float32, "cpu")


@cpu_interp
@pytest.mark.parametrize(
    "shape,tokens",
    [(TINY, 1), (TINY, 3), (TINY, 8), (ODD, 1), (ODD, 3)],  # ODD at 8: 17 s each, interpreted
    ids=["tiny-1", "tiny-3", "tiny-8", "odd-1", "odd-3"],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_experts_interpreter_gemv_form(shape, dtype, tokens, monkeypatch):
    """Dense weights up to GEMV_MAX_TOKENS tokens run the GEMV form (no tl.dot): one token, and
    3 and 8 (rows in a block of 4 and 8, the 4th row past T clamped to T - 1) with the switch
    at 8; block FP8 never does. Odd shapes mask K and clamp weight rows. Gate and up in one
    loop (GEMV_PAIR) at 1 and 3 tokens, in two at 8; 256-wide K steps at 3 tokens (the
    shared expert's down then has fewer K splits than the routed experts')."""
    from kernels.triton import moe_small as tms

    assert tms.gemv_form(1, False) and not tms.gemv_form(2, False) and not tms.gemv_form(1, True)
    monkeypatch.setattr(tms, "GEMV_MAX_TOKENS", 8)
    monkeypatch.setattr(tms, "GEMV_PAIR", tokens != 8)
    monkeypatch.setattr(tms, "GEMV_BLOCK_K", 256 if tokens == 3 else 128)
    assert tms.gemv_form(tokens, False) and not tms.gemv_form(9, False)
    _check_experts(tokens, shape, "dense", dtype, "cpu")


@cpu_interp
@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_small_interpreter(dtype):
    """The three launches together, EP mapping, FP8 with a dense shared expert."""
    from kernels.triton import moe_small as tms

    x, gate, bias = _router(4, TINY, dtype, "cpu", seed=11)
    experts, shared = _weights(TINY, "fp8", dtype, "cpu")
    counters = _counters(TINY, "cpu")
    args = (x, gate, bias, 2, True, 2.5, (6, 6), experts, shared, 10.0)
    out = tms.moe_small(*args, counters)
    assert not counters.any()
    _check_close(out, ref.moe_small(*args), dtype)


def _x_fp8_in_route_is_bitwise(shape, mode, tokens, dtype, device, monkeypatch):
    """moe_small with x quantized by the router's launch (X_FP8_IN_ROUTE) equals it with x
    quantized in the gate/up K loop, bit for bit (the same quant_rows of the same tiles), and the
    router's e4m3 x and scales equal kernels.fp8.quantize_act's."""
    from kernels.triton import moe_small as tms

    x, gate, bias = _router(tokens, shape, dtype, device, seed=13)
    experts, shared = _weights(shape, mode, dtype, device)
    e, e_local = shape[1], shape[2]
    args = (x, gate, bias, shape[4], True, 2.5, (e - e_local, e_local), experts, shared, 10.0)
    counters = _counters(shape, device)
    outs = []
    for on in (True, False):
        monkeypatch.setattr(tms, "X_FP8_IN_ROUTE", on)
        outs.append(tms.moe_small(*args, counters))
        assert not counters.any()
    assert torch.equal(outs[0], outs[1])
    _check_close(outs[0], ref.moe_small(*args), dtype)
    xq = torch.empty(tokens, shape[0], device=device, dtype=fp8_ref.FP8)
    xs = torch.empty(tokens, fp8_ref.blocks(shape[0]), device=device)
    tms.route_slots(*args[:7], counters[: tms.ROUTE_COUNTERS], (xq, xs))
    want_q, want_s = fp8_ref.quantize_act(x)
    assert torch.equal(xq.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(xs, want_s)


@cpu_interp
@pytest.mark.parametrize(
    "shape,mode,tokens",
    [(TINY, "fp8", 4), (ODD, "fp8_all", 3), (ODD, "fp8_shared_gu", 1)],
    ids=["tiny-fp8", "odd-fp8_all", "odd-shared_gu"],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_small_interpreter_x_fp8_in_route(shape, mode, tokens, dtype, monkeypatch):
    # ODD: hidden 200, a partial last group, quantized by the router's second program of seven
    _x_fp8_in_route_is_bitwise(shape, mode, tokens, dtype, "cpu", monkeypatch)


# ---------------------------------------------------------------------------------------------
# the wiring: serving/layers/mlp.MoE takes the small path on the fast path at small batches
# ---------------------------------------------------------------------------------------------


def _tiny_moe(dtype, parallel, fp8):
    """A MoE layer of the tiny preset (hidden 64, 8 experts top-2, I 32, shared 32) built as
    `parallel`'s rank, random weights; fp8 "routed" holds the experts in block FP8, "all" the
    shared expert's Linears too."""
    from serving.config import ModelConfig
    from serving.distributed import set_state
    from serving.layers.mlp import MoE
    from serving.tools.tiny_model import build_config

    specials = {"<|endoftext|>": 0, "<|user|>": 1, "<|observation|>": 2}
    config = ModelConfig.from_dict(build_config("tiny", specials))
    set_state(parallel)
    moe = MoE(config, dtype)
    mlp = moe.shared_experts
    linears = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if fp8 is not None:
        moe.hold_fp8()
    if fp8 == "all":
        for lin in linears:
            lin.hold_fp8()
    gen = torch.Generator().manual_seed(3)

    def rand(p, std=None):
        return torch.randn(p.shape, generator=gen) * (std or p.shape[-1] ** -0.5)

    w13, w2 = rand(moe.w13, 2 * moe.w13.shape[-1] ** -0.5), rand(moe.w2)
    if fp8 is None:
        moe.w13.data.copy_(w13)
        moe.w2.data.copy_(w2)
    else:  # gate and up quantized apart, as the checkpoint stores them
        half = w13.shape[1] // 2
        (g8, gs), (u8, us) = (fp8_ref.quantize_weight(w) for w in (w13[:, :half], w13[:, half:]))
        moe.w13.data.copy_(torch.cat([g8, u8], 1))
        moe.w13_scale_inv.data.copy_(torch.cat([gs, us], 1))
        moe.w2.data, moe.w2_scale_inv.data = fp8_ref.quantize_weight(w2)
    for lin in linears:
        w = rand(lin.weight)
        if lin.weight_scale_inv is None:
            lin.weight.data.copy_(w)
        else:
            lin.weight.data, lin.weight_scale_inv.data = fp8_ref.quantize_weight(w)
    moe.gate.weight.data.copy_(rand(moe.gate.weight))
    moe.gate.e_score_correction_bias.data.copy_(torch.rand(config.n_routed_experts) * 0.1)
    return moe


PARALLEL = {
    "world1": dict(),
    "tp2": dict(rank=1, tp_size=2),  # experts split by intermediate size, shared TP-split
    "ep2": dict(rank=1, ep_size=2),  # 4 local experts; the shared expert outside the kernels
    "tp2ep2": dict(rank=1, tp_size=2, ep_size=2),
}


@cpu_interp
@pytest.mark.parametrize("parallel", sorted(PARALLEL))
@pytest.mark.parametrize(
    "dtype, fp8",
    [
        (torch.float32, None),
        (torch.bfloat16, None),
        (torch.float32, "routed"),
        (torch.float32, "all"),
    ],
)
def test_layer_takes_the_small_path_interpreter(parallel, dtype, fp8, monkeypatch):
    """MoE.forward on the fast path (forced on the CPU) at T <= SMALL_MOE_MAX_TOKENS runs
    moe_small once and equals the torch path (kernels.torch_path: route + experts + DenseMLP);
    above it, the align path. The all-reduce doubles (a world of two equal partial sums), so a
    shared expert added before it under EP without TP (where every rank holds all of it) shows."""
    import kernels
    from serving.distributed import ParallelState, set_state
    from serving.layers import mlp

    monkeypatch.setattr(mlp, "fast_path", lambda t: not kernels.TORCH_ONLY)
    # two ranks holding the same partial: where the shared expert is added shows
    monkeypatch.setattr(mlp, "all_reduce", lambda t: t * 2)
    from kernels.triton import moe_small as tms

    calls = []
    real = tms.moe_small
    monkeypatch.setattr(tms, "moe_small", lambda *a: calls.append(1) or real(*a))
    try:
        moe = _tiny_moe(dtype, ParallelState(**PARALLEL[parallel]), fp8)
        tokens = mlp.SMALL_MOE_MAX_TOKENS if fp8 is None else mlp.SMALL_MOE_MAX_TOKENS_FP8
        router = moe.gate.weight, moe.gate.e_score_correction_bias
        x = _tie_free(tokens, *router, 2, seed=2)
        with torch.no_grad():
            out = moe(x)
            with kernels.torch_path():
                want = moe(x)
        assert calls == [1] and not moe.small_counters.any()
        _check_close(out, want, dtype)
        if parallel == "world1":  # one token more: the align path
            more = _tie_free(tokens + 1, *router, 2, seed=2)
            with torch.no_grad():
                moe(more)
            assert calls == [1]
    finally:
        set_state(ParallelState())


# ---------------------------------------------------------------------------------------------
# GPU: bench preset and the real rank
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4, 8, 16])
@pytest.mark.parametrize(
    "shape", [BENCH, pytest.param(REAL, marks=REAL_HBM)], ids=["bench", "real"]
)
def test_route_gpu(shape, tokens):
    _check_route(tokens, shape, torch.bfloat16, "cuda")
    _check_route(tokens, shape, torch.float32, "cuda", normalize=False)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4, 8])
@pytest.mark.parametrize("mode", ["dense", "fp8", "fp8_all"])
@pytest.mark.parametrize(
    "shape", [BENCH, pytest.param(REAL, marks=REAL_HBM)], ids=["bench", "real"]
)
def test_experts_gpu(shape, mode, tokens):
    _check_experts(tokens, shape, mode, torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 16])
@pytest.mark.parametrize("mode", ["fp8", "fp8_all"])
def test_moe_small_gpu_x_fp8_in_route(mode, tokens, monkeypatch):
    _x_fp8_in_route_is_bitwise(BENCH, mode, tokens, torch.bfloat16, "cuda", monkeypatch)


@pytest.mark.gpu
@REAL_HBM
@pytest.mark.parametrize("tokens", [2, 4])
def test_moe_small_gpu_real_fp8_x_in_route(tokens, monkeypatch):
    """The real rank's FP8 experts past one token with x quantized by the router's launch: what
    SMALL_MOE_MAX_TOKENS_FP8 = 4 runs. The 45-layer FP8 rank with it at 4 hit an illegal memory
    access in its decode graphs (H200, session 40); this holds the layer's kernels alone."""
    _x_fp8_in_route_is_bitwise(REAL, "fp8", tokens, torch.bfloat16, "cuda", monkeypatch)


def _warmup_rows_check(tokens: int) -> None:
    """test_moe_small_gpu_real_fp8_warmup_rows' body, run in a process of its own."""
    from kernels.triton import moe_small as tms
    from serving.executor.cuda_graph import capture

    assert tms.X_FP8_IN_ROUTE
    x1, gate, bias = _router(1, REAL, torch.bfloat16, "cuda", seed=13)
    experts, shared = _weights(REAL, "fp8", torch.bfloat16, "cuda")
    counters = _counters(REAL, "cuda")
    x = x1.repeat(tokens, 1)
    args = (gate, bias, REAL[4], True, 2.5, (0, REAL[2]), experts, shared, 10.0)
    out = tms.moe_small(x, *args, counters)
    torch.cuda.synchronize()
    assert not counters.any()
    _check_close(out, ref.moe_small(x, *args), torch.bfloat16)
    # captured as the decode graphs are (warm-ups on a side stream, then the capture)
    graph, out = capture(lambda: tms.moe_small(x, *args, counters), torch.cuda.graph_pool_handle())
    x.copy_(_tie_free(tokens, gate, bias, REAL[4], 5))
    graph.replay()
    torch.cuda.synchronize()
    assert not counters.any()
    _check_close(out, ref.moe_small(x, *args), torch.bfloat16)


@pytest.mark.gpu
@REAL_HBM
@pytest.mark.parametrize("tokens", [3, 4])
def test_moe_small_gpu_real_fp8_warmup_rows(tokens):
    """What the FP8 rank's decode graphs run first at batch 4 with SMALL_MOE_MAX_TOKENS_FP8 = 4,
    where its router's launch reported an illegal memory access (H200 and H100; launches
    blocking at batch 4, none at batch 2): rank 0's local experts, every row the same token (the
    warm-up's), x quantized by the router; eager, then in a CUDA graph replayed on distinct rows.
    In a process of its own: a fault there would poison this worker's CUDA context."""
    code = f"from tests.test_triton_moe_small import _warmup_rows_check as c; c({tokens})"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("block_n", [32, 64])
@pytest.mark.parametrize("tokens", [1, 8])
def test_experts_gpu_fp8_wide_gate_up(tokens, block_n, monkeypatch):
    """The FP8 gate/up's wider column tiles (GATE_UP_BLOCK_N_FP8) at the bench shape."""
    from kernels.triton import moe_small as tms

    monkeypatch.setattr(tms, "GATE_UP_BLOCK_N_FP8", block_n)
    _check_experts(tokens, BENCH, "fp8_all", torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape", [BENCH, pytest.param(REAL, marks=REAL_HBM)], ids=["bench", "real"]
)
def test_experts_gpu_gemv_form(shape, monkeypatch):
    """The GEMV form at 1 token (the default) and, with the switch at 8, at 2, 3 and 8 tokens:
    bf16 and float32; gate and up in one loop with 256-wide K steps at 1 and 2."""
    from kernels.triton import moe_small as tms

    _check_experts(1, shape, "dense", torch.bfloat16, "cuda")
    _check_experts(1, shape, "dense", torch.float32, "cuda")
    monkeypatch.setattr(tms, "GEMV_MAX_TOKENS", 8)
    for tokens in (2, 3, 8):
        _check_experts(tokens, shape, "dense", torch.bfloat16, "cuda")
    _check_experts(2, shape, "dense", torch.float32, "cuda")
    monkeypatch.setattr(tms, "GEMV_PAIR", not tms.GEMV_PAIR)
    monkeypatch.setattr(tms, "GEMV_BLOCK_K", 256)
    for tokens in (1, 2):
        _check_experts(tokens, shape, "dense", torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["dense", "fp8"])
def test_experts_gpu_float32_and_16_tokens(mode):
    _check_experts(3, BENCH, mode, torch.float32, "cuda")
    _check_experts(16, BENCH, mode, torch.bfloat16, "cuda")


@pytest.mark.gpu
@REAL_HBM
@pytest.mark.parametrize("mode", ["dense", "fp8"])
def test_moe_small_cuda_graph(mode):
    """Captured once at 4 tokens (the real rank, EP mapping), replayed on new inputs: equal to
    eager calls bit for bit (fixed summation orders), counters back at zero."""
    from kernels.triton import moe_small as tms

    shape, tokens = REAL, 4
    experts, shared = _weights(shape, mode, torch.bfloat16, "cuda")
    x, gate, bias = _router(tokens, shape, torch.bfloat16, "cuda", seed=1)
    counters = _counters(shape, "cuda")

    def run():
        return tms.moe_small(
            x, gate, bias, 8, True, 2.5, _local(shape), experts, shared, 10.0, counters
        )

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile outside the capture
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for seed in (2, 3):
        x.copy_(_tie_free(tokens, gate, bias, 8, seed))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not counters.any()
        assert torch.equal(out, run())
        args = (x, gate, bias, 8, True, 2.5, _local(shape), experts, shared, 10.0)
        _check_close(out, ref.moe_small(*args), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4, 8])
@pytest.mark.parametrize("fp8", [None, "routed", "all"])
def test_layer_small_path_matches_align_path_gpu(tokens, fp8, monkeypatch):
    """The bench preset's MoE layer (world 1) on CUDA: the small path against the fused align
    path + DenseMLP (both SMALL_MOE_MAX_TOKENS limits 0) on the same weights and inputs."""
    from serving.config import ModelConfig
    from serving.distributed import ParallelState, set_state
    from serving.layers import mlp
    from serving.tools.tiny_model import build_config

    specials = {"<|endoftext|>": 0, "<|user|>": 1, "<|observation|>": 2}
    config = ModelConfig.from_dict(build_config("bench", specials))
    set_state(ParallelState())
    with torch.device("cuda"):
        moe = mlp.MoE(config, torch.bfloat16)
    experts, shared = _weights(
        BENCH, {None: "dense", "routed": "fp8", "all": "fp8_all"}[fp8], torch.bfloat16, "cuda"
    )
    if fp8 is not None:
        moe.hold_fp8()
        moe.w13_scale_inv, moe.w2_scale_inv = (torch.nn.Parameter(s, False) for s in experts[2:])
    if fp8 == "all":
        for lin in (
            moe.shared_experts.gate_proj,
            moe.shared_experts.up_proj,
            moe.shared_experts.down_proj,
        ):
            lin.hold_fp8()
    moe.w13, moe.w2 = (torch.nn.Parameter(w, False) for w in experts[:2])
    mlp_ = moe.shared_experts
    for lin, w, s in zip((mlp_.gate_proj, mlp_.up_proj, mlp_.down_proj), shared[:3], shared[3:]):
        lin.weight = torch.nn.Parameter(w, False)
        if s is not None:
            lin.weight_scale_inv = torch.nn.Parameter(s, False)
    x, gate, bias = _router(tokens, BENCH, torch.bfloat16, "cuda", seed=7)
    moe.gate.weight.data.copy_(gate)
    moe.gate.e_score_correction_bias.data.copy_(bias)
    monkeypatch.setattr(mlp, "SMALL_MOE_MAX_TOKENS", 16)
    monkeypatch.setattr(mlp, "SMALL_MOE_MAX_TOKENS_FP8", 16)
    _poison("cuda")
    out = moe(x)
    assert not moe.small_counters.any()
    monkeypatch.setattr(mlp, "SMALL_MOE_MAX_TOKENS", 0)
    monkeypatch.setattr(mlp, "SMALL_MOE_MAX_TOKENS_FP8", 0)
    ref = moe(x)
    if fp8 == "all":  # the shared expert's activations quantized at other points than DenseMLP's
        # W8A8 (its h inside the kernel): the H200 measured 1.08% (Frobenius) at 4 tokens
        assert _rel_max(out, ref) <= 2e-2 and _rel_fro(out, ref) <= 1.5e-2
    else:
        _check_close(out, ref, torch.bfloat16)

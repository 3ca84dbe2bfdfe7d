"""The skinny GEMM (kernels/triton/skinny_gemm.py) against its twins, torch.nn.functional.linear
(bf16 weights) and kernels.fp8.block_fp8_linear (block-FP8 weights, W8A8), and the block-FP8
stacks of StackedProjections running on it.

CPU cases run under TRITON_INTERPRET=1 (tiny, odd shapes: M in {1, 3, 8, 33}, N not a multiple
of the N tile, K with a partial 128 group, split K and not; bf16 and float32 activations) and
skip otherwise; the interpreter runs the programs one after another, so the last-program
reduction and the counter reset run too. GPU cases (`@pytest.mark.gpu`) run every rank-0
projection shape of GLM-5.3-Flash at TP8/EP8 (bench/decode_gemm.py's RANK0_LINEARS) at 1, 8 and
32 tokens, bf16 and FP8, a CUDA graph replayed with new inputs, and the FP8 stacks at KDA's and
DSA's real row counts. Outputs the kernel allocates are poisoned with NaN first (_poison).

Tolerances, relative to the reference's largest magnitude:
- FP8 against kernels.fp8.block_fp8_linear (the same quantized operands: the activation bits
  are quantize_act's, kernels/triton/e4m3.py; fp32 sums in another order): float32 outputs
  1e-5 under the interpreter (fp32 accumulation), 1e-3 on the GPU (Hopper's FP8 MMA accumulates
  in reduced precision inside a 128-wide K block: 2e-4 measured for the Triton GEMM,
  tests/test_triton_kernels_fp8.py); bf16 outputs 1e-2 max (a straddled bf16 rounding boundary
  is one ulp, at most 2^-7 of the largest output) and 1e-2 relative Frobenius, 2e-2 max under
  the interpreter (as tests/test_triton_kernels_fp8.py); against the dequantized weights in
  float32, 6e-2 relative Frobenius (the activations' e4m3 rounding).
- bf16 weights against F.linear on their float32 copies: the output's bf16 rounding, 2^-9 of an
  element: 1e-2 max and 5e-3 relative Frobenius.
- Bits: the same call twice gives the same bits (split K sums in a fixed order), and the split-K
  counters are zero after every call (a graph replay starts clean).
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from bench.decode_gemm import RANK0_LINEARS  # noqa: E402
from kernels import fp8 as fp8_ref  # noqa: E402
from tests.triton_interp import count_launches, patch_triton_interpreter  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
cpu_interp = pytest.mark.skipif(not INTERPRET, reason="CPU cases need TRITON_INTERPRET=1")
if INTERPRET:
    patch_triton_interpreter()

TOKENS = (1, 8, 32)


def _rel_max(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _rel_fro(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _fp8_weight(rows, cols, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(rows, cols, device=device, generator=gen) * cols**-0.5
    return fp8_ref.quantize_weight(w)


def _x(m, k, dtype, device, seed):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)


def _poison(m, n, dtype, device):
    """NaN in the block the kernel's next torch.empty(m, n) gets (the caching allocator hands a
    block freed on this stream back first): an output element the kernel skips stays NaN."""
    if torch.device(device).type == "cuda":
        torch.full((m, n), float("nan"), device=device, dtype=dtype)


def _counters_zero():
    from kernels.triton import skinny_gemm

    return all(int(c.abs().sum()) == 0 for c in skinny_gemm._COUNTERS.values())


def _skinny(x, *weights, **kw):
    """skinny_linear as block_fp8_linear runs it: a block-FP8 weight's x quantized first."""
    from kernels.triton.fp8 import quantize_act
    from kernels.triton.skinny_gemm import skinny_linear

    x_fp8 = quantize_act(x) if len(weights) == 2 else None
    return skinny_linear(x, *weights, x_fp8=x_fp8, **kw)


def _check_fp8(m, n, k, dtype, device, interpreter=False):
    from kernels.triton import fp8 as tfp8

    w8, scale = _fp8_weight(n, k, device, seed=n + k)
    x = _x(m, k, dtype, device, seed=m + n)
    _poison(m, n, dtype, device)
    out = _skinny(x, w8, scale)
    assert out.dtype == dtype and out.shape == (m, n) and not out.isnan().any()
    ref = fp8_ref.block_fp8_linear(x, w8, scale)
    if dtype == torch.float32:
        assert _rel_max(out, ref) <= (1e-5 if interpreter else 1e-3)
    else:
        assert _rel_max(out, ref) <= (2e-2 if interpreter else 1e-2)
        assert _rel_fro(out, ref) <= 1e-2
    assert _rel_fro(out, x.float() @ fp8_ref.dequantize(w8, scale).T) <= 6e-2
    assert torch.equal(_skinny(x, w8, scale), out)  # deterministic
    if m <= tfp8.SKINNY_MAX_TOKENS:  # what the fast path runs
        assert torch.equal(tfp8.block_fp8_linear(x, w8, scale), out)
    assert _counters_zero()
    return out


def _check_dense(m, n, k, device, dtype=torch.bfloat16):
    """Every form that applies (up to GEMV_ROWS_LIMIT rows: GEMV and tl.dot), and with addmm's
    C."""
    from kernels.triton.skinny_gemm import (
        GEMV_MAX_ROWS,
        GEMV_ROWS_LIMIT,
        gemv_config,
        skinny_config,
        skinny_linear,
    )

    gen = torch.Generator(device=device).manual_seed(n + k)
    w = (torch.randn(n, k, device=device, generator=gen) * k**-0.5).to(dtype)
    x = _x(m, k, dtype, device, seed=m + n)
    ref = F.linear(x.float(), w.float())
    configs = [None] + ([skinny_config(m, n, k, w.element_size())] if m <= GEMV_MAX_ROWS else [])
    if GEMV_MAX_ROWS < m <= min(4, GEMV_ROWS_LIMIT):  # the GEMV form past the default's rows
        # (8 rows: the splits test below and the MoE's, cheaper under the interpreter)
        configs.append(gemv_config(n, k, rows=m))
    for config in configs:
        _poison(m, n, dtype, device)
        out = skinny_linear(x, w, config=config)
        assert out.dtype == dtype and out.shape == (m, n) and not out.isnan().any()
        assert _rel_max(out, ref) <= 1e-2 and _rel_fro(out, ref) <= 5e-3, config
        assert torch.equal(skinny_linear(x, w, config=config), out)
        assert _counters_zero()
    add = _x(m, n, dtype, device, seed=7)
    got = skinny_linear(x, w, add=add)
    with_add = ref + add.float()
    assert _rel_max(got, with_add) <= 1e-2 and _rel_fro(got, with_add) <= 5e-3
    return skinny_linear(x, w)


# (M, N, K): N past the N tiles, partial 128 groups, K below one group, split K with a partial
# last group (300 x 520, 70 x 1100) and without; one row past the GEMV form's N tile and K step
ODD = [(1, 48, 64), (3, 130, 200), (8, 300, 520), (33, 17, 48), (33, 70, 1100), (1, 37, 700)]


@cpu_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", ODD)
def test_skinny_fp8_interpreter(m, n, k, dtype):
    _check_fp8(m, n, k, dtype, "cpu", interpreter=True)


@cpu_interp
def test_block_fp8_linear_runs_quantize_act_then_the_skinny_gemm_to_its_rows_interpreter(
    monkeypatch,
):
    """Up to SKINNY_MAX_TOKENS rows block_fp8_linear runs quantize_act's launch, then the skinny
    GEMM on its output: two launches, none to copy an x that is a column slice (a stacked
    projection's output), the bits of the contiguous x's; a row past it leaves the skinny GEMM."""
    from kernels.triton import fp8 as tfp8
    from kernels.triton.skinny_gemm import skinny_linear

    n, k, rows = 70, 300, tfp8.SKINNY_MAX_TOKENS
    w8, scale = _fp8_weight(n, k, "cpu", seed=3)
    wide = {m: _x(m, k + 40, torch.bfloat16, "cpu", seed=m) for m in (1, rows)}
    xs = {m: x[:, 16 : 16 + k] for m, x in wide.items()}  # row stride k + 40
    contiguous = {
        m: skinny_linear(x, w8, scale, x_fp8=tfp8.quantize_act(x.contiguous()))
        for m, x in xs.items()
    }
    launched = count_launches(monkeypatch)
    for m, x in xs.items():
        assert tfp8.linear_gemm(m, n, k, x.dtype, x.device) == "skinny"
        assert torch.equal(tfp8.block_fp8_linear(x, w8, scale), contiguous[m])
    assert launched == {"_quant_kernel": 2, "_skinny_kernel": 2}, launched
    assert tfp8.linear_gemm(rows + 1, n, k, torch.bfloat16, "cpu") == "triton"


@cpu_interp
@pytest.mark.parametrize("m,n,k", ODD)
def test_skinny_bf16_interpreter(m, n, k):
    _check_dense(m, n, k, "cpu")


@cpu_interp
def test_gemv_form_splits_k_and_covers_every_row_interpreter():
    """The GEMV form at tilings that split K into uneven parts (the last split shorter, one
    partial K step) and leave N tiles partly past N, against F.linear; a mutation that skips a
    split or an N tile's last rows fails here."""
    from kernels.triton.skinny_gemm import gemv_config, skinny_linear

    n, k = 45, 1000
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * k**-0.5).bfloat16()
    tilings = {(1, 16, 256): 1, (12, 16, 256): 4, (40, 8, 128): 4, (3, 32, 512): 2}
    for rows, block_m in ((1, 1), (2, 2), (5, 8)):
        x = _x(rows, k, torch.bfloat16, "cpu", seed=4)
        ref = F.linear(x.float(), w.float())
        for (target, block_n, block_k), splits in tilings.items():
            cfg = gemv_config(n, k, target, block_n, block_k, rows=rows)
            assert cfg.gemv and cfg.block_m == block_m and cfg.splits == splits, cfg
            out = skinny_linear(x, w, config=cfg)
            assert _rel_max(out, ref) <= 1e-2 and _rel_fro(out, ref) <= 5e-3, cfg
            assert _counters_zero()


@cpu_interp
def test_dense_linears_run_the_skinny_gemm_up_to_its_rows_interpreter(monkeypatch):
    """serving.layers.linear.dense_linear, as Linear (with addmm's add) and a dense stack run
    it: the skinny GEMM up to SKINNY_DENSE_MAX_TOKENS rows on the fast path (one row in the
    GEMV form), cuBLAS past them and off the fast path; the same outputs each way."""
    from torch import nn

    import kernels
    from serving.layers import linear
    from serving.layers.stacked_projections import StackedProjections

    launches = count_launches(monkeypatch)
    monkeypatch.setattr(kernels, "INTERPRETED", True)
    monkeypatch.setattr(linear, "SKINNY_DENSE_MAX_TOKENS", 2)
    gen = torch.Generator().manual_seed(0)
    owner = nn.Module()
    for name, rows in (("a", 40), ("b", 24)):
        part = linear.Linear(96, rows, torch.bfloat16)
        part.weight.data = (torch.randn(rows, 96, generator=gen) * 0.1).bfloat16()
        setattr(owner, name, part)
    stack = StackedProjections(owner, ("a", "b"))
    assert stack.stack()
    for rows, skinny in ((1, True), (2, True), (3, False)):
        launches.clear()
        x = torch.randn(rows, 96, generator=gen).bfloat16()
        add = torch.randn(rows, 40, generator=gen).bfloat16()
        with torch.no_grad():
            got_a, got_b = stack(x)
            got_add = owner.a(x, add=add)
        assert launches["_skinny_kernel"] == (2 if skinny else 0), (rows, launches)  # stack, a
        want_a, want_b = (F.linear(x.float(), p.weight.float()) for p in (owner.a, owner.b))
        for got, want in ((got_a, want_a), (got_b, want_b), (got_add, want_a + add.float())):
            assert got.shape == want.shape and _rel_max(got, want) <= 1e-2, rows
    monkeypatch.setattr(kernels, "INTERPRETED", False)  # off the fast path: cuBLAS / torch
    launches.clear()
    with torch.no_grad():
        owner.a(torch.randn(1, 96, generator=gen).bfloat16())
    assert not launches, launches


@cpu_interp
def test_skinny_takes_a_column_slice_interpreter():
    """A stacked projection's output column (a row stride, no copy) gives what a contiguous
    copy gives, FP8 (its quantize_act too) and bf16."""
    from kernels.triton.skinny_gemm import skinny_linear

    wide = _x(5, 700, torch.bfloat16, "cpu", seed=3)
    x = wide[:, 200:456]
    assert not x.is_contiguous()
    w8, scale = _fp8_weight(96, 256, "cpu", seed=1)
    assert torch.equal(_skinny(x, w8, scale), _skinny(x.contiguous(), w8, scale))
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    assert torch.equal(skinny_linear(x, w), skinny_linear(x.contiguous(), w))


def _rows_alone_equal_rows_together(device, k=520, n=300):
    """A row's bits do not depend on the rows beside it within one BLOCK_M: an eager decode of
    11 requests gives what its CUDA graph padded to 16 gives (tests/test_gpu.py's greedy
    equality), FP8 and bf16."""
    from kernels.triton.skinny_gemm import gemv_config, skinny_linear

    x = _x(16, k, torch.bfloat16, device, seed=5)
    w8, scale = _fp8_weight(n, k, device, seed=6)
    w = fp8_ref.dequantize(w8, scale).bfloat16()
    for weights in ((w8, scale), (w,)):
        assert torch.equal(_skinny(x[:11], *weights), _skinny(x, *weights)[:11])
    # the GEMV form: within one power-of-two row block (5 rows and the graph's 8)
    w, n = w[:64], 64
    five, eight = (skinny_linear(x[:m], w, config=gemv_config(n, k, rows=m)) for m in (5, 8))
    assert torch.equal(five, eight[:5])


@cpu_interp
def test_skinny_rows_do_not_depend_on_the_batch_interpreter():
    _rows_alone_equal_rows_together("cpu")


@pytest.mark.gpu
def test_skinny_rows_do_not_depend_on_the_batch_gpu():
    _rows_alone_equal_rows_together("cuda", k=4096, n=3344)


def test_skinny_config_covers_k_once():
    """Host-side tiling at every rank-0 shape: the splits cover the K steps exactly once (no
    empty split), a K step is one scale group, the partials stay under the weight's bytes, and
    every weight of 4 MB or more is read by a few hundred programs."""
    import triton

    from kernels.triton.skinny_gemm import MAX_TOKENS, skinny_config

    for n16, n8, k in RANK0_LINEARS.values():
        for n, w_bytes in ((n16, 2), (n8, 1)):
            if n is None:
                continue
            for m in (1, 3, 8, 32, 33, MAX_TOKENS):
                cfg = skinny_config(m, n, k, w_bytes)
                steps = triton.cdiv(k, cfg.block_k)
                assert cfg.block_k == 128 and cfg.block_m >= max(m, 16), cfg
                assert (cfg.splits - 1) * cfg.steps < steps <= cfg.splits * cfg.steps, cfg
                assert cfg.splits == 1 or 8 * cfg.splits * m * n <= n * k * w_bytes, cfg
                assert cfg == skinny_config(cfg.block_m, n, k, w_bytes)  # m's bucket decides
                programs = triton.cdiv(n, cfg.block_n) * cfg.splits
                if n * k * w_bytes >= 4 * 2**20:
                    assert 128 <= programs <= 1024, (n, k, m, cfg, programs)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(RANK0_LINEARS))
def test_skinny_gpu_rank0_shapes(name):
    n16, n8, k = RANK0_LINEARS[name]
    for m in TOKENS:
        _check_dense(m, n16, k, "cuda")
        if n8 is not None:
            _check_fp8(m, n8, k, torch.bfloat16, "cuda")


@pytest.mark.gpu
def test_skinny_gpu_float32_activations():
    n, _, k = RANK0_LINEARS["mla q_b"]
    for m in (1, 33):
        _check_fp8(m, n, k, torch.float32, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8])  # 1: the dense GEMV form (its weights before the PDL wait)
def test_skinny_cuda_graph(m):
    """Split-K and single-split launches of both formats captured in one CUDA graph, replayed
    with new inputs (outputs poisoned before each replay) and twice on the same ones (equal
    bits: the counters start clean each replay)."""

    cases = []
    for name, fp8 in (("kda in_proj", True), ("dsa o_proj", False), ("kda f_b/g_b", True)):
        n16, n8, k = RANK0_LINEARS[name]
        if fp8:
            w8, scale = _fp8_weight(n8, k, "cuda", seed=n8)
            cases.append((_x(m, k, torch.bfloat16, "cuda", 0), (w8, scale)))
        else:
            w = (torch.randn(n16, k, device="cuda") * k**-0.5).bfloat16()
            cases.append((_x(m, k, torch.bfloat16, "cuda", 0), (w,)))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for x, w in cases:  # compile and allocate the counters outside the capture
            _skinny(x, *w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [_skinny(x, *w) for x, w in cases]
    for seed in (1, 2):
        for x, _ in cases:
            x.copy_(_x(m, x.shape[1], torch.bfloat16, "cuda", seed))
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _counters_zero()
        for (x, w), out in zip(cases, outs):
            if len(w) == 2:
                ref = fp8_ref.block_fp8_linear(x, *w)
                assert _rel_max(out, ref) <= 1e-2 and _rel_fro(out, ref) <= 1e-2
            else:
                ref = F.linear(x.float(), w[0].float())
                assert _rel_max(out, ref) <= 1e-2 and _rel_fro(out, ref) <= 5e-3
    before = [out.clone() for out in outs]
    for out in outs:
        out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(out, b) for out, b in zip(outs, before))


@pytest.mark.gpu
@pytest.mark.parametrize("layer", ["kda", "dsa"])
def test_fp8_stacks_equal_their_parts_gpu(layer):
    """StackedProjections at rank 0's real rows (KDA: q, k, v 1024 each, f_a and g_a 128, b 8:
    one FP8 GEMM of 3344 rows; DSA: q_a 1536, kv_a 512 and wk 128 in FP8, the kpool gate 128
    and weights_proj 4 in bf16: two GEMMs) give each part what it gives run alone, at decode
    sizes (the skinny GEMM, stacked and alone at different tilings) and at 100 tokens (the
    stack on torch._scaled_mm, KDA's 8-row b_proj alone on the Triton GEMM)."""
    from torch import nn

    from serving.layers.linear import Linear
    from serving.layers.stacked_projections import StackedProjections

    k = 4096
    gen = torch.Generator(device="cuda").manual_seed(0)
    owner = nn.Module()

    def fp8_part(name, rows, kind):
        part = Linear(k, rows, torch.bfloat16, kind=kind).cuda()
        w8, scale = fp8_ref.quantize_weight(torch.randn(rows, k, device="cuda", generator=gen))
        part.hold_fp8()
        part.weight.data.copy_(w8)
        part.weight_scale_inv.data.copy_(scale * k**-0.5)
        setattr(owner, name, part)

    if layer == "kda":
        for name, rows in zip(("q", "k", "v", "f_a", "g_a", "b"), (1024,) * 3 + (128, 128, 8)):
            fp8_part(name, rows, "kda")
        names, fp8_rows = ("q", "k", "v", "f_a", "g_a", "b"), 3344
    else:
        fp8_part("q_a", 1536, "mla")
        fp8_part("kv_a", 512, "mla")
        fp8_part("wk", 128, "indexer")
        owner.gate = nn.Parameter(
            torch.randn(128, k, device="cuda", generator=gen).bfloat16() * k**-0.5, False
        )
        owner.weights_proj = Linear(k, 4, torch.bfloat16).cuda()
        owner.weights_proj.weight.data.normal_(generator=gen)
        names, fp8_rows = ("q_a", "kv_a", "wk", "gate", "weights_proj"), 2176
    stack = StackedProjections(owner, names)
    for m in (*TOKENS, 100):
        x = _x(m, k, torch.bfloat16, "cuda", seed=m)
        if m == TOKENS[0]:
            assert stack.stack()
            assert fp8_rows in {g.weight.shape[0] for g in stack.gemms if g.scale is not None}
        with torch.no_grad():
            got = stack(x)
            alone = [
                p(x) if isinstance(p, Linear) else F.linear(x, p) for p in map(stack._part, names)
            ]
        for name, g, a in zip(names, got, alone):
            assert not g.isnan().any(), name
            assert _rel_max(g, a) <= 1e-2 and _rel_fro(g, a) <= 1e-2, (name, m)

"""Block-FP8 kernels (kernels/triton/fp8.py; experts_fp8 in kernels/triton/moe.py) against the
torch references (kernels/fp8.py; kernels.moe.experts_fp8) and the dequantized weights.

GPU cases (`@pytest.mark.gpu`) run GLM-5.3-Flash's real shapes (every quantized projection at
TP1; the routed experts: hidden 4096, 288 experts top-8, intermediate 2048) and the bench
preset's experts. CPU cases run only under TRITON_INTERPRET=1 (tiny, odd shapes) and skip
otherwise.

Tolerances, relative to the reference's largest magnitude unless said:
- quantize_act (and the quantization fused into the Triton GEMM): equal values and scales, GPU
  and interpreter, bf16 and float32 inputs (both sides divide with IEEE rounding and round
  x * (448 / amax) to nearest-even on the e4m3 grid; kernels/triton/fp8.py rounds by hand).
  The first GPU run failed here: the reference's `448 / amax` was amax.reciprocal() * 448 (and,
  on CUDA, `amax / 448` a multiplication by a host reciprocal), an ulp off in a fifth of the
  groups, which moved every e4m3 tie of those groups one step: that, not the GEMM, was the
  1.2-1.7% linear error (K = 128: one group per row) and the 1.7% MoE error.
- block_fp8_linear (either GEMM: Triton or torch._scaled_mm) vs the W8A8 reference (same
  quantized operands, fp32 accumulation in another order): float32 inputs 1e-5; bf16 outputs
  1e-2 max (where the two fp32 sums straddle a bf16 rounding boundary the outputs differ by one
  bf16 ulp, at most 2^-7 = 7.8e-3 of the largest output) and 1e-2 relative Frobenius (the H200
  measured 4.7e-3 at 8,192 tokens: the bf16 output rounding alone is up to 2^-9 per element, and
  an accumulation-order difference that moves a SwiGLU or an output across a rounding boundary
  is not rare over millions of elements); 2e-2 max under the interpreter (its bf16 casts
  truncate).
- block_fp8_linear vs the dequantized reference x (W8 * S)^T in float32: 6e-2 relative
  Frobenius: the e4m3 rounding of the activation (3 mantissa bits; 2.3-3.6% measured on random
  inputs) is what W8A8 adds to the weights' own rounding.
- experts_fp8 vs the reference: float32 1e-5; bf16 2e-2 max and 1e-2 relative Frobenius
  (4.7e-3 measured on the H200 at the bench shape, 1,000 tokens):
  each of the k pair outputs and their sum is rounded to bf16 on both sides (a straddled
  rounding boundary: one ulp, at most 2^-7 of that value), and where the fp32 gate/up sums
  straddle a bf16 boundary of the SwiGLU output, which is quantized again, that element (or,
  if it is its group's amax, its group) moves an e4m3 step; both are rare at fp32 accumulation
  differences. Under the interpreter, whose bf16 casts truncate, 1e-1 and 5e-2. Vs the
  dequantized reference (kernels.moe.experts on W8 * S in float32): 8e-2 relative Frobenius
  (two activation roundings).
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from bench.kernels_moe_kda import REAL_FP8_LINEARS as REAL_LINEARS  # noqa: E402
from kernels import fp8 as fp8_ref  # noqa: E402
from kernels import moe as moe_ref  # noqa: E402
from tests.triton_interp import patch_triton_interpreter  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
cpu_interp = pytest.mark.skipif(not INTERPRET, reason="CPU cases need TRITON_INTERPRET=1")
if INTERPRET:
    patch_triton_interpreter()

# (hidden, experts, moe_intermediate, top_k)
REAL_MOE = (4096, 288, 2048, 8)
# the real experts' dequantized float reference is 29 GB: under xdist (bench/gpu_tests.sh,
# --dist loadgroup) these cases run in one process, one at a time
REAL_HBM = pytest.mark.xdist_group("real_moe")
BENCH_MOE = (2048, 64, 768, 4)


def _rel_max(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _rel_fro(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _fp8_weight(rows, cols, device, seed, std=None):
    """Random block-FP8 weight (W8, S) of a std ~ cols^-0.5 weight, made on the device."""
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(rows, cols, device=device, generator=gen) * (std or cols**-0.5)
    return fp8_ref.quantize_weight(w)


# ---------------------------------------------------------------------------------------------
# activation quantization and the linear
# ---------------------------------------------------------------------------------------------


def _check_quant(tokens, k, device, dtype=torch.float32):
    from kernels.triton.fp8 import quantize_act

    gen = torch.Generator(device="cpu").manual_seed(tokens + k)
    x = torch.randn(tokens, k, generator=gen) * torch.rand(1, k, generator=gen) * 5
    x[0, : min(k, 130)] = 0.0  # an all-zero group: scale floor, zeros out
    x = x.to(device=device, dtype=dtype)
    q_ref, s_ref = fp8_ref.quantize_act(x)
    for group_major in (False, True):
        q, s = quantize_act(x, group_major=group_major)
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        assert s.stride() == ((1, tokens) if group_major else (s.shape[1], 1))
        assert torch.equal(q.float(), q_ref.float())
        assert torch.equal(s, s_ref)


def _check_linear(m, n, k, dtype, device, interpreter=False):
    """Every GEMM that can run this shape (block_fp8_linear's choice, the Triton GEMM with the
    quantization fused, torch._scaled_mm where its probe passed) against the reference."""
    from kernels.triton import fp8 as tfp8

    w8, scale = _fp8_weight(n, k, device, seed=n + k)
    gen = torch.Generator(device="cpu").manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    ref = fp8_ref.block_fp8_linear(x, w8, scale)
    dequantized = x.float() @ fp8_ref.dequantize(w8, scale).T
    outs = {"chosen": tfp8.block_fp8_linear(x, w8, scale)}
    outs["triton"] = tfp8.block_fp8_linear_triton(x, w8, scale)
    if tfp8.scaled_mm_usable(n, k, dtype, device):
        outs["scaled_mm"] = tfp8.block_fp8_linear_scaled_mm(x, w8, scale)
    for name, out in outs.items():
        assert out.dtype == dtype and out.shape == (m, n), name
        assert not out.isnan().any(), name
        if dtype == torch.float32:
            # Hopper's FP8 MMA accumulates in reduced precision inside each 128-wide K block
            # (the kernel promotes to float32 between blocks, as DeepSeek-V3's report
            # prescribes): 2e-4 relative max measured on the H200 at 300 x 4096 x 1536; the
            # interpreter accumulates in float32
            assert _rel_max(out, ref) <= (1e-5 if interpreter else 1e-3), name
        else:
            assert _rel_max(out, ref) <= (2e-2 if interpreter else 1e-2), name
            assert _rel_fro(out, ref) <= 1e-2, name
        assert _rel_fro(out, dequantized) <= 6e-2, name
    return outs


@cpu_interp
@pytest.mark.parametrize("tokens,k", [(1, 64), (3, 48), (5, 200), (2, 256), (4, 1100)])
def test_quantize_act_interpreter(tokens, k):
    _check_quant(tokens, k, "cpu")


@cpu_interp
def test_quantize_act_interpreter_bf16_ties():
    """bf16 inputs put many values on e4m3 ties: a reference whose 448 / amax is an ulp off
    (the first GPU failure) moves them, and this fails (about 15 values here)."""
    _check_quant(16, 1024, "cpu", torch.bfloat16)


@cpu_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 48, 64), (5, 300, 200), (33, 130, 256), (3, 17, 48)])
def test_block_fp8_linear_interpreter(m, n, k, dtype):
    from kernels.triton import fp8 as tfp8

    out = _check_linear(m, n, k, dtype, "cpu", interpreter=True)["triton"]
    # the fused quantization gives the operands quantize_act gives: the same GEMM, bit for bit,
    # whichever layout the scales have
    w8, scale = _fp8_weight(n, k, "cpu", seed=n + k)
    gen = torch.Generator(device="cpu").manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(dtype=dtype)
    for group_major in (False, True):
        x8, xs = tfp8.quantize_act(x, group_major=group_major)
        assert torch.equal(tfp8.fp8_gemm(x8, xs, w8, scale, dtype), out)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_act_gpu(dtype):
    for tokens, k in ((1, 4096), (333, 1536), (8192, 4096), (7, 12288), (5, 200)):
        _check_quant(tokens, k, "cuda", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(REAL_LINEARS))
def test_block_fp8_linear_gpu_real_shapes(name):
    n, k = REAL_LINEARS[name]
    for m in (1, 37, 512):
        _check_linear(m, n, k, torch.bfloat16, "cuda")


@pytest.mark.gpu
def test_block_fp8_linear_scaled_mm_chosen():
    """On an H200 with PyTorch >= 2.9 (cuBLASLt >= 12.9), torch._scaled_mm takes the 1x128 /
    128x128 block scales: every real projection shape with K over 256 goes to it (its probe also
    checks it agrees with the Triton GEMM). cuBLASLt answers garbage at K <= 256 (measured: the
    small model's 256x64 ... 768x256 differ by 5e2 to 1e18, relative), and K = 128 (KDA's f_b/g_b)
    is refused by the probe: those stay on Triton."""
    from kernels.triton.fp8 import linear_backends

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("cuBLASLt's block-scaled FP8 is SM90 only")
    chosen = linear_backends(REAL_LINEARS.values(), torch.bfloat16, "cuda")
    print("FP8 linear backends:", chosen)
    assert {v for (n, k), v in chosen.items() if k > 256} == {"scaled_mm"}, chosen


@pytest.mark.gpu
def test_block_fp8_linear_gpu_prefill_and_float32():
    for name in ("kda q/k/v", "mla q_b", "dense down"):
        n, k = REAL_LINEARS[name]
        _check_linear(8192, n, k, torch.bfloat16, "cuda")
    _check_linear(300, 4096, 1536, torch.float32, "cuda")


@pytest.mark.gpu
def test_block_fp8_linear_cuda_graph():
    from kernels.triton.fp8 import block_fp8_linear

    n, k = REAL_LINEARS["mla q_b"]
    w8, scale = _fp8_weight(n, k, "cuda", seed=5)
    x = torch.randn(32, k, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile outside the capture
            block_fp8_linear(x, w8, scale)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block_fp8_linear(x, w8, scale)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel_max(out, fp8_ref.block_fp8_linear(x, w8, scale)) <= 1e-2


# ---------------------------------------------------------------------------------------------
# FP8 fused MoE
# ---------------------------------------------------------------------------------------------

_EXPERTS: dict = {}


def _fp8_experts(shape, device):
    """Random block-FP8 w13 (gate and up quantized apart, as the checkpoint stores them), w2
    and their scales, made expert by expert on the device and kept (the real shape is 7.2 GB)."""
    key = (shape, str(device))
    if key not in _EXPERTS:
        _EXPERTS.clear()
        hidden, experts, inter, _ = shape
        nb = fp8_ref.blocks(inter)
        w13 = torch.empty(experts, 2 * inter, hidden, device=device, dtype=fp8_ref.FP8)
        w2 = torch.empty(experts, hidden, inter, device=device, dtype=fp8_ref.FP8)
        s13 = torch.empty(experts, 2 * nb, fp8_ref.blocks(hidden), device=device)
        s2 = torch.empty(experts, fp8_ref.blocks(hidden), nb, device=device)
        for e in range(experts):
            for half in (0, 1):
                rows, blocks = (
                    slice(half * inter, (half + 1) * inter),
                    slice(half * nb, (half + 1) * nb),
                )
                w13[e, rows], s13[e, blocks] = _fp8_weight(
                    inter, hidden, device, seed=3 * e + half, std=2 * hidden**-0.5
                )
            w2[e], s2[e] = _fp8_weight(hidden, inter, device, seed=3 * e + 2)
        _EXPERTS[key] = (w13, w2, s13, s2)
    return _EXPERTS[key]


def _moe_inputs(tokens, shape, dtype, device, seed=0, skip=False):
    hidden, experts, _, top_k = shape
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    if skip:  # another EP rank's experts: id E, adding nothing
        ids[::3, 0] = experts
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    return x.to(device=device, dtype=dtype), weights.to(device), ids.to(device)


def _dequantized_w13(w13, s13):
    inter, nb = w13.shape[1] // 2, s13.shape[1] // 2
    gate = fp8_ref.dequantize(w13[:, :inter], s13[:, :nb])
    return torch.cat([gate, fp8_ref.dequantize(w13[:, inter:], s13[:, nb:])], dim=1)


def _check_moe_fp8(tokens, shape, dtype, device, interpreter=False, skip=False):
    from kernels.triton import moe as tmoe

    w13, w2, s13, s2 = _fp8_experts(shape, device)
    x, weights, ids = _moe_inputs(tokens, shape, dtype, device, seed=tokens, skip=skip)
    out = tmoe.experts_fp8(x, w13, w2, s13, s2, weights, ids, 10.0)
    assert out.dtype == dtype and out.shape == x.shape and not out.isnan().any()
    ref = moe_ref.experts_fp8(x, w13, w2, s13, s2, weights, ids, 10.0)
    if dtype == torch.float32:
        assert _rel_max(out, ref) <= 1e-5
    elif interpreter:  # its casts to bf16 truncate: every SwiGLU output moves toward zero
        assert _rel_max(out, ref) <= 1e-1 and _rel_fro(out, ref) <= 5e-2
    else:
        assert _rel_max(out, ref) <= 2e-2 and _rel_fro(out, ref) <= 1e-2
    dequantized = moe_ref.experts(
        x.float(), _dequantized_w13(w13, s13), fp8_ref.dequantize(w2, s2), weights, ids, 10.0
    )
    assert _rel_fro(out, dequantized) <= 8e-2
    return out


@cpu_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 9, 40])
@pytest.mark.parametrize("shape", [(64, 8, 32, 2), (200, 6, 136, 3)], ids=["tiny", "odd"])
def test_moe_fp8_interpreter(tokens, shape, dtype):
    _check_moe_fp8(tokens, shape, dtype, "cpu", interpreter=True, skip=True)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 32, 128, 1000])
@pytest.mark.parametrize(
    "shape",
    [pytest.param(REAL_MOE, marks=REAL_HBM, id="real"), pytest.param(BENCH_MOE, id="bench")],
)
def test_moe_fp8_gpu(shape, tokens):
    _check_moe_fp8(tokens, shape, torch.bfloat16, "cuda", skip=tokens == 32)


@pytest.mark.gpu
@REAL_HBM
@pytest.mark.parametrize("tokens", [1, 32])
def test_moe_fp8_cuda_graph(tokens):
    from kernels.triton import moe as tmoe

    w13, w2, s13, s2 = _fp8_experts(REAL_MOE, "cuda")
    x, weights, ids = _moe_inputs(tokens, REAL_MOE, torch.bfloat16, "cuda", seed=1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile outside the capture
            tmoe.experts_fp8(x, w13, w2, s13, s2, weights, ids, 10.0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tmoe.experts_fp8(x, w13, w2, s13, s2, weights, ids, 10.0)
    for seed in (2, 3):
        nx, nweights, nids = _moe_inputs(tokens, REAL_MOE, torch.bfloat16, "cuda", seed=seed)
        x.copy_(nx)
        weights.copy_(nweights)
        ids.copy_(nids)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = moe_ref.experts_fp8(x, w13, w2, s13, s2, weights, ids, 10.0)
        assert _rel_max(out, ref) <= 2e-2 and _rel_fro(out, ref) <= 1e-2


@pytest.mark.gpu
def test_fp8_choice_at_the_real_shapes(tmp_path):
    """The load-time choice (serving/models/fp8_choice.py) on this GPU, bf16, at every distinct
    projection shape of GLM-5.3-Flash at TP1 and of rank 0 at the seed's TP8/EP8, a stacked
    part at its stack's shape: FP8 and bf16 microseconds at 32 and 8,192 tokens, the GEMMs and
    the choice are printed (-s; the same line the loader logs) for docs/BENCHMARKS.md.

    Which shapes win is the GPU's answer, not the test's: in session 6 every TP8 shape lost at
    32 tokens (torch._scaled_mm plus the activation quantization: 0.4-0.7x bf16), and the skinny
    FP8 GEMM (session 14) did not change that at 32 tokens (bench.decode_gemm). The test checks
    that every shape is timed at its stack's shape and decided by the rule."""
    from serving.config import ModelConfig
    from serving.distributed import ParallelState, set_state
    from serving.models.fp8_choice import choose_linears, fp8_wins, linear_shape
    from serving.models.glm5_next import Glm5NextForCausalLM
    from serving.tools.tiny_model import write_checkpoint

    config = ModelConfig.from_pretrained(write_checkpoint(tmp_path / "real", preset="real"))
    shapes: dict[tuple[int, int], list[str]] = {}
    timed: dict[tuple[int, str], tuple[int, int]] = {}  # (tp, module path) -> timed shape
    for tp in (1, 8):
        set_state(ParallelState(0, tp, tp))
        try:
            with torch.device("meta"):
                target = Glm5NextForCausalLM(config, torch.bfloat16)
        finally:
            set_state(ParallelState())
        for path, module in target.named_modules():
            if (shape := linear_shape(module)) is not None:
                shapes.setdefault(shape, []).append(f"tp{tp} {path}")
                timed[(tp, path)] = shape
    choice = choose_linears(shapes, torch.bfloat16, "cuda", "timed")
    for t in choice.timings:
        speedup = [round(d / f, 2) for f, d in zip(t.fp8_us, t.dense_us)]
        print(
            "fp8 choice", t.shape, t.gemm, t.fp8_us, t.dense_us, speedup, "fp8" if t.fp8 else "bf16"
        )
    assert {t.shape for t in choice.timings} == set(shapes)
    kda_stack = next(s for (tp, p), s in timed.items() if tp == 8 and p.endswith("attn.b_proj"))
    assert kda_stack == (3344, 4096)  # q, k, v, f_a, g_a and b: one GEMM, padded to 16 rows
    for t in choice.timings:  # every shape decided by the rule from its own timings
        assert t.fp8 == fp8_wins(t.fp8_us, t.dense_us) and min(t.fp8_us + t.dense_us) > 0
    assert choice.dense_shapes == {t.shape for t in choice.timings if not t.fp8}

"""Triton MoE and fla-core KDA (kernels/triton) against the torch references in kernels/.

GPU cases (`@pytest.mark.gpu`) run the bench preset's and the real GLM-5.3-Flash shapes on
CUDA. CPU cases run only under TRITON_INTERPRET=1 (Triton's interpreter, tiny shapes) and skip
otherwise. Inputs are random (never zeros); freshly allocated outputs come from memory that was
filled with NaN just before (see _poison), and in-place state tensors hold many random rows of
which only a few, non-contiguous, are touched.

Tolerances (relative to the reference's largest magnitude, on the same inputs):
- float32 MoE: 1e-5 (IEEE fp32 dots).
- bf16 MoE: 2e-2 max abs, 1e-2 relative Frobenius, against the float32 reference on the
  bf16-rounded inputs (the kernel rounds the SwiGLU intermediate and each pair's output to
  bf16; the torch bf16 path rounds gate/up, the product and the running sum too).
- KDA float32: 1e-4 for the fused recurrent paths (elementwise fp32); on CUDA the chunked path
  uses TF32 dots inside fla, so 5e-3 there; 2e-4 under the interpreter.
- KDA bf16 inputs: 2e-2 on the fused recurrent paths (fp32 math, bf16 output); the chunked
  path (fla normalises q/k into bf16 and uses bf16 dots) 4e-2 max and 1e-2 relative Frobenius;
  for float32 inputs there 5e-3 max and 4e-3 relative Frobenius (TF32 dots: unit roundoff
  2^-11; an H200 measured 1.2e-3 and 1.8e-3 over 4,001 tokens).
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kernels import kda as kda_ref  # noqa: E402
from kernels import moe as moe_ref  # noqa: E402
from tests.triton_interp import patch_triton_interpreter  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()

cpu_interp = pytest.mark.skipif(not INTERPRET, reason="CPU cases need TRITON_INTERPRET=1")


if INTERPRET:
    patch_triton_interpreter()


def _poison(device) -> None:
    """Fill recently freed allocator memory with NaN so that torch.empty outputs start as NaN."""
    if torch.device(device).type == "cuda":
        junk = torch.full((64 << 20,), float("nan"), device=device)  # 256 MiB
        del junk


def _dev() -> str:
    return "cuda" if HAS_CUDA and not INTERPRET else "cpu"


# ---------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------

# (hidden, experts, moe_intermediate, top_k)
TINY = (64, 8, 32, 2)  # serving/tools/tiny_model.py's tiny preset
BENCH = (2048, 64, 768, 4)  # bench preset
REAL = (4096, 288, 2048, 8)  # GLM-5.3-Flash
# a real-shape case holds 15 GB of bf16 experts and 29 GB more for the float reference: under
# xdist (bench/gpu_tests.sh, --dist loadgroup) these cases run in one process, one at a time
REAL_HBM = pytest.mark.xdist_group("real_moe")


_EXPERT_WEIGHTS: dict = {}


def _expert_weights(shape, dtype, device):
    """Random w13, w2, made on the device and kept: the real shape is 14.5 GB in bf16."""
    key = (shape, dtype, str(device))
    if key not in _EXPERT_WEIGHTS:
        if len(_EXPERT_WEIGHTS) >= 2:
            _EXPERT_WEIGHTS.clear()
        hidden, experts, inter, _ = shape
        gen = torch.Generator(device=device).manual_seed(1234)
        w13 = torch.randn(experts, 2 * inter, hidden, generator=gen, device=device, dtype=dtype)
        w13 *= hidden**-0.5 * 2
        w2 = torch.randn(experts, hidden, inter, generator=gen, device=device, dtype=dtype)
        w2 *= inter**-0.5
        _EXPERT_WEIGHTS[key] = (w13, w2)
    return _EXPERT_WEIGHTS[key]


def _moe_inputs(tokens, shape, dtype, device, skew=False, seed=0):
    hidden, experts, inter, top_k = shape
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13, w2 = _expert_weights(shape, dtype, device)
    if skew:  # most tokens on the same few experts: long segments, many empty experts
        base = torch.arange(top_k).expand(tokens, top_k)
        ids = (base + (torch.rand(tokens, 1, generator=gen) < 0.2).long() * top_k) % experts
    else:
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    return x.to(device=device, dtype=dtype), w13, w2, weights.to(device), ids.to(device)


def _check_moe(out, x, w13, w2, weights, ids, limit):
    assert not out.isnan().any()
    assert out.dtype == x.dtype and out.shape == x.shape
    ref = moe_ref.experts(x.float(), w13.float(), w2.float(), weights, ids, limit)
    scale = ref.abs().max().item()
    err = (out.float() - ref).abs().max().item()
    if scale == 0:  # every pair on another rank (EP): this rank adds exactly nothing
        assert not out.any(), out.abs().max()
    elif x.dtype == torch.float32:
        assert err <= 1e-5 * scale, (err, scale)
    else:
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert err <= 2e-2 * scale and rel <= 1e-2, (err, rel, scale)


def _run_moe(tokens, shape, dtype, device, limit, skew=False, align_max=None, monkeypatch=None):
    from kernels.triton import moe as tmoe

    if align_max is not None:
        monkeypatch.setattr(tmoe, "ALIGN_KERNEL_MAX_PAIRS", align_max)
    inputs = _moe_inputs(tokens, shape, dtype, device, skew=skew, seed=tokens)
    _poison(device)
    out = tmoe.experts(*inputs, limit)
    _check_moe(out, *inputs, limit)


@cpu_interp
@pytest.mark.parametrize("tokens", [1, 15, 16, 53])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("align", ["kernel", "torch"])
def test_moe_interpreter_tiny(tokens, dtype, align, monkeypatch):
    # limit 0.7 clamps a good share of gate and up values
    align_max = 10**9 if align == "kernel" else 0
    _run_moe(tokens, TINY, dtype, "cpu", 0.7, align_max=align_max, monkeypatch=monkeypatch)


@cpu_interp
@pytest.mark.parametrize("align", ["kernel", "torch"])
def test_moe_interpreter_skewed_odd_shapes(align, monkeypatch):
    # dims that are not multiples of the tiles, 3 of 5 experts, most tokens on two experts
    align_max = 10**9 if align == "kernel" else 0
    _run_moe(40, (48, 5, 40, 3), torch.float32, "cpu", 1.0, True, align_max, monkeypatch)


def _check_align(tokens, experts, top_k, block_m, device):
    from kernels.triton import moe as tmoe

    gen = torch.Generator(device="cpu").manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    ids = ids.to(device)
    num_blocks = tmoe.max_padded_rows(ids.numel(), experts, block_m) // block_m
    ref = tmoe._align_torch(ids, experts, block_m, num_blocks)
    got = tmoe.moe_align(ids, experts, block_m)  # the one-program kernel at these sizes
    names = ["sorted", "block_expert", "seg_start", "counts", "row_of_pair"]
    for name, a, b in zip(names, got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
    _, block_expert, seg_start, counts, _ = ref
    assert torch.equal(got[4], ref[4])
    pair_ids = torch.arange(ids.numel(), device=device, dtype=torch.int32)
    assert torch.equal(got[0][got[4].long()], pair_ids)
    assert torch.equal(got[1], block_expert) and torch.equal(got[2], seg_start)
    assert torch.equal(got[3], counts)
    rows = torch.arange(num_blocks * block_m, device=device)
    expert_of_row = block_expert.repeat_interleave(block_m).long()
    live = expert_of_row < experts
    valid = torch.zeros_like(live)
    valid[live] = (rows[live] - seg_start[expert_of_row[live]]) < counts[expert_of_row[live]]
    assert torch.equal(got[0][valid], ref[0][valid])
    assert int(valid.sum()) == ids.numel()
    # every pair once, under its own expert (order within an expert: equal to the stable sort)
    pairs = got[0][valid].long()
    assert torch.equal(pairs.sort().values, torch.arange(ids.numel(), device=device))
    assert torch.equal(ids.flatten()[pairs], expert_of_row[valid])


def _run_moe_skipping(tokens, shape, dtype, device, align, monkeypatch):
    """EP's pairs: about 3/4 of the ids are E (another rank's experts), half of those past E.
    Both aligns give them no row (row_of_pair -1, counts and sorted rows of the kept pairs
    only) and the fused MoE equals the reference, which skips them too."""
    from kernels.triton import moe as tmoe

    monkeypatch.setattr(tmoe, "ALIGN_KERNEL_MAX_PAIRS", 10**9 if align == "kernel" else 0)
    x, w13, w2, weights, ids = _moe_inputs(tokens, shape, dtype, device, seed=tokens)
    experts = shape[1]
    gen = torch.Generator(device="cpu").manual_seed(7)
    skip = (torch.rand(ids.shape, generator=gen) < 0.75).to(device)
    ids = ids.masked_fill(skip, experts)
    far = ids.masked_fill(skip & (torch.rand(ids.shape, generator=gen) < 0.5).to(device), 300)
    got = tmoe.moe_align(far, experts, 16)
    sorted_ids, block_expert, seg_start, counts, row_of_pair = got
    kept = ~skip.flatten()
    assert torch.equal(row_of_pair[~kept], torch.full_like(row_of_pair[~kept], -1))
    assert torch.equal(counts.long(), torch.bincount(ids[~skip], minlength=experts)[:experts])
    pair_ids = torch.arange(ids.numel(), device=device, dtype=torch.int32)
    assert torch.equal(sorted_ids[row_of_pair[kept].long()], pair_ids[kept])
    _poison(device)
    out = tmoe.experts(x, w13, w2, weights, far, 10.0)
    _check_moe(out, x, w13, w2, weights, ids, 10.0)


@cpu_interp
@pytest.mark.parametrize("align", ["kernel", "torch"])
def test_moe_interpreter_skips_other_ranks_experts(align, monkeypatch):
    _run_moe_skipping(9, (48, 5, 40, 3), torch.float32, "cpu", align, monkeypatch)


@cpu_interp
@pytest.mark.parametrize("tokens, shape", [(1, REAL), (5, REAL), (33, BENCH)])
def test_moe_align_interpreter(tokens, shape):
    _check_align(tokens, shape[1], shape[3], 16, "cpu")


@cpu_interp
@pytest.mark.parametrize("tokens", [2, 8])
def test_moe_align_interpreter_rank_experts(tokens):
    # rank 0's 36 local experts at decode batches: tiles as tall as the pairs and blocks (16
    # and 64 rows), not the 256 the kernel takes for 2,048 pairs
    _check_align(tokens, 36, 8, 16, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 32, 128, 256])
@pytest.mark.parametrize("block_m", [16, 64])
def test_moe_align_gpu(tokens, block_m):
    _check_align(tokens, REAL[1], REAL[3], block_m, "cuda")


@cpu_interp
@pytest.mark.parametrize(
    "tokens, shape",
    [
        (40, (256, 16, 96, 4)),  # 10 pairs per expert: BLOCK_M 16, narrowed N tiles
        (120, (128, 16, 64, 4)),  # 30: BLOCK_M 32
        (200, (256, 16, 128, 4)),  # 50: BLOCK_M 64, several K steps
        (600, (128, 4, 64, 4)),  # 600: BLOCK_M 128, torch align (2,400 pairs)
    ],
)
def test_moe_interpreter_tile_configs(tokens, shape):
    from kernels.triton import moe as tmoe

    hidden, experts, inter, top_k = shape
    cfg = tmoe.moe_config(tokens * top_k, experts, hidden, inter, torch.bfloat16)
    assert cfg.block_m == {40: 16, 120: 32, 200: 64, 600: 128}[tokens]
    _run_moe(tokens, shape, torch.bfloat16, "cpu", 2.0)


# GPU cases, one per tile regime and dtype path (30 before: 3 shapes x 5 batches x 2 dtypes,
# the real shape in float32 alone 29 GB of weights; the tiny shape runs under the interpreter)
MOE_GPU_CASES = [
    (BENCH, 1, torch.float32),
    (BENCH, 53, torch.float32),
    (BENCH, 4001, torch.float32),
    (BENCH, 15, torch.bfloat16),
    (BENCH, 16, torch.bfloat16),
    (BENCH, 4001, torch.bfloat16),
    pytest.param(REAL, 1, torch.bfloat16, marks=REAL_HBM),
    pytest.param(REAL, 53, torch.bfloat16, marks=REAL_HBM),
    pytest.param(REAL, 4001, torch.bfloat16, marks=REAL_HBM),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape, tokens, dtype", MOE_GPU_CASES)
def test_moe_gpu(shape, tokens, dtype):
    _run_moe(tokens, shape, dtype, "cuda", 10.0)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8192])
def test_moe_gpu_skips_other_ranks_experts(tokens, monkeypatch):
    """Rank 0 of EP8 at the real size: 36 local experts, 7/8 of the pairs elsewhere."""
    shape = (REAL[0], 36, REAL[2], REAL[3])
    _run_moe_skipping(
        tokens, shape, torch.bfloat16, "cuda", "torch" if tokens > 256 else "kernel", monkeypatch
    )


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 128, 8192])
def test_moe_gpu_skewed_and_clamped(tokens):
    _run_moe(tokens, BENCH, torch.bfloat16, "cuda", 0.7, skew=True)


@pytest.mark.gpu
@REAL_HBM
@pytest.mark.parametrize("tokens", [1, 32])
@pytest.mark.parametrize("shape", [REAL], ids=["real"])
@pytest.mark.parametrize("align", ["kernel", "torch"])
def test_moe_cuda_graph(tokens, shape, align, monkeypatch):
    from kernels.triton import moe as tmoe

    if align == "torch":
        monkeypatch.setattr(tmoe, "ALIGN_KERNEL_MAX_PAIRS", 0)
    x, w13, w2, weights, ids = _moe_inputs(tokens, shape, torch.bfloat16, "cuda", seed=1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile outside the capture
            tmoe.experts(x, w13, w2, weights, ids, 10.0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tmoe.experts(x, w13, w2, weights, ids, 10.0)
    for seed in (2, 3):
        nx, _, _, nweights, nids = _moe_inputs(tokens, shape, torch.bfloat16, "cuda", seed=seed)
        x.copy_(nx)
        weights.copy_(nweights)
        ids.copy_(nids)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check_moe(out, x, w13, w2, weights, ids, 10.0)


# ---------------------------------------------------------------------------------------------
# KDA: causal conv
# ---------------------------------------------------------------------------------------------


def _conv_inputs(total, chans, kernel, num_rows, dtype, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(total, chans, generator=gen).to(device=device, dtype=dtype)
    weight = torch.randn(chans, kernel, generator=gen).to(device)
    conv_state = torch.randn(num_rows, chans, kernel - 1, generator=gen).to(device, dtype)
    return x, weight, conv_state


def _rows(n, num_rows, device):
    # non-contiguous, unsorted, some beyond a small running count
    picks = [num_rows - 1, 2, num_rows - 4, 5, 1, num_rows - 2, 7, 9]
    if n > len(picks):  # a seeded shuffle of twice as many rows as the batch
        assert num_rows >= 2 * n
        picks = torch.randperm(num_rows, generator=torch.Generator().manual_seed(n)).tolist()
    return torch.tensor(picks[:n], device=device)


def _check_close(out, ref, tol, what, rel=None):
    """max |out - ref| <= tol * max |ref|; with rel, also ||out - ref|| <= rel * ||ref||."""
    assert not out.isnan().any(), what
    scale = max(ref.abs().max().item(), 1e-6)
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol * scale, (what, err, scale)
    if rel is not None:
        ratio = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert ratio <= rel, (what, ratio)


def _run_conv(mode, lens, chans, dtype, device, with_history):
    from kernels.triton import kda as tkda

    kernel, num_rows = 4, 16
    x, weight, state = _conv_inputs(sum(lens), chans, kernel, num_rows, dtype, device)
    rows = _rows(len(lens), num_rows, device)
    state_ref = state.clone()
    hist, hist_ref = ([], []) if with_history else (None, None)
    _poison(device)
    if mode == "extend":
        out = tkda.causal_conv_extend(x, weight, state, rows, lens, hist)
        ref = kda_ref.causal_conv_extend(x, weight, state_ref, rows, lens, hist_ref)
    elif mode == "uniform":
        out = tkda.causal_conv_uniform(x, weight, state, rows, lens[0], hist)
        ref = kda_ref.causal_conv_uniform(x, weight, state_ref, rows, lens[0], hist_ref)
    else:
        out = tkda.causal_conv_decode(x, weight, state, rows)
        ref = kda_ref.causal_conv_decode(x, weight, state_ref, rows)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    _check_close(out, ref, tol, "conv out")
    assert out.dtype == ref.dtype
    assert torch.equal(state, state_ref), "conv state (every row)"
    if with_history:
        _check_close(hist[0], hist_ref[0], 0, "conv history")


@cpu_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_interpreter(dtype):
    _run_conv("extend", [1, 15, 16, 53, 2], 24, dtype, "cpu", False)
    _run_conv("extend", [1, 3, 2], 24, dtype, "cpu", True)
    _run_conv("uniform", [3, 3, 3], 24, dtype, "cpu", True)
    _run_conv("uniform", [2] * 4, 24, dtype, "cpu", False)
    _run_conv("decode", [1] * 5, 24, dtype, "cpu", False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_gpu(dtype):
    chans = 3 * 64 * 128  # real shape: q, k, v of 64 heads x 128
    _run_conv("extend", [1, 15, 16, 53, 4001], chans, dtype, "cuda", False)
    _run_conv("extend", [1, 15, 4], chans, dtype, "cuda", True)
    _run_conv("uniform", [4] * 8, chans, dtype, "cuda", True)
    _run_conv("uniform", [3] * 8, chans, dtype, "cuda", False)
    _run_conv("decode", [1] * 8, chans, dtype, "cuda", False)


def _run_conv_strided(lens, chans, dtype, device, extra=40):
    """The extend conv on a column view of a wider tensor (q | k | v as the first columns of the
    stacked input projection's output, rows wider than the conv's channels; `extra` more
    columns: a row stride that is an odd multiple of 8, as the KDA projection's, or odd)."""
    from kernels.triton import kda as tkda

    kernel, num_rows = 4, 16
    wide, weight, state = _conv_inputs(sum(lens), chans + extra, kernel, num_rows, dtype, device)
    x, weight, state = wide[:, :chans], weight[:chans].contiguous(), state[:, :chans].contiguous()
    rows = _rows(len(lens), num_rows, device)
    state_ref = state.clone()
    _poison(device)
    out = tkda.causal_conv_extend(x, weight, state, rows, lens)
    ref = kda_ref.causal_conv_extend(x.contiguous(), weight, state_ref, rows, lens)
    _check_close(out, ref, 1e-5 if dtype == torch.float32 else 1e-2, "strided conv out")
    assert out.is_contiguous() and torch.equal(state, state_ref), "conv state (every row)"


@cpu_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_interpreter_strided_input(dtype):
    _run_conv_strided([1, 15, 16, 2, 53], 24, dtype, "cpu")  # row stride 64
    _run_conv_strided([1, 15, 53], 24, dtype, "cpu", extra=41)  # 65: one element aligned


@pytest.mark.gpu
def test_conv_gpu_strided_input():
    _run_conv_strided([1, 15, 53, 4001], 3 * 8 * 128, torch.bfloat16, "cuda")  # rank 0 of TP8


def _run_conv_qkv(lens, heads, dim, dtype, device, with_history):
    """conv_qkv_extend (the conv writing q, k, v apart, q and k l2-normed) on a column view of
    the stacked projection's output, against the reference's conv + l2norm."""
    from kernels.triton import kda as tkda

    kernel, num_rows, chans = 4, 16, 3 * heads * dim
    wide, weight, state = _conv_inputs(sum(lens), chans + 24, kernel, num_rows, dtype, device)
    x, weight, state = wide[:, :chans], weight[:chans].contiguous(), state[:, :chans].contiguous()
    rows = _rows(len(lens), num_rows, device)
    state_ref = state.clone()
    hist, hist_ref = ([], []) if with_history else (None, None)
    _poison(device)
    out = tkda.conv_qkv_extend(x, weight, state, rows, lens, heads, hist)
    ref = kda_ref.conv_qkv_extend(x, weight, state_ref, rows, lens, heads, hist_ref)
    assert out.shape == ref.shape == (3, sum(lens), heads, dim) and out.dtype == ref.dtype
    assert out[0].is_contiguous() and out[2].is_contiguous()
    # float32: the sums' order; bf16: the same rounded conv output, normed: an ulp or two
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for i, name in enumerate("qkv"):
        _check_close(out[i], ref[i], tol, f"conv {name}")
    assert torch.equal(state, state_ref), "conv state (every row)"
    if with_history:
        _check_close(hist[0], hist_ref[0], 0, "conv history")


@cpu_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_qkv_interpreter(dtype):
    _run_conv_qkv([1, 15, 16, 53, 2], 2, 16, dtype, "cpu", False)
    _run_conv_qkv([1, 3, 2], 3, 8, dtype, "cpu", True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_qkv_gpu(dtype):
    _run_conv_qkv([1, 15, 16, 53, 8192], 8, 128, dtype, "cuda", False)  # rank 0 of TP8
    _run_conv_qkv([1, 15, 4], 8, 128, dtype, "cuda", True)


def test_kda_extend_qk_normed_skips_only_the_norm():
    """kda_extend(qk_normed=True) on l2-normed q, k is kda_extend on the raw ones (float32)."""
    gen = torch.Generator().manual_seed(7)
    heads, dim, lens = 2, 8, [3, 5]
    q, k, v = (torch.randn(sum(lens), heads, dim, generator=gen) for _ in range(3))
    g = -torch.rand(sum(lens), heads, dim, generator=gen)
    beta = torch.rand(sum(lens), heads, generator=gen)
    state = torch.randn(4, heads, dim, dim, generator=gen) * 0.1
    rows = torch.tensor([3, 1])
    s1, s2 = state.clone(), state.clone()
    norm = lambda t: t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    out = kda_ref.kda_extend(norm(q), norm(k), v, g, beta, s1, rows, lens, qk_normed=True)
    ref = kda_ref.kda_extend(q, k, v, g, beta, s2, rows, lens)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s1, s2, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# KDA: the extend core's pieces around fla (the gated norm, the joined q | k | v view)
# ---------------------------------------------------------------------------------------------


def _run_gated_norm(tokens, heads, dim, dtype, device):
    from kernels.triton import kda as tkda

    gen = torch.Generator().manual_seed(4)
    o = (torch.randn(tokens, heads, dim, generator=gen) * 3).to(device, dtype)
    gate = (torch.randn(tokens, heads * dim, generator=gen) * 2).to(device, dtype)
    o_norm = (torch.rand(dim, generator=gen) + 0.5).to(device)
    _poison(device)
    out = tkda.gated_norm(o, gate, o_norm, 1e-5)
    ref = kda_ref.gated_norm(o, gate, o_norm, 1e-5)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    # float32: the sums' order; bf16: one rounding of the same float32 value, at most an ulp
    _check_close(out, ref, 1e-5 if dtype == torch.float32 else 8e-3, "gated norm")


@cpu_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_pieces_interpreter(dtype):
    _run_gated_norm(19, 3, 16, dtype, "cpu")
    _run_gated_norm(5, 2, 24, dtype, "cpu")  # D not a power of two: masked columns


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_pieces_gpu(dtype):
    _run_gated_norm(8192, 8, 128, dtype, "cuda")  # rank 0 of TP8: 8 heads x 128


def test_joined_columns_is_a_view_of_adjacent_parts():
    from serving.layers.attention.kda import joined_columns

    y = torch.randn(7, 3 * 16 + 10)
    q, k, v, rest = y.split([16, 16, 16, 10], dim=-1)
    joined = joined_columns(q, k, v)
    assert joined.data_ptr() == y.data_ptr() and joined.stride() == y.stride()
    assert torch.equal(joined, torch.cat([q, k, v], dim=-1))
    for parts in ((q, v, k), (q, k, rest), (q.contiguous(), k, v)):  # not side by side
        joined = joined_columns(*parts)
        assert joined.is_contiguous() and torch.equal(joined, torch.cat(parts, dim=-1))


def test_kda_extend_gate_applies_forget_gate():
    """kda_extend(gate=) on the forget gate's logits is kda_extend on forget_gate's decay."""
    gen = torch.Generator().manual_seed(6)
    heads, dim, lens = 2, 8, [3, 5]
    q, k, v, f = (torch.randn(sum(lens), heads, dim, generator=gen) for _ in range(4))
    beta = torch.rand(sum(lens), heads, generator=gen)
    state = torch.randn(4, heads, dim, dim, generator=gen) * 0.1
    rows = torch.tensor([3, 1])
    for lower_bound in (-5.0, None):
        gate = kda_ref.ForgetGate(torch.randn(heads * dim, generator=gen), torch.randn(heads),
                                  lower_bound)  # fmt: skip
        g = kda_ref.forget_gate(f.flatten(1), *gate, heads)
        s1, s2 = state.clone(), state.clone()
        out = kda_ref.kda_extend(q, k, v, f, beta, s1, rows, lens, gate=gate)
        ref = kda_ref.kda_extend(q, k, v, g, beta, s2, rows, lens)
        assert torch.equal(out, ref) and torch.equal(s1, s2)


# ---------------------------------------------------------------------------------------------
# KDA: a layer's decode core in one kernel, against the layer's unfused torch path
# ---------------------------------------------------------------------------------------------


def _kda_layer(heads, dim, dtype, lower_bound, fp8, seed):
    """A KDA layer (this rank's heads x dim) with random weights; fp8: f_b_proj and g_b_proj
    held in block FP8, as a CUDA load of an FP8 checkpoint under --fp8-linears all holds them."""
    from kernels.fp8 import quantize_weight
    from serving.config import ModelConfig
    from serving.models.kda import KDAttention
    from serving.tools.tiny_model import build_config

    raw = build_config("tiny", {"<|endoftext|>": 0, "<|user|>": 1, "<|observation|>": 2})
    raw["text_config"].update(
        linear_num_heads=heads, linear_head_dim=dim, linear_lower_bound=lower_bound
    )
    config = ModelConfig.from_dict(raw)
    gen = torch.Generator().manual_seed(seed)
    layer = KDAttention(config, dtype)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            scale = {"A_log": 0.5, "dt_bias": 1.0, "o_norm": 0.2}.get(name, p.shape[-1] ** -0.5)
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (name == "o_norm"))
        for linear in (layer.f_b_proj, layer.g_b_proj) if fp8 else ():
            w8, w_scale = quantize_weight(linear.weight.float())
            linear.hold_fp8()
            linear.weight.copy_(w8)
            linear.weight_scale_inv.copy_(w_scale)
    return config, layer


def _kda_step_inputs(config, heads, dim, batch, step_len, num_rows, dtype, dev, seed=1):
    """x, the layer's cache (random conv and recurrent states) and a decode (step_len 1) or
    verify batch over `batch` non-contiguous rows."""
    from serving.forward_batch import ForwardBatch
    from serving.memory.cache import KDALayerCache

    g = torch.Generator().manual_seed(seed)
    width, ksize = 3 * heads * dim, config.linear_conv_kernel_dim
    x = torch.randn(batch * step_len, config.hidden_size, generator=g).to(dev, dtype)
    conv = torch.randn(num_rows, width, ksize - 1, generator=g).to(dev, dtype)
    state = (torch.randn(num_rows, heads, dim, dim, generator=g) * 0.1).to(dev)
    rows = _rows(batch, num_rows, dev)
    req_to_token = torch.zeros(num_rows, 8, dtype=torch.int64, device=dev)
    if step_len > 1:
        starts = torch.full((batch,), 3, device=dev)
        ids = torch.zeros(batch * step_len, dtype=torch.int64, device=dev)
        fb = ForwardBatch.uniform(ids, rows, starts, step_len, req_to_token, 8)
    else:
        fb = ForwardBatch.build([0] * batch, rows.tolist(), [3] * batch, [1] * batch,
                                req_to_token)  # fmt: skip
    return x, KDALayerCache(conv, state), fb


def _run_kda_decode_layer(
    heads, dim, batch, dtype, device, lower_bound, tol, step_len=1, fp8=False
):
    """The fused decode (kernels/triton/kda.py kda_decode_layer, f_b_proj and g_b_proj inside)
    on `device` against KDAttention.forward on the CPU (the torch path: kernels.kda's
    kda_decode_layer, same dtype), from the same weights, tokens and states: the layer's output,
    its conv and recurrent states, and rows outside the batch untouched. step_len > 1 is a
    verify step: every request adds step_len tokens and both record the roll-back's history,
    compared too."""
    from kernels.triton import kda as tkda

    config, layer = _kda_layer(heads, dim, dtype, lower_bound, fp8, heads * dim + batch)
    num_rows, width = max(16, 2 * batch), 3 * heads * dim
    ksize = config.linear_conv_kernel_dim
    verify = step_len > 1
    shape = (config, heads, dim, batch, step_len, num_rows, dtype)
    x, cache_ref, fb_ref = _kda_step_inputs(*shape, "cpu")
    hist_ref, hist = ([], []) if verify else (None, None)
    with torch.no_grad():
        ref = layer.forward(x, fb_ref, cache_ref, hist_ref)
        layer.to(device)
        x, cache, fb = _kda_step_inputs(*shape, device)
        conv0, state0 = cache.conv.clone(), cache.state.clone()
        _poison(device)
        q, k, v, f_a, g_a, b = layer.in_proj(x)
        core = tkda.kda_decode_layer(
            q, k, v, f_a, b, g_a, layer.core_weights(), cache.conv, cache.state, fb.req_rows,
            step_len, hist,
        )  # fmt: skip
        out = layer.o_proj(core)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    _check_close(out.cpu(), ref, tol, "layer out")
    rows = fb.req_rows
    untouched = torch.ones(num_rows, dtype=torch.bool, device=device)
    untouched[rows] = False
    assert torch.equal(cache.conv[untouched], conv0[untouched]), "conv rows outside the batch"
    assert torch.equal(cache.state[untouched], state0[untouched]), "states outside the batch"
    # the conv state holds inputs: shifted by step_len, this device's projections last (exactly)
    inputs_now = torch.cat([q, k, v], -1).to(cache.conv.dtype).view(batch, step_len, width)
    window = torch.cat([conv0[rows], inputs_now.transpose(1, 2)], -1)
    assert torch.equal(cache.conv[rows], window[:, :, -(ksize - 1) :]), "conv state"
    _check_close(cache.state.cpu()[rows.cpu()], cache_ref.state[rows.cpu()], tol, "state")
    if verify:
        (conv_hist, state_hist), (conv_hist_ref, state_hist_ref) = hist, hist_ref
        assert conv_hist.shape == conv_hist_ref.shape and conv_hist.dtype == conv_hist_ref.dtype
        assert torch.equal(conv_hist, window.to(conv_hist.dtype)), "conv history"
        assert state_hist.shape == state_hist_ref.shape
        _check_close(state_hist.cpu(), state_hist_ref, tol, "state history")


@cpu_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_kda_decode_layer_interpreter(dtype, lower_bound, monkeypatch):
    """One program per head here (the interpreter's time grows with the programs, 5x at four
    splits); the split core: the test below."""
    from kernels.triton import kda as tkda

    monkeypatch.setattr(tkda, "DV_SPLITS_MAX", 1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for batch in (1, 3, 8):
        _run_kda_decode_layer(2, 16, batch, dtype, "cpu", lower_bound, tol)
    _run_kda_decode_layer(3, 24, 1, dtype, "cpu", lower_bound, tol)  # D not a power of 2
    _run_kda_decode_layer(2, 16, 3, dtype, "cpu", lower_bound, tol, step_len=2)  # verify
    _run_kda_decode_layer(3, 24, 2, dtype, "cpu", lower_bound, tol, step_len=4)
    _run_kda_decode_layer(2, 16, 12, dtype, "cpu", lower_bound, tol, step_len=2)  # > 8 rows


@cpu_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kda_decode_layer_interpreter_split_heads(dtype):
    """The fused core with each head's state columns split four ways (what small batches get;
    the tests above hold one program per head), decode and verify, a head size that is not a
    power of two; the split's counters are left zero."""
    from kernels.triton import kda as tkda

    assert tkda.dv_splits(1, 2, 16) == 4 and tkda.dv_splits(64, 8, 128) == 1
    assert tkda.DV_SPLITS_MAX == 4
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    _run_kda_decode_layer(2, 16, 3, dtype, "cpu", -5.0, tol)
    _run_kda_decode_layer(3, 24, 2, dtype, "cpu", None, tol, step_len=2)
    assert all(int(c.abs().sum()) == 0 for cs in tkda._DECODE_COUNTERS.values() for c in cs)


@cpu_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kda_decode_layer_interpreter_fp8_gates(dtype):
    """f_b_proj and g_b_proj in block FP8: W8A8 inside the kernel, as the Linear computes it
    (the activation's e4m3 values are bit-equal; the sums differ in order)."""
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    _run_kda_decode_layer(2, 16, 3, dtype, "cpu", -5.0, tol, fp8=True)
    _run_kda_decode_layer(3, 24, 2, dtype, "cpu", None, tol, step_len=2, fp8=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8", [False, True], ids=["dense", "fp8_gates"])
def test_kda_decode_layer_gpu(dtype, fp8):
    # CUDA GEMMs against the CPU's in the projections: float32 gets TF32-free cuBLAS rounding
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for heads, batch in ((8, 1), (8, 8), (8, 32), (16, 1), (16, 32)):  # TP8 rank 0; bench preset
        _run_kda_decode_layer(heads, 128, batch, dtype, "cuda", -5.0, tol, fp8=fp8)
    _run_kda_decode_layer(8, 128, 4, dtype, "cuda", None, tol, fp8=fp8)
    for step_len, batch in ((2, 1), (2, 32), (4, 8)):  # EAGLE's verify at 1 and 3 steps
        _run_kda_decode_layer(8, 128, batch, dtype, "cuda", -5.0, tol, step_len, fp8)


@pytest.mark.gpu
@pytest.mark.parametrize("step_len", [1, 2])
def test_kda_decode_layer_cuda_graph(step_len):
    """The fused core captured once at rank 0's shape (8 heads x 128, bf16, 8 requests) and
    replayed on fresh tokens and states: each replay equals the torch path run on the same
    fresh inputs (history buffers included for the verify)."""
    from kernels import kda as kda_ref
    from kernels.triton import kda as tkda

    heads, dim, batch, dtype = 8, 128, 8, torch.bfloat16
    config, layer = _kda_layer(heads, dim, dtype, -5.0, False, 0)
    layer.to("cuda")
    shape = (config, heads, dim, batch, step_len, 16, dtype, "cuda")
    x, cache, fb = _kda_step_inputs(*shape)
    weights = layer.core_weights()

    def core(hist):
        q, k, v, f_a, g_a, b = layer.in_proj(x)
        rows = fb.req_rows
        return tkda.kda_decode_layer(
            q, k, v, f_a, b, g_a, weights, cache.conv, cache.state, rows, step_len, hist
        )

    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            core([] if step_len > 1 else None)  # compile outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        hist = [] if step_len > 1 else None
        with torch.cuda.graph(graph):
            out = core(hist)
        for seed in (5, 6):
            nx, ncache, _ = _kda_step_inputs(*shape, seed=seed)
            x.copy_(nx)
            cache.conv.copy_(ncache.conv)
            cache.state.copy_(ncache.state)
            out.fill_(float("nan"))
            graph.replay()
            ref_hist = [] if step_len > 1 else None
            q, k, v, f_a, g_a, b = layer.in_proj(nx)
            ref = kda_ref.kda_decode_layer(
                q, k, v, f_a, b, g_a, weights, ncache.conv, ncache.state, fb.req_rows,
                step_len, ref_hist,
            )  # fmt: skip
            _check_close(out, ref, 3e-2, "graph out")
            _check_close(cache.state, ncache.state, 3e-2, "graph state")
            assert torch.equal(cache.conv, ncache.conv.to(cache.conv.dtype)), "graph conv state"
            if hist is not None:
                _check_close(hist[1], ref_hist[1], 3e-2, "graph state history")


def test_kda_decode_core_follows_fast_path(monkeypatch):
    """The decode core's kernel is chosen by kernels.fast_path in serving/layers/attention/kda.py
    (not by the tensor's device): a torch-path run on CUDA (PDSERVE_TORCH_KERNELS=1,
    kernels.torch_path()) is pure torch."""
    import kernels.kda as kda_ref
    import kernels.triton.kda as tkda
    import serving.layers.attention.kda as attention

    config, layer = _kda_layer(2, 16, torch.float32, -5.0, False, 0)
    calls = []
    for module, name in ((kda_ref, "torch"), (tkda, "triton")):
        real = module.kda_decode_layer
        monkeypatch.setattr(
            module,
            "kda_decode_layer",
            lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k),
        )
    for fast in (False, True):
        if fast and not INTERPRET:
            continue  # the Triton kernel on CPU tensors needs the interpreter
        monkeypatch.setattr(attention, "fast_path", lambda t, _fast=fast: _fast)
        x, cache, fb = _kda_step_inputs(config, 2, 16, 3, 1, 16, torch.float32, "cpu")
        with torch.no_grad():
            layer.forward(x, fb, cache)
    assert calls == (["torch", "triton"] if INTERPRET else ["torch"]), calls


@cpu_interp
@pytest.mark.parametrize("with_saves", [False, True])
def test_kda_extend_core_interpreter_matches_torch_path(monkeypatch, with_saves):
    """A ragged prefill through KDAttention (in_proj stacked) with the fast path's conv
    (conv_qkv_extend on the joined q | k | v view) and gated norm under the interpreter, against
    the torch path; the recurrence is the reference's on both (fla's has its own cases).
    with_saves: the prefix cache's snapshot passes (their conv results reassembled along the
    token dim)."""
    import kernels.triton.kda as tkda

    monkeypatch.setattr(tkda, "kda_extend", kda_ref.kda_extend)
    saves = [[(2, 1)], [], [(4, 2), (9, 3)]] if with_saves else None
    _layer_fast_against_torch(monkeypatch, [5, 1, 12], saves, 8)


def _layer_fast_against_torch(monkeypatch, lens, saves, seed):
    """A ragged prefill of three requests through KDAttention (2 heads x 16, in_proj stacked),
    the fast path against the torch path: outputs, conv and recurrent states, snapshots."""
    import serving.layers.attention.kda as attention
    from serving.forward_batch import ForwardBatch
    from serving.memory.cache import KDALayerCache

    heads, dim, num_rows = 2, 16, 16
    config, layer = _kda_layer(heads, dim, torch.float32, -5.0, False, 0)
    assert layer.in_proj.stack()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lens), config.hidden_size, generator=gen)
    conv = torch.randn(num_rows, 3 * heads * dim, 3, generator=gen)
    state = torch.randn(num_rows, heads, dim, dim, generator=gen) * 0.1
    rows = _rows(len(lens), num_rows, "cpu").tolist()
    req_to_token = torch.zeros(num_rows, max(lens) + 16, dtype=torch.int64)
    fb = ForwardBatch.build([0] * sum(lens), rows, [0] * 3, lens, req_to_token, saves=saves)
    outs, caches = [], []
    for fast in (True, False):
        monkeypatch.setattr(attention, "fast_path", lambda t, _fast=fast: _fast)
        cache = KDALayerCache(conv.clone(), state.clone(), conv.clone(), state.clone())
        with torch.no_grad():
            outs.append(layer(x, fb, cache))
        caches.append(cache)
    _check_close(outs[0], outs[1], 1e-5, "extend out")
    for name in ("conv", "state", "saved_conv", "saved_state"):
        _check_close(getattr(caches[0], name), getattr(caches[1], name), 1e-5, name)


# ---------------------------------------------------------------------------------------------
# KDA: recurrence (fla-core)
# ---------------------------------------------------------------------------------------------


def _kda_inputs(total, heads, dim, num_rows, dtype, device, seed=0, lower_bound=-5.0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(total, heads, dim, generator=gen) for _ in range(3))
    # the model's gate: lower_bound * sigmoid(...) in (lower_bound, 0)
    g = lower_bound * torch.sigmoid(torch.randn(total, heads, dim, generator=gen) - 2.0)
    beta = torch.sigmoid(torch.randn(total, heads, generator=gen))
    state = torch.randn(num_rows, heads, dim, dim, generator=gen) * 0.1
    cast = lambda t: t.to(device=device, dtype=dtype)
    return cast(q), cast(k), cast(v), g.to(device), beta.to(device), state.to(device)


def _run_kda(mode, lens, heads, dim, dtype, device, with_history, tol, safe_gate=False, rel=None):
    from kernels.triton import kda as tkda

    num_rows = 16
    q, k, v, g, beta, state = _kda_inputs(sum(lens), heads, dim, num_rows, dtype, device)
    rows = _rows(len(lens), num_rows, device)
    state_ref = state.clone()
    hist, hist_ref = ([], []) if with_history else (None, None)
    args = (q, k, v, g, beta)
    _poison(device)
    if mode == "extend":
        out = tkda.kda_extend(*args, state, rows, lens, hist, safe_gate=safe_gate)
        ref = kda_ref.kda_extend(*args, state_ref, rows, lens, hist_ref)
    elif mode == "uniform":
        out = tkda.kda_uniform(*args, state, rows, lens[0], hist)
        ref = kda_ref.kda_uniform(*args, state_ref, rows, lens[0], hist_ref)
    else:
        out = tkda.kda_decode(*args, state, rows)
        ref = kda_ref.kda_decode(*args, state_ref, rows)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    _check_close(out, ref, tol, f"{mode} out", rel)
    untouched = torch.ones(num_rows, dtype=torch.bool, device=device)
    untouched[rows] = False
    assert torch.equal(state[untouched], state_ref[untouched]), "rows outside `rows` changed"
    _check_close(state[rows], state_ref[rows], tol, f"{mode} state", rel)
    if with_history:
        assert hist[0].shape == hist_ref[0].shape
        _check_close(hist[0], hist_ref[0], tol, f"{mode} history")


# fla's safe_gate path uses a helper (gather) that the interpreter cannot run: GPU only.
@cpu_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kda_interpreter_extend_chunked(dtype):
    pytest.importorskip("fla")
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    _run_kda("extend", [1, 15, 16, 53], 2, 32, dtype, "cpu", False, tol)


@cpu_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kda_interpreter_recurrent_paths(dtype):
    pytest.importorskip("fla")
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    _run_kda("extend", [1, 3, 5], 2, 16, dtype, "cpu", True, tol)
    _run_kda("uniform", [3] * 3, 2, 16, dtype, "cpu", True, tol)
    _run_kda("uniform", [4] * 2, 2, 16, dtype, "cpu", False, tol)
    _run_kda("decode", [1] * 4, 2, 16, dtype, "cpu", False, tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("safe_gate", [False, True])
def test_kda_gpu_extend(dtype, safe_gate):
    pytest.importorskip("fla")
    tol, rel = (5e-3, 4e-3) if dtype == torch.float32 else (4e-2, 1e-2)
    _run_kda("extend", [1, 15, 16, 53, 4001], 64, 128, dtype, "cuda", False, tol, safe_gate, rel)


def _check_gate_in_kernel(lower_bound, with_history, device, heads, lens, dtype, tol, rel):
    """kda_extend(gate=) with the gate's logits f in dtype: fla applies the gate in its
    chunk-cumsum kernel (the recurrent path, with history, applies forget_gate first)."""
    from kernels.triton import kda as tkda

    dim, num_rows = 128 if device == "cuda" else 16, 16
    q, k, v, _, beta, state = _kda_inputs(sum(lens), heads, dim, num_rows, dtype, device)
    gen = torch.Generator(device="cpu").manual_seed(9)
    f = torch.randn(sum(lens), heads, dim, generator=gen).to(device, dtype)
    dt_bias = (torch.randn(heads * dim, generator=gen) * 0.5).to(device)
    a_log = (torch.randn(heads, generator=gen) * 0.3).to(device)
    gate = kda_ref.ForgetGate(dt_bias, a_log, lower_bound)
    rows = _rows(len(lens), num_rows, device)
    state_ref = state.clone()
    hist, hist_ref = ([], []) if with_history else (None, None)
    _poison(device)
    out = tkda.kda_extend(q, k, v, f, beta, state, rows, lens, hist, gate=gate)
    ref = kda_ref.kda_extend(q, k, v, f, beta, state_ref, rows, lens, hist_ref, gate=gate)
    _check_close(out, ref, tol, "gated extend out", rel)
    _check_close(state[rows], state_ref[rows], tol, "gated extend state", rel)
    if with_history:
        _check_close(hist[0], hist_ref[0], tol, "gated extend history")


@cpu_interp
@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("with_history", [False, True])
def test_kda_interpreter_extend_gate_in_kernel(lower_bound, with_history):
    """fla's own kernels with the gate in them, float32 at 2 x 16."""
    pytest.importorskip("fla")
    lens = [1, 3, 4, 2] if with_history else [1, 15, 16, 70]
    _check_gate_in_kernel(lower_bound, with_history, "cpu", 2, lens, torch.float32, 2e-4, None)


@pytest.mark.gpu
@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("with_history", [False, True])
def test_kda_gpu_extend_gate_in_kernel(lower_bound, with_history):
    """At rank 0 of TP8's 8 heads x 128, bf16 logits."""
    pytest.importorskip("fla")
    lens = [1, 3, 4, 2] if with_history else [1, 15, 16, 53, 2001]
    tol, rel = (2e-2, None) if with_history else (4e-2, 1e-2)  # as test_kda_gpu_extend's bf16
    _check_gate_in_kernel(lower_bound, with_history, "cuda", 8, lens, torch.bfloat16, tol, rel)


def _check_layer_extend(lower_bound, device, heads, dim, lens, dtype, tol, rel=(None, None)):
    """A ragged prefill through KDAttention, its input projections stacked (q | k | v reach
    the conv as one view): the fast path (the conv writing q, k, v apart with q's and k's
    l2norm, fla with the gate in its kernel, the one-pass gated norm) against
    kernels.torch_path()."""
    import kernels
    import serving.layers.attention.kda as attention
    from serving.forward_batch import ForwardBatch
    from serving.memory.cache import KDALayerCache

    num_rows = 16
    config, layer = _kda_layer(heads, dim, dtype, lower_bound, False, 0)
    layer = layer.to(device)  # its float32 parameters (conv, gates, norm) stay float32
    assert layer.in_proj.stack()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(sum(lens), config.hidden_size, generator=gen).to(device, dtype)
    conv = torch.randn(num_rows, 3 * heads * dim, 3, generator=gen).to(device, dtype)
    state = (torch.randn(num_rows, heads, dim, dim, generator=gen) * 0.1).to(device)
    rows = _rows(len(lens), num_rows, device).tolist()
    req_to_token = torch.zeros(num_rows, max(lens) + 8, dtype=torch.int64, device=device)
    fb = ForwardBatch.build([0] * sum(lens), rows, [0] * len(lens), lens, req_to_token)
    fast, ref = KDALayerCache(conv.clone(), state.clone()), KDALayerCache(conv, state)
    _poison(device)
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention, "fast_path", lambda t: True)  # CPU tensors: the interpreter
        out = layer(x, fb, fast)
        with kernels.torch_path():
            mp.setattr(attention, "fast_path", lambda t: False)
            out_ref = layer(x, fb, ref)
    _check_close(out, out_ref, tol, "layer extend out", rel[0])
    _check_close(fast.state, ref.state, tol, "layer extend state", rel[1])
    assert torch.equal(fast.conv, ref.conv), "conv state"


@pytest.mark.gpu
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_kda_layer_extend_gpu_matches_torch_path(lower_bound):
    """At rank 0 of TP8's heads (8 x 128), bf16."""
    pytest.importorskip("fla")
    lens, rel = [1, 15, 53, 1500], (2e-2, 1e-2)
    _check_layer_extend(lower_bound, "cuda", 8, 128, lens, torch.bfloat16, 4e-2, rel)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kda_gpu_recurrent(dtype):
    pytest.importorskip("fla")
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    _run_kda("extend", [1, 3, 4, 2], 64, 128, dtype, "cuda", True, tol)
    for step_len in (1, 2, 4):
        _run_kda("uniform", [step_len] * 8, 64, 128, dtype, "cuda", True, tol)
        _run_kda("uniform", [step_len] * 8, 64, 128, dtype, "cuda", False, tol)
    _run_kda("decode", [1] * 8, 64, 128, dtype, "cuda", False, tol)


@pytest.mark.gpu
def test_kda_decode_cuda_graph():
    pytest.importorskip("fla")
    from kernels.triton import kda as tkda

    q, k, v, g, beta, state = _kda_inputs(8, 64, 128, 16, torch.bfloat16, "cuda")
    rows = _rows(8, 16, "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tkda.kda_decode(q, k, v, g, beta, state.clone(), rows)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tkda.kda_decode(q, k, v, g, beta, state, rows)
    nq, nk, nv, ng, nbeta, nstate = _kda_inputs(8, 64, 128, 16, torch.bfloat16, "cuda", seed=5)
    for t, n in ((q, nq), (k, nk), (v, nv), (g, ng), (beta, nbeta), (state, nstate)):
        t.copy_(n)
    out.fill_(float("nan"))
    graph.replay()
    ref = kda_ref.kda_decode(nq, nk, nv, ng, nbeta, nstate, rows)
    _check_close(out, ref, 2e-2, "graph decode")

"""kernels/triton/moe_fp8_grouped.py (block-FP8 routed experts as persistent grouped GEMMs on TMA
tiles) against the torch twin kernels.moe.experts_fp8 and the fused Triton kernels.triton.moe.
experts_fp8.

CPU cases run the kernels under TRITON_INTERPRET=1 (Triton 3.6's interpreter runs host-side
tensor descriptors: no pointer fallback), tiny shapes with partial 128-groups, EP ids equal to
E, an empty expert, ragged counts, few persistent programs (each runs several tiles); they skip
otherwise. GPU cases (@pytest.mark.gpu) run rank 0 of EP8 of GLM-5.3-Flash: Hd 4096, I 2048,
36 local experts of 288, top-8, other ranks' ids equal to 36; random inputs, outputs from
allocator memory just filled with NaN.

Tolerances, relative to the reference's largest magnitude (as tests/test_triton_kernels_fp8.py
for the fused FP8 MoE, whose reasons hold here: the same quantized operands, fp32 accumulation
in another order): under the interpreter, float32 x 1e-5 max; bf16 x 2e-2 max and 1e-2
relative Frobenius (each pair output and the sum rounded to bf16 on both sides; an fp32 gate/up
sum straddling a bf16 boundary of h moves that element, or its group if it is the group's amax,
one e4m3 step). Against the fused Triton FP8 MoE the same bf16 bound. On the GPU float32 x gets
2e-2 and 5e-3 (test_fp8_grouped_gpu_float32 says why). A captured graph replays bit for bit
what eager computes (no atomics, fixed orders, fixed tile order per program).
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kernels import fp8 as fp8_ref  # noqa: E402
from kernels import moe as moe_ref  # noqa: E402
from tests.ep_routing import RANK, ep_routing  # noqa: E402
from tests.triton_interp import patch_triton_interpreter  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
cpu_interp = pytest.mark.skipif(not INTERPRET, reason="CPU cases need TRITON_INTERPRET=1")
if INTERPRET:
    patch_triton_interpreter()

# (hidden, local experts, inter, top_k, all experts)
# tiny: Hd 144 (a partial second group), I 80 (one partial group; a tile reads up rows past it)
SMALL = (144, 5, 80, 3, 12)
ALIGNED = (256, 4, 128, 2, 8)


def _poison(device) -> None:
    if torch.device(device).type == "cuda":
        junk = torch.full((64 << 20,), float("nan"), device=device)  # 256 MiB
        del junk


_EXPERTS: dict = {}


def _experts(shape, device):
    """Block-FP8 w13 (gate and up quantized apart, as the checkpoint), w2 and their scales."""
    key = (shape, str(device))
    if key not in _EXPERTS:
        _EXPERTS.clear()
        hidden, local, inter, _, _ = shape
        gen = torch.Generator(device=device).manual_seed(1234)
        nb, hb = fp8_ref.blocks(inter), fp8_ref.blocks(hidden)
        w13 = torch.empty(local, 2 * inter, hidden, device=device, dtype=fp8_ref.FP8)
        w2 = torch.empty(local, hidden, inter, device=device, dtype=fp8_ref.FP8)
        s13 = torch.empty(local, 2 * nb, hb, device=device)
        s2 = torch.empty(local, hb, nb, device=device)
        for e in range(local):
            for half in (0, 1):
                w = torch.randn(inter, hidden, generator=gen, device=device) * 2 * hidden**-0.5
                rows = slice(half * inter, (half + 1) * inter)
                w13[e, rows], s13[e, half * nb : (half + 1) * nb] = fp8_ref.quantize_weight(w)
            w = torch.randn(hidden, inter, generator=gen, device=device) * inter**-0.5
            w2[e], s2[e] = fp8_ref.quantize_weight(w)
        _EXPERTS[key] = (w13, w2, s13, s2)
    return _EXPERTS[key]


def _inputs(tokens, shape, device, dtype=torch.bfloat16, seed=0, skip_expert=None, skip_all=False):
    """x in dtype, the block-FP8 experts and the routing as an EP rank's (tests/ep_routing.py)."""
    x, weights, ids = ep_routing(tokens, shape, seed, skip_expert, skip_all)
    x = x.to(device=device, dtype=dtype)
    return (x, *_experts(shape, device), weights.to(device), ids.to(device))


def _rel_max(out, ref) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _rel_fro(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _check(out, inputs, limit, bounds=None):
    """bounds: (max, Frobenius) relative errors; None: 1e-5 max for float32 x at the tiny
    interpreter shapes, 2e-2 and 1e-2 for bf16. Prints the errors (pytest -s shows them)."""
    x = inputs[0]
    assert out.dtype == x.dtype and out.shape == x.shape and not out.isnan().any()
    ref = moe_ref.experts_fp8(*inputs, limit)
    err_max, err_fro = _rel_max(out, ref), _rel_fro(out, ref)
    print(f"vs the reference: {err_max:.2e} max, {err_fro:.2e} Frobenius (relative)")
    if bounds is None:
        bounds = (1e-5, 1.0) if x.dtype == torch.float32 else (2e-2, 1e-2)
    assert err_max <= bounds[0] and err_fro <= bounds[1], (err_max, err_fro, bounds)
    return ref


@cpu_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 7, 29])
def test_fp8_grouped_interpreter(tokens, dtype):
    """Partial groups, an empty expert (1), other ranks' ids; limit 0.7 clamps often."""
    from kernels.triton.moe_fp8_grouped import experts_fp8_grouped

    inputs = _inputs(tokens, SMALL, "cpu", dtype, seed=tokens, skip_expert=1)
    assert not (inputs[6] == 1).any()
    _check(experts_fp8_grouped(*inputs, 0.7), inputs, 0.7)


@cpu_interp
@pytest.mark.parametrize("block_m,flatten", [(64, False), (128, True)])
def test_fp8_grouped_interpreter_configs(block_m, flatten):
    """Whole groups, both tile heights, a 64-column down tile, the flattened tile loop; ragged
    counts over 4 experts."""
    from kernels.triton.moe_fp8_grouped import GroupedFP8Config, experts_fp8_grouped

    cfg = GroupedFP8Config(block_m, 4, 2, 64, 4, 2, 2, flatten)
    inputs = _inputs(40, ALIGNED, "cpu", torch.float32, seed=9)
    _check(experts_fp8_grouped(*inputs, 10.0, config=cfg), inputs, 10.0)


@cpu_interp
def test_fp8_grouped_interpreter_all_pairs_elsewhere():
    from kernels.triton.moe_fp8_grouped import experts_fp8_grouped

    inputs = _inputs(6, SMALL, "cpu", skip_all=True)
    out = experts_fp8_grouped(*inputs, 10.0)
    assert torch.equal(out, torch.zeros_like(out))


@cpu_interp
@pytest.mark.parametrize(
    "tokens,experts,top_k,block_m", [(11, 5, 3, 4), (300, 5, 3, 16), (200, 40, 8, 64)]
)
def test_pad_sort_interpreter(tokens, experts, top_k, block_m):
    """The larger cases span several placing programs (256 pairs each)."""
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, experts + 1, (tokens, top_k), generator=gen)  # E: skipped
    ids[ids == 2] = experts  # expert 2 empty
    _check_pad_sort(ids, torch.rand(tokens, top_k, generator=gen), experts, block_m)


@pytest.mark.gpu
def test_pad_sort_gpu_rank_shape():
    """The rank's 8k chunk: 65,536 pairs over 256 placing programs, expert 3 empty."""
    *_, weights, ids = _inputs(8192, RANK, "cuda", seed=8, skip_expert=3)
    _check_pad_sort(ids, weights, RANK[1], 128)


def _check_pad_sort(ids, weights, experts, block_m):
    """Each expert's pairs in pair order from its segment's start, segments BLOCK_M-aligned in
    expert order, padding rows token -1 / weight 0, id-E pairs past every row; expert of each
    tile, E past the total."""
    from kernels.triton.moe import max_padded_rows
    from kernels.triton.moe_fp8_grouped import pad_sort

    tokens, top_k = ids.shape
    n = tokens * top_k
    layout = pad_sort(ids, weights, experts, block_m)
    token_of_row, weight_of_row, row_of_pair, expert_of_tile, total = (t.cpu() for t in layout)
    ids, weights = ids.cpu(), weights.cpu()
    rows = max_padded_rows(n, experts, block_m)
    assert token_of_row.shape == (rows,) and expert_of_tile.shape == (rows // block_m,)
    flat = ids.flatten()
    start = 0
    for e in range(experts):
        pairs = (flat == e).nonzero().flatten()
        got = row_of_pair[pairs].long()
        assert torch.equal(got, torch.arange(start, start + pairs.numel()))
        assert torch.equal(token_of_row[got].long(), pairs // top_k)
        assert torch.equal(weight_of_row[got], weights.flatten()[pairs])
        seg = -(-pairs.numel() // block_m) * block_m
        assert (token_of_row[start + pairs.numel() : start + seg] == -1).all()
        assert (weight_of_row[start + pairs.numel() : start + seg] == 0).all()
        assert (expert_of_tile[start // block_m : (start + seg) // block_m] == e).all()
        start += seg
    assert total.tolist() == [start]
    assert (row_of_pair[flat == experts] == rows).all()
    assert (expert_of_tile[start // block_m :] == experts).all()


def test_layer_rule_picks_fp8_grouped(monkeypatch):
    """serving/layers/mlp.py: FP8 batches with T * top_k >= FP8_GROUPED_MIN_PAIRS_PER_EXPERT *
    E and experts at least GROUPED_MIN_INTER wide take experts_fp8_grouped; None: never."""
    from kernels.triton.moe import experts_fp8
    from kernels.triton.moe_fp8_grouped import experts_fp8_grouped
    from serving.layers import mlp

    monkeypatch.setattr(mlp, "fast_path", lambda t: True)
    monkeypatch.setattr(mlp, "_hopper", lambda device: True)
    monkeypatch.setattr(mlp, "FP8_GROUPED_MIN_PAIRS_PER_EXPERT", 100)
    x = torch.empty(450, 8, dtype=torch.bfloat16)
    assert mlp._experts_fp8(x, 8, 36, 2048) is experts_fp8_grouped  # 3,600 pairs = 100 x 36
    assert mlp._experts_fp8(x[:449], 8, 36, 2048) is experts_fp8
    assert mlp._experts_fp8(x, 8, 36, 768) is experts_fp8  # narrow experts
    monkeypatch.setattr(mlp, "FP8_GROUPED_MIN_PAIRS_PER_EXPERT", None)
    assert mlp._experts_fp8(x, 8, 36, 2048) is experts_fp8
    monkeypatch.setattr(mlp, "fast_path", lambda t: False)
    assert mlp._experts_fp8(x, 8, 36, 2048) is moe_ref.experts_fp8


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [8192, 1000])
def test_fp8_grouped_gpu_rank_shape(tokens):
    """The rank's 8k chunk (and a ragged 1,000) against the reference and the fused Triton FP8
    MoE; expert 3 unpicked (an empty segment)."""
    from kernels.triton.moe import experts_fp8
    from kernels.triton.moe_fp8_grouped import experts_fp8_grouped

    inputs = _inputs(tokens, RANK, "cuda", seed=1, skip_expert=3)
    _poison("cuda")
    out = experts_fp8_grouped(*inputs, 7.0)
    _check(out, inputs, 7.0)
    fused = experts_fp8(*inputs, 7.0)
    assert _rel_max(out, fused) <= 2e-2 and _rel_fro(out, fused) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [128, 64])
def test_fp8_grouped_gpu_float32(block_m):
    """float32 x at the rank's dims, 256 tokens, both tile heights. Not 1e-5 as at the
    interpreter's tiny shapes: the e4m3 wgmma accumulates at reduced precision (about 14
    mantissa bits) inside each K step, so gate and up differ from the fp32 reference by ~1e-5
    relative, which moves the e4m3 rounding of some h elements (a few in 10,000 at that
    difference, estimated; each one step, <= 12.5% of it): up to about 1e-3 relative Frobenius
    on the output, bounded here by 5e-3 (an indexing error is O(1))."""
    from kernels.triton.moe_fp8_grouped import GroupedFP8Config, experts_fp8_grouped

    inputs = _inputs(256, RANK, "cuda", torch.float32, seed=6)
    _poison("cuda")
    cfg = GroupedFP8Config(block_m, 8, 3 if block_m == 128 else 4, 128, 8, 4, 8)
    out = experts_fp8_grouped(*inputs, 7.0, config=cfg)
    _check(out, inputs, 7.0, (2e-2, 5e-3))


@pytest.mark.gpu
def test_fp8_grouped_gpu_cuda_graph():
    """Captured at 2,048 tokens, replayed on new x, weights and ids: equal to eager bit for bit,
    and to the reference."""
    from kernels.triton.moe_fp8_grouped import experts_fp8_grouped

    x, w13, w2, s13, s2, weights, ids = _inputs(2048, RANK, "cuda", seed=2)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile outside the capture
            experts_fp8_grouped(x, w13, w2, s13, s2, weights, ids, 7.0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts_fp8_grouped(x, w13, w2, s13, s2, weights, ids, 7.0)
    for seed, skip in ((3, None), (4, 5)):
        nx, *_, nweights, nids = _inputs(2048, RANK, "cuda", seed=seed, skip_expert=skip)
        x.copy_(nx)
        weights.copy_(nweights)
        ids.copy_(nids)
        out.fill_(float("nan"))
        graph.replay()
        eager = experts_fp8_grouped(x, w13, w2, s13, s2, weights, ids, 7.0)
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        _check(out, (x, w13, w2, s13, s2, weights, ids), 7.0)


@pytest.mark.gpu
def test_fp8_grouped_gpu_all_pairs_elsewhere():
    """No local pair: every segment empty, no tile computed, the output exactly zero."""
    from kernels.triton.moe_fp8_grouped import experts_fp8_grouped

    inputs = _inputs(64, RANK, "cuda", seed=5, skip_all=True)
    _poison("cuda")
    out = experts_fp8_grouped(*inputs, 7.0)
    assert torch.equal(out, torch.zeros_like(out))

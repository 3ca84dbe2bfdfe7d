"""kernels/triton/moe_grouped.py (routed experts through torch._grouped_mm) against the torch
twin kernels.moe.experts and the fused Triton MoE.

CPU cases run the Triton passes under TRITON_INTERPRET=1 (tiny shapes) and torch._grouped_mm's
CPU fallback in bf16; they skip otherwise. GPU cases (@pytest.mark.gpu) run rank 0 of EP8 of
GLM-5.3-Flash: Hd 4096, I 2048, 36 local experts of 288, top-8, ids of other ranks' experts
equal to 36. Inputs are random (never zeros); outputs come from allocator memory just filled
with NaN.

Tolerances, relative to the largest magnitude of the float32 reference on the same bf16-rounded
inputs: 2e-2 max abs and 1e-2 relative Frobenius (bf16 rounds gate/up, the SwiGLU output and
each pair's expert output; the combine sums in fp32), the bf16 bound of
tests/test_triton_kernels_moe_kda.py. Against the fused Triton MoE the same bound (both
within it of the reference). Capture then replay equals eager bit for bit (no atomics, fixed
orders, CUTLASS's grouped schedule has no split-K).
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kernels import moe as moe_ref  # noqa: E402
from tests.ep_routing import RANK, ep_routing  # noqa: E402
from tests.triton_interp import patch_triton_interpreter  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
cpu_interp = pytest.mark.skipif(not INTERPRET, reason="CPU cases need TRITON_INTERPRET=1")
if INTERPRET:
    patch_triton_interpreter()


def _poison(device) -> None:
    if torch.device(device).type == "cuda":
        junk = torch.full((64 << 20,), float("nan"), device=device)  # 256 MiB
        del junk


_EXPERTS: dict = {}


def _experts(shape, device):
    """Random bf16 w13, w2 made on the device (the rank's are 1.8 GB) and kept for the module."""
    key = (shape, str(device))
    if key not in _EXPERTS:
        _EXPERTS.clear()
        hidden, local, inter, _, _ = shape
        gen = torch.Generator(device=device).manual_seed(1234)
        w13 = torch.randn(local, 2 * inter, hidden, generator=gen, device=device)
        w2 = torch.randn(local, hidden, inter, generator=gen, device=device)
        bf16 = torch.bfloat16
        _EXPERTS[key] = ((w13 * (hidden**-0.5 * 2)).to(bf16), (w2 * inter**-0.5).to(bf16))
    return _EXPERTS[key]


def _inputs(tokens, shape, device, seed=0, skip_expert=None, skip_all=False):
    """bf16 x and experts, the routing as an EP rank's (tests/ep_routing.py)."""
    x, weights, ids = ep_routing(tokens, shape, seed, skip_expert, skip_all)
    w13, w2 = _experts(shape, device)
    x = x.to(device=device, dtype=torch.bfloat16)
    return x, w13, w2, weights.to(device), ids.to(device)


def _check(out, x, w13, w2, weights, ids, limit):
    assert not out.isnan().any()
    assert out.dtype == x.dtype and out.shape == x.shape
    ref = moe_ref.experts(x.float(), w13.float(), w2.float(), weights, ids, limit)
    scale = ref.abs().max().item()
    if scale == 0:  # every pair on another rank: exactly nothing
        assert not out.any(), out.abs().max()
        return
    err = (out.float() - ref).abs().max().item()
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert err <= 2e-2 * scale and rel <= 1e-2, (err, rel, scale)


# small: (hidden, local experts, inter, top_k, all experts); Hd and I multiples of 8
SMALL = (48, 5, 40, 3, 12)


@cpu_interp
@pytest.mark.parametrize("tokens", [1, 7, 29])
def test_grouped_interpreter_ep_ids_and_empty_group(tokens):
    from kernels.triton.moe_grouped import experts_grouped

    inputs = _inputs(tokens, SMALL, "cpu", seed=tokens, skip_expert=1)
    ids = inputs[4]
    assert not (ids == 1).any()
    out = experts_grouped(*inputs, 0.7)  # limit 0.7 clamps a good share of gate and up
    _check(out, *inputs, 0.7)


@cpu_interp
def test_grouped_interpreter_all_pairs_elsewhere():
    from kernels.triton.moe_grouped import experts_grouped

    inputs = _inputs(6, SMALL, "cpu", skip_all=True)
    out = experts_grouped(*inputs, 10.0)
    assert torch.equal(out, torch.zeros_like(out))


def test_sort_pairs_cpu():
    """Local pairs sorted by expert (stable: pair order within an expert), skipped ones after
    offs[-1]; row_of_pair the inverse permutation. Plain torch, no interpreter needed."""
    from kernels.triton.moe_grouped import sort_pairs

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 6, (11, 3), generator=gen)  # 6 = E = 5: skipped
    token_of_row, row_of_pair, offs = sort_pairs(ids, 5)
    flat = ids.flatten()
    counts = torch.bincount(flat, minlength=6)
    assert offs.dtype == torch.int32 and torch.equal(offs.long(), counts[:5].cumsum(0))
    order = torch.argsort(flat, stable=True)
    assert torch.equal(row_of_pair.long()[order], torch.arange(flat.numel()))
    assert torch.equal(token_of_row.long(), order // 3)
    assert torch.equal((row_of_pair >= offs[-1]), flat == 5)


@pytest.mark.gpu
def test_grouped_gpu_rank_shape_8k():
    """8,192 tokens at the rank shape: the reference, and the fused Triton MoE, within bf16's
    bound; expert 3 unpicked (an empty group)."""
    from kernels.triton.moe import experts
    from kernels.triton.moe_grouped import experts_grouped

    inputs = _inputs(8192, RANK, "cuda", seed=1, skip_expert=3)
    _poison("cuda")
    out = experts_grouped(*inputs, 7.0)
    _check(out, *inputs, 7.0)
    fused = experts(*inputs, 7.0)
    err = (out.float() - fused.float()).abs().max().item()
    rel = ((out.float() - fused.float()).norm() / fused.float().norm()).item()
    assert err <= 2e-2 * fused.float().abs().max().item() and rel <= 1e-2, (err, rel)


@pytest.mark.gpu
def test_grouped_gpu_cuda_graph():
    """Captured at 2,048 tokens, replayed on new x, weights and ids: equal to eager bit for
    bit, and to the reference."""
    from kernels.triton.moe_grouped import experts_grouped

    x, w13, w2, weights, ids = _inputs(2048, RANK, "cuda", seed=2)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile the Triton passes outside the capture
            experts_grouped(x, w13, w2, weights, ids, 7.0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts_grouped(x, w13, w2, weights, ids, 7.0)
    for seed, skip in ((3, None), (4, 5)):
        nx, _, _, nweights, nids = _inputs(2048, RANK, "cuda", seed=seed, skip_expert=skip)
        x.copy_(nx)
        weights.copy_(nweights)
        ids.copy_(nids)
        out.fill_(float("nan"))
        graph.replay()
        eager = experts_grouped(x, w13, w2, weights, ids, 7.0)
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        _check(out, x, w13, w2, weights, ids, 7.0)


def test_layer_rule_picks_grouped(monkeypatch):
    """serving/layers/mlp.py's one host rule: bf16 batches with T * top_k >=
    GROUPED_MIN_PAIRS_PER_EXPERT * E and experts at least GROUPED_MIN_INTER wide take
    experts_grouped; None: never. Decode batches never reach the default threshold."""
    from kernels.triton.moe import experts
    from kernels.triton.moe_grouped import experts_grouped
    from serving.layers import mlp

    monkeypatch.setattr(mlp, "fast_path", lambda t: True)
    monkeypatch.setattr(mlp, "_hopper", lambda device: True)
    x = torch.empty(2048, 8, dtype=torch.bfloat16)
    assert mlp._experts(x, 8, 36, 2048) is experts_grouped  # the default: 455 pairs each
    assert mlp._experts(x[:256], 8, 36, 2048) is experts
    monkeypatch.setattr(mlp, "GROUPED_MIN_PAIRS_PER_EXPERT", 100)
    assert mlp._experts(x[:450], 8, 36, 2048) is experts_grouped  # 3,600 pairs = 100 x 36
    assert mlp._experts(x[:449], 8, 36, 2048) is experts
    assert mlp._experts(x[:450], 8, 36, 768) is experts  # narrow experts
    assert mlp._experts(x[:450].float(), 8, 36, 2048) is experts
    monkeypatch.setattr(mlp, "GROUPED_MIN_PAIRS_PER_EXPERT", None)
    assert mlp._experts(x, 8, 36, 2048) is experts


@pytest.mark.gpu
def test_grouped_gpu_all_pairs_elsewhere():
    """No local pair at all: every group empty, the output exactly zero."""
    from kernels.triton.moe_grouped import experts_grouped

    inputs = _inputs(64, RANK, "cuda", seed=5, skip_all=True)
    _poison("cuda")
    out = experts_grouped(*inputs, 7.0)
    assert torch.equal(out, torch.zeros_like(out))

"""The per-layer glue's Triton kernels (kernels/triton/mhc.py: the collapse with its RMSNorm and
the expansion; kernels/triton/route.py: the router) against their torch references
(kernels/mhc.py, kernels/moe.py). CPU cases run under TRITON_INTERPRET=1 (tests/triton_interp);
the GPU case runs the real per-rank shapes.

Tolerances: float32, 1e-5 relative to the reference's largest magnitude (only the summation
order differs). bf16: the kernels round where the references round (the collapse, the norm,
each expansion term), so outputs match up to one bf16 ulp where an fp32 sum lands on a rounding
boundary: 1e-2 relative. Router ids and their order are equal exactly, weights to 1e-5, on every
row but near-ties (two selection scores within 1e-5, under 1% of the rows: there the summation
order may decide; the H200 found such rows at 8,192 tokens).
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional
pytest.importorskip("triton")

from kernels import mhc as mhc_ref  # noqa: E402
from kernels import moe as moe_ref  # noqa: E402
from tests.triton_interp import patch_triton_interpreter  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
cpu_interp = pytest.mark.skipif(not INTERPRET, reason="CPU cases need TRITON_INTERPRET=1")
if INTERPRET:
    patch_triton_interpreter()


def _dev() -> str:
    return "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def _mhc_inputs(tokens, hc, hidden, dtype, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    mix = (2 + hc) * hc
    streams = torch.randn(tokens, hc, hidden, generator=gen) * 3
    fn = torch.randn(mix, hc * hidden, generator=gen) * (hc * hidden) ** -0.5
    base = torch.randn(mix, generator=gen) * 0.5
    scale = torch.rand(3, generator=gen) + 0.5
    weight = torch.rand(hidden, generator=gen) + 0.5
    out = torch.randn(tokens, hidden, generator=gen)
    d = dict(device=device)
    return (
        streams.to(dtype=dtype, **d),
        fn.to(**d),
        base.to(**d),
        scale.to(**d),
        weight.to(dtype=dtype, **d),
        out.to(dtype=dtype, **d),
    )


def _close(got, ref, dtype):
    assert got.shape == ref.shape and got.dtype == ref.dtype, (got.shape, ref.shape)
    assert not got.isnan().any()
    scale = ref.float().abs().max().item()
    err = (got.float() - ref.float()).abs().max().item()
    assert err <= (1e-5 if dtype == torch.float32 else 1e-2) * scale, (err, scale)


def _check_mhc(tokens, hc, hidden, dtype, device):
    from kernels.triton.mhc import mhc_post, mhc_pre

    streams, fn, base, scale, weight, out = _mhc_inputs(tokens, hc, hidden, dtype, device)
    args = (fn, base, scale, 20, 1e-6, 1e-5, weight, 1e-5)
    got = mhc_pre(streams, *args)
    ref = mhc_ref.mhc_pre_reference(streams, *args)
    for g, r in zip(got[:2], ref[:2]):  # post, comb: float32 either way
        _close(g, r, torch.float32)
    _close(got[2], ref[2], dtype)
    post, comb = ref[:2]
    _close(
        mhc_post(out, streams, post, comb),
        mhc_ref.mhc_post_reference(out, streams, post, comb),
        dtype,
    )


@cpu_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_mhc_interpreter(tokens, dtype):
    # hidden 200: not a power of two (masked Hd blocks); 37 tokens: the 64-token blocks
    _check_mhc(tokens, 4, 200, dtype, "cpu")


@cpu_interp
def test_mhc_interpreter_many_splits():
    # hc*Hd 4096 over 128-wide K slices: 32 split-K partials summed by the finish kernel
    _check_mhc(2, 4, 1024, torch.bfloat16, "cpu")


@cpu_interp
def test_mhc_interpreter_splits_past_one_block():
    # hc*Hd 9216: 72 partials, summed 64 at a time (a full block, then a masked one), as a
    # decode token's 128 at the real size
    _check_mhc(1, 4, 2304, torch.float32, "cpu")


def _route_inputs(tokens, hidden, experts, dtype, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype)
    gate = (torch.randn(experts, hidden, generator=gen) * hidden**-0.5).to(device, dtype)
    bias = (torch.randn(experts, generator=gen) * 0.1).to(device)
    return x, gate, bias


def _near_ties(x, gate, bias, top_k):
    """Rows whose selection scores (float64) have two of their top k + 1 within 1e-5: there a
    float32 sum in another order may pick or rank the experts differently (the reference's
    own float32 is 3e-7 off float64 at 4,096 inputs). At 8,192 random tokens, 288 experts,
    about 34 rows of 8,192."""
    choice = F.linear(x.double(), gate.double()).sigmoid() + bias.double()
    top = choice.topk(top_k + 1, dim=-1).values
    return (top[:, :-1] - top[:, 1:]).min(-1).values < 1e-5


def _check_route(tokens, hidden, experts, top_k, dtype, device, local):
    from kernels.triton.route import route

    x, gate, bias = _route_inputs(tokens, hidden, experts, dtype, device)
    tied = _near_ties(x, gate, bias, top_k)
    assert tied.float().mean() < 0.01, int(tied.sum())
    for normalize in (True, False):
        args = (x, gate, bias, top_k, 1, 1, normalize, 2.5, local)
        w, ids = route(*args)
        w_ref, ids_ref = moe_ref.route(*args)
        assert ids.dtype == ids_ref.dtype == torch.int64 and w.dtype == torch.float32
        # every row equal but near-ties, whose experts or order may differ
        assert torch.equal(ids[~tied], ids_ref[~tied]), (ids != ids_ref).any(-1).nonzero()
        assert torch.allclose(w[~tied], w_ref[~tied], rtol=1e-5, atol=1e-6)


@cpu_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 20])
@pytest.mark.parametrize("local", [None, (12, 9)], ids=["all", "ep"])
def test_route_interpreter(tokens, dtype, local):
    # 36 experts (not a power of two), top 8, K 320 (split-K with a masked tail)
    _check_route(tokens, 320, 36, 8, dtype, "cpu", local)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 32, 8192])
def test_glue_gpu_real_shapes(tokens):
    """Rank 0 of TP8/EP8: Hd 4096, hc 4, 288 experts (36 local), top 8; bf16, and the collapse
    in float32 too (its logits' tf32x3 dots held to float32's 1e-5)."""
    _check_mhc(tokens, 4, 4096, torch.bfloat16, "cuda")
    _check_mhc(tokens, 4, 4096, torch.float32, "cuda")
    _check_route(tokens, 4096, 288, 8, torch.bfloat16, "cuda", (0, 36))

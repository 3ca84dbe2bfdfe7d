"""The per-layer glue's Triton kernels (kernels/triton/mhc.py: the collapse with its RMSNorm, the
expansion and the fused boundary between two sublayers; kernels/triton/route.py: the router;
kernels/triton/swiglu.py: the dense MLPs' clamped SwiGLU) against their torch references
(kernels/mhc.py, kernels/moe.py), and the model's loop of
boundaries against the loop of one collapse and one expansion per sublayer it replaced. CPU cases
run under TRITON_INTERPRET=1 (tests/triton_interp); the GPU cases run the real per-rank shapes.

Tolerances: float32, 1e-5 relative to the reference's largest magnitude (only the summation
order differs; the boundary's mixing logits are IEEE float32 sums, no TF32). bf16: the kernels
round where the references round (the collapse, the norm, each expansion term), so outputs match
up to one bf16 ulp where an fp32 sum lands on a rounding boundary: 1e-2 relative. The tiny
model's logits through the Triton mHC kernels (float32): 1e-4 of the largest (the mixing's
float32 sums in another order, through four layers). Router ids and their order are equal
exactly, weights to 1e-5, on every row but near-ties (two selection scores within 1e-5, under 1%
of the rows: there the summation order may decide; the H200 found such rows at 8,192 tokens).
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


def _poison(device, nbytes=256 << 20) -> None:
    """Fill recently freed allocator memory with NaN so that torch.empty outputs start as NaN:
    one cached block, which later large allocations up to nbytes in all are split from, and
    64 MiB of the small pool (1 MiB and less: a few tokens' streams, post and comb)."""
    if torch.device(device).type == "cuda":
        junk = torch.full((nbytes // 4,), float("nan"), device=device)
        small = [torch.full((1 << 18,), float("nan"), device=device) for _ in range(64)]
        del junk, small


def _close(got, ref, dtype):
    assert got.shape == ref.shape and got.dtype == ref.dtype, (got.shape, ref.shape)
    assert not got.isnan().any()
    scale = ref.float().abs().max().item()
    err = (got.float() - ref.float()).abs().max().item()
    assert err <= (1e-5 if dtype == torch.float32 else 1e-2) * scale, (err, scale)


def _check_mhc(tokens, hc, hidden, dtype, device, iters=20):
    from kernels.triton.mhc import mhc_post, mhc_pre

    streams, fn, base, scale, weight, out = _mhc_inputs(tokens, hc, hidden, dtype, device)
    args = (fn, base, scale, iters, 1e-6, 1e-5, weight, 1e-5)
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
@pytest.mark.parametrize("finish", [(4, 64, 4), (8, 256, 8)])
def test_mhc_interpreter_prefill_blocks(monkeypatch, finish):
    """The collapse past 16 tokens with other blocks (PRE_PARTIAL, PRE_FINISH: what
    bench.decode_mhc_kda --pre-sweep times): 20 tokens (past 16: the prefill's blocks) in
    finish blocks of 4 or 8 (a ragged last one), Hd 200 in channel blocks of 64 (two passes,
    masked) or 256 (one)."""
    from kernels.triton import mhc

    monkeypatch.setattr(mhc, "PRE_PARTIAL", (32, 32, 4))
    monkeypatch.setattr(mhc, "PRE_FINISH", finish)
    _check_mhc(20, 4, 200, torch.bfloat16, "cpu")


@cpu_interp
@pytest.mark.parametrize("sinkhorn_tokens", [0, 1, 8])
def test_mhc_interpreter_sinkhorn_programs(monkeypatch, sinkhorn_tokens):
    """The prefill finish's Sinkhorn in every collapse program (0) or in programs of its own,
    1 or 8 tokens a tile (20 tokens: a ragged last tile): post, comb and the collapse as the
    reference's."""
    from kernels.triton import mhc

    monkeypatch.setattr(mhc, "PRE_SINKHORN_TOKENS", sinkhorn_tokens)
    monkeypatch.setattr(mhc, "PRE_SINKHORN_MAX_ROWS", 1 << 30)
    monkeypatch.setattr(mhc, "PRE_SINKHORN_ONE_TOKEN_MAX", 0)
    _check_mhc(20, 4, 200, torch.bfloat16, "cpu")


def test_mhc_sinkhorn_programs_only_over_few_splits():
    """A decode-sized batch past 16 tokens has its partials in many K splits (264 for the real
    rank's 32 rows): its Sinkhorn runs in a program a token, which sums only that token's rows
    (one program summing 32 x 264 rows took 111 us a call on the H200); past
    PRE_SINKHORN_ONE_TOKEN_MAX tokens it stays in the collapse programs while the splits are
    many, and an 8k chunk's 3 splits go to Sinkhorn programs of PRE_SINKHORN_TOKENS tokens."""
    from kernels.triton import mhc

    assert mhc.sinkhorn_tokens(16, 1) == 0
    assert mhc.sinkhorn_tokens(32, 264) == 1
    assert mhc.sinkhorn_tokens(mhc.PRE_SINKHORN_ONE_TOKEN_MAX + 1, 132) == 0
    assert mhc.sinkhorn_tokens(8192, 3) == mhc.PRE_SINKHORN_TOKENS > 1


@cpu_interp
def test_mhc_interpreter_presplit_is_the_split(monkeypatch):
    """fn's bf16_split terms made once (split_bf16x3, PRE_PARTIAL_PRESPLIT; with more than one
    token block: 70 tokens are two of 64) give the very logits the per-tile split does: the
    same terms, dotted in the same order (bitwise)."""
    from kernels.triton import mhc

    tokens = mhc.PRE_PARTIAL[0] + 6
    streams, fn, base, scale, weight, _ = _mhc_inputs(tokens, 4, 64, torch.bfloat16, "cpu")
    args = (fn, base, scale, 20, 1e-6, 1e-5, weight, 1e-5)
    monkeypatch.setattr(mhc, "PRE_PARTIAL_PRESPLIT", False)
    per_tile = mhc.mhc_pre(streams, *args)
    monkeypatch.setattr(mhc, "PRE_PARTIAL_PRESPLIT", True)
    splits, split = [], mhc.split_bf16x3
    monkeypatch.setattr(mhc, "split_bf16x3", lambda w: splits.append(w.shape) or split(w))
    once = mhc.mhc_pre(streams, *args)
    assert splits == [fn.shape]  # two token blocks: fn split once a call
    assert all(torch.equal(a, b) for a, b in zip(per_tile, once))
    mhc.mhc_pre(streams[: mhc.PRE_PARTIAL[0]], *args)
    assert splits == [fn.shape]  # one token block splits each tile once anyway: no extra launch
    terms = split(fn).float()
    assert torch.equal(terms.sum(0), fn) and not torch.equal(terms[0], fn)


@cpu_interp
def test_mhc_interpreter_many_splits():
    # hc*Hd 4096 over 128-wide K slices: 32 split-K partials summed by the finish kernel
    _check_mhc(2, 4, 1024, torch.bfloat16, "cpu")


@cpu_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mhc_interpreter_splits_past_one_block(dtype):
    # hc*Hd 9216: 72 partials, summed 64 at a time (a full block, then a masked one), as a
    # decode token's 128 at the real size; each logit dot (tf32x3, bf16_split)
    _check_mhc(1, 4, 2304, dtype, "cpu")


def _boundary_inputs(tokens, hc, hidden, dtype, device, seed=0, iters=20):
    """A sublayer's output, the streams it came from with their collapse's post and comb (the
    reference's, as the model has them), and the next collapse's parameters."""
    streams, fn, base, scale, weight, out = _mhc_inputs(tokens, hc, hidden, dtype, device, seed)
    _, prev_fn, prev_base, prev_scale, *_ = _mhc_inputs(1, hc, hidden, dtype, device, seed + 1)
    args = (prev_fn, prev_base, prev_scale, 20, 1e-6, 1e-5, weight, 1e-5)
    post, comb, _ = mhc_ref.mhc_pre_reference(streams, *args)
    return (out, streams, post, comb, fn, base, scale, iters, 1e-6, 1e-5, weight, 1e-5)


def _check_boundary(tokens, hc, hidden, dtype, device, iters=20):
    from kernels.triton.mhc import BOUNDARY_MAX_TOKENS, mhc_boundary

    args = _boundary_inputs(tokens, hc, hidden, dtype, device, iters=iters)
    counter = torch.zeros(BOUNDARY_MAX_TOKENS, dtype=torch.int32, device=device)
    # the outputs and scratch (new streams, x, partials) fit in the poisoned block twice over
    _poison(device, max(256 << 20, 2 * tokens * hidden * (hc + 1) * 4 + (64 << 20)))
    got = mhc_boundary(*args, counter)
    _boundary_close(got, args, dtype)
    assert not counter.any(), "the counters must be left zero (the next call, a graph replay)"
    return args, got


def _boundary_close(got, args, dtype):
    """The boundary's outputs against the references stage by stage: the new streams against
    the expansion's reference, then post, comb and x against the collapse's reference of the
    streams the kernel wrote. Composed end to end, one bf16 ulp of a stream that rounds the
    other way (a different float32 summation order) moves the float32 mixing logits by ~1e-3
    relative, past float32's tolerance (the H200: 1e-3 for the fused and the two-kernel path)."""
    out, residual, post, comb, fn, base, scale, iters, eps, norm_eps, weight, rms_eps = args
    _close(got[0], mhc_ref.mhc_post_reference(out, residual, post, comb), dtype)
    ref = mhc_ref.mhc_pre_reference(got[0], fn, base, scale, iters, eps, norm_eps, weight, rms_eps)
    _close(got[1], ref[0], torch.float32)  # post, comb: float32 either way
    _close(got[2], ref[1], torch.float32)
    _close(got[3], ref[2], dtype)  # the next sublayer's input


@cpu_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 8, 13, 37])
def test_mhc_boundary_interpreter(tokens, dtype, monkeypatch):
    # hidden 200: a masked last block of channels (64 per program); 13 tokens with the fused
    # boundary set to 16 tokens: blocks of 2 (the kernel's form past 8), the last one partial,
    # each finished by its last program; 37 tokens: post, then pre
    if tokens == 13:
        monkeypatch.setattr("kernels.triton.mhc.BOUNDARY_MAX_TOKENS", 16)
    _check_boundary(tokens, 4, 200, dtype, "cpu")


@cpu_interp
def test_mhc_boundary_interpreter_odd_hc_and_prefill():
    _check_boundary(3, 3, 64, torch.float32, "cpu")  # hc 3: masked streams, 15 mixing logits
    _check_boundary(130, 4, 64, torch.bfloat16, "cpu")  # past BOUNDARY_MAX_TOKENS: post, then pre


@cpu_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,hidden", [(17, 80), (40, 128)])
def test_mhc_boundary_interpreter_post_then_pre(tokens, hidden, dtype, monkeypatch):
    """Past BOUNDARY_MAX_TOKENS mhc_boundary runs mhc_post, then mhc_pre, once each; Hd 80: a
    masked block of channels."""
    from kernels.triton import mhc as tmhc

    calls = []
    for name in ("mhc_post", "mhc_pre"):
        real = getattr(tmhc, name)
        monkeypatch.setattr(tmhc, name, lambda *a, n=name, f=real: calls.append(n) or f(*a))
    _check_boundary(tokens, 4, hidden, dtype, "cpu")
    assert calls == ["mhc_post", "mhc_pre"]


@cpu_interp
@pytest.mark.parametrize("tokens", [1, 12])
def test_mhc_interpreter_few_sinkhorn_iterations(tokens, monkeypatch):
    """3 Sinkhorn iterations, far from convergence, so an iteration too few or many shows: the
    pre and the fused boundary (1 token: one finishing program a token; 12, the fused boundary
    set to 16 tokens: blocks of 2)."""
    monkeypatch.setattr("kernels.triton.mhc.BOUNDARY_MAX_TOKENS", 16)
    _check_mhc(tokens, 4, 200, torch.float32, "cpu", iters=3)
    _check_boundary(tokens, 4, 200, torch.float32, "cpu", iters=3)


def _tiny_model():
    from serving.tools.tiny_model import build_config, random_model

    raw = build_config("tiny", {"<|endoftext|>": 0, "<|user|>": 1, "<|observation|>": 2})
    return random_model(raw, "cpu")[1]


def _unfused_forward(self, batch, cache, images=None):
    """Glm5NextForCausalLM.forward as it was before the boundaries: every sublayer's input a
    collapse of the streams and its output an expansion, through the references."""
    from serving.models.glm5_next import ForwardOutput

    def collapse(hc, streams, norm):
        args = (hc.fn, hc.base, hc.scale, hc.iters, hc.eps, hc.norm_eps, norm.weight, norm.eps)
        return mhc_ref.mhc_pre_reference(streams, *args)

    assert images is None  # a text-only model
    x = self.embed(batch.input_ids)
    streams = x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
    selected = None
    for layer in self.layers:
        post, comb, x = collapse(layer.attn_hc, streams, layer.input_layernorm)
        if layer.is_kda:
            history = None
            if batch.kda_history is not None:
                history = batch.kda_history.setdefault(layer.layer, [])
            x = layer.self_attn(x, batch, cache.kda(layer.layer), history)
        else:
            x, selected = layer.self_attn(x, batch, cache.dsa(layer.layer), selected)
        streams = mhc_ref.mhc_post_reference(x, streams, post, comb)
        post, comb, x = collapse(layer.ffn_hc, streams, layer.post_attention_layernorm)
        streams = mhc_ref.mhc_post_reference(layer.mlp(x), streams, post, comb)
    hidden = streams.mean(dim=1)
    return ForwardOutput(logits=self.logits(hidden[batch.logit_index]), hidden=hidden)


def _tiny_logits(model, unfused=False):
    """Logits of three requests through a prefill (13 + 6 + 2 tokens: blocks of 4 tokens in the
    fused boundary) and three decode steps (3 tokens each)."""
    from serving.tools.generate import StepRunner

    gen = torch.Generator().manual_seed(0)
    lens = [13, 6, 2]
    tokens = [torch.randint(3, 1000, (n + 3,), generator=gen).tolist() for n in lens]
    runner = StepRunner(model, max_requests=3, max_context=32)
    seqs = [runner.add(t) for t in tokens]
    forward = type(model).forward
    if unfused:
        type(model).forward = torch.inference_mode()(_unfused_forward)
    try:
        steps = [runner.step(seqs, lens, logits="all")]
        steps += [runner.step(seqs, [1, 1, 1]) for _ in range(3)]
    finally:
        type(model).forward = forward
    return torch.cat([s.logits for s in steps]), torch.cat([s.hidden for s in steps])


def test_model_boundaries_equal_the_unfused_loop():
    """On the torch path the loop of boundaries computes exactly what the loop of one collapse
    and one expansion per sublayer computed: the same ops in the same order."""
    model = _tiny_model()
    logits, hidden = _tiny_logits(model)
    ref_logits, ref_hidden = _tiny_logits(model, unfused=True)
    assert torch.equal(logits, ref_logits) and torch.equal(hidden, ref_hidden)


@cpu_interp
def test_model_fused_boundaries_interpreter(monkeypatch):
    """The tiny model (float32) with its mHC on the Triton kernels (the first collapse, the
    boundaries: mhc_post then mhc_pre at 21 tokens, the fused one at 3; the last
    expansion; the rest on the torch path) against the unfused loop of references: a prefill of
    21 tokens, then decode steps of 3. The greedy tokens are equal."""
    import serving.layers.mhc as mhc_layer

    model = _tiny_model()
    ref_logits, ref_hidden = _tiny_logits(model, unfused=True)
    calls = []
    monkeypatch.setattr(mhc_layer, "fast_path", lambda t: calls.append(t.shape[0]) or True)
    logits, hidden = _tiny_logits(model)
    assert set(calls) == {21, 3}, calls
    _close(hidden, ref_hidden, torch.float32)
    assert not logits.isnan().any()
    err = (logits - ref_logits).abs().max().item()
    assert err <= 1e-4 * ref_logits.abs().max().item(), err
    assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))


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


def _check_swiglu(tokens, inter, dtype, device):
    """The two halves of one stacked [T, 2I] projection (strided rows), values past the clamp
    limit on both sides; float32 to 1e-6 relative, bf16 within one ulp (silu's rounding)."""
    from kernels.triton.swiglu import swiglu

    g = torch.Generator(device="cpu").manual_seed(tokens * 7 + inter)
    stacked = (torch.randn(tokens, 2 * inter, generator=g) * 6).to(device=device, dtype=dtype)
    gate, up = stacked.split([inter, inter], dim=-1)
    got, ref = swiglu(gate, up, 7.0), moe_ref.swiglu(gate, up, 7.0)
    assert got.shape == ref.shape and got.dtype == dtype and got.is_contiguous()
    rtol = 1e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got, ref, rtol=rtol, atol=1e-6)
    if dtype == torch.bfloat16:  # one ulp on a few elements at most, never more
        assert (got != ref).float().mean() < 0.01


@cpu_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,inter", [(1, 300), (5, 1100)])
def test_swiglu_interpreter(tokens, inter, dtype):
    # a masked tail (300), and two column blocks with a tail (1100)
    _check_swiglu(tokens, inter, dtype, "cpu")


REAL_HD, BENCH_HD = 4096, 2048  # rank 0 of TP8 (and the bench preset's hidden size)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 16, 32, 64, 128])
def test_mhc_boundary_gpu(tokens, monkeypatch):
    """mhc_boundary at decode batches 1/8/16/32 and verify batches (2 and 4 tokens per request at
    32 requests; 16: EAGLE's verify at 8): the fused kernel up to BOUNDARY_MAX_TOKENS (8), mhc_post
    + mhc_pre past it, except at 16 tokens: the fused kernel's blocks of 2 (the setting raised to
    16); bf16 at the real and the bench preset's hidden size, float32 at the real one."""
    if tokens == 16:
        monkeypatch.setattr("kernels.triton.mhc.BOUNDARY_MAX_TOKENS", 16)
    _check_boundary(tokens, 4, REAL_HD, torch.bfloat16, "cuda")
    _check_boundary(tokens, 4, BENCH_HD, torch.bfloat16, "cuda")
    _check_boundary(tokens, 4, REAL_HD, torch.float32, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tokens", [17, 1000, 8192])
def test_mhc_boundary_post_then_pre_gpu(tokens, dtype):
    """mhc_boundary past BOUNDARY_MAX_TOKENS (mhc_post, then mhc_pre) at rank 0 of TP8's shapes:
    17 tokens, 1000 (a ragged last token block), a full chunk (8192). Outputs poisoned with NaN;
    the module docstring's tolerances; a second call on the same inputs is bitwise equal (fixed
    summation order, no atomics)."""
    from kernels.triton.mhc import BOUNDARY_MAX_TOKENS, mhc_boundary

    args, first = _check_boundary(tokens, 4, REAL_HD, dtype, "cuda")
    counter = torch.zeros(BOUNDARY_MAX_TOKENS, dtype=torch.int32, device="cuda")
    second = mhc_boundary(*args, counter)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 32])
def test_mhc_boundary_cuda_graph(tokens):
    """Captured once, replayed on fresh inputs: each replay equals the reference (the counters
    the last programs reset start every replay at zero)."""
    from kernels.triton.mhc import BOUNDARY_MAX_TOKENS, mhc_boundary

    args = list(_boundary_inputs(tokens, 4, REAL_HD, torch.bfloat16, "cuda"))
    counter = torch.zeros(BOUNDARY_MAX_TOKENS, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mhc_boundary(*args, counter)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = mhc_boundary(*args, counter)
    for seed in (5, 6, 7):
        fresh = _boundary_inputs(tokens, 4, REAL_HD, torch.bfloat16, "cuda", seed)
        for dst, src in zip(args, fresh):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _boundary_close(outs, args, torch.bfloat16)
        assert not counter.any()


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 32, 8192])
def test_glue_gpu_real_shapes(tokens):
    """Rank 0 of TP8/EP8: Hd 4096, hc 4, 288 experts (36 local), top 8; bf16, and the collapse
    in float32 too (its logits' tf32x3 dots held to float32's 1e-5)."""
    _check_mhc(tokens, 4, 4096, torch.bfloat16, "cuda")
    _check_mhc(tokens, 4, 4096, torch.float32, "cuda")
    _check_route(tokens, 4096, 288, 8, torch.bfloat16, "cuda", (0, 36))
    for inter in (1536, 192):  # a dense MLP's and the shared expert's share at TP8
        _check_swiglu(tokens, inter, torch.bfloat16, "cuda")
        _check_swiglu(tokens, inter, torch.float32, "cuda")

"""The vision tower's fused kernels (kernels/triton/vision.py: qkv_heads; kernels/triton/swiglu.py;
kernels/triton/norm.py: add_rms_norm, and rms_norm, which every RMSNorm runs on the fast path)
against their torch twins (kernels/vision.py, kernels/moe.swiglu, kernels/norm), the MLP's
stacked gate/up GEMM, and on CUDA the real-size tower on the fast path against the torch path.
CPU cases run the kernels under TRITON_INTERPRET=1 (tests/triton_interp) at tiny shapes; GPU
cases at the real ones (N = 1,024 and 4,784 patches: 448x448 and 1280x720; width 1024, 16
heads of 64, MLP 4096).

Tolerances. The kernels round where the references round, so only the norm's sum of squares
(summed in another order) and exp / rsqrt (other implementations) differ: float32 to 1e-5 of
the reference's largest magnitude; bf16 to 1e-2 of it (one bf16 ulp where a float32 value lands
on a rounding boundary, carried through the scale and the RoPE), on under 1% of the elements.
What is only copied or added and rounded once is equal exactly: v, and the residual sum. The
tower: its bf16 output on the fast path no further (relative L2) from the float32 torch path
than 1.5x the bf16 torch path's, plus 1e-3.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kernels import moe as moe_ref  # noqa: E402
from kernels import norm as norm_ref  # noqa: E402
from kernels import vision as vision_ref  # noqa: E402
from serving.config import VisionConfig  # noqa: E402
from serving.models.vision import VisionMLP, VisionTower  # noqa: E402
from tests.triton_interp import patch_triton_interpreter  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
cpu_interp = pytest.mark.skipif(not INTERPRET, reason="CPU cases need TRITON_INTERPRET=1")
if INTERPRET:
    patch_triton_interpreter()

REAL = VisionConfig(out_hidden_size=4096)  # GLM-5.3-Flash's: 24 blocks of 1024, out 4096
DTYPES = [torch.float32, torch.bfloat16]


def _poison() -> None:
    """Fill recently freed allocator memory with NaN so that torch.empty outputs start as NaN."""
    junk = torch.full((64 << 20,), float("nan"), device="cuda")  # 256 MiB
    del junk


def _close(got, ref, dtype) -> None:
    assert got.shape == ref.shape and got.dtype == ref.dtype, (got.shape, ref.shape)
    assert not got.isnan().any()
    scale = ref.float().abs().max().item()
    diff = (got.float() - ref.float()).abs()
    err = diff.max().item()
    assert err <= (1e-5 if dtype == torch.float32 else 1e-2) * scale, (err, scale)
    if dtype != torch.float32:
        assert (diff > 0).float().mean().item() < 0.01


def _tables(grids, hd: int, device):
    """VisionTower.rope's cos and signed sin for these grids (its config's other fields are
    the real tower's)."""
    config = VisionConfig(out_hidden_size=4096, hidden_size=4 * hd, num_heads=4)
    return VisionTower.rope(SimpleNamespace(config=config), grids, torch.device(device))


def _qkv_inputs(n, heads, hd, dtype, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    qkv = torch.randn(n, 3 * heads * hd, generator=gen) * 2 + 0.5
    qw, kw = (1 + 0.2 * torch.randn(hd, generator=gen) for _ in range(2))
    return [t.to(dtype=dtype, device=device) for t in (qkv, qw, kw)]


def _check_qkv(grids, heads, hd, dtype, device) -> None:
    from kernels.triton.vision import qkv_heads

    cos, sin = _tables(grids, hd, device)
    n = cos.shape[0]
    qkv, qw, kw = _qkv_inputs(n, heads, hd, dtype, device)
    if device == "cuda":
        _poison()
    got = qkv_heads(qkv, qw, kw, 1e-6, cos, sin)
    want = vision_ref.qkv_heads(qkv, qw, kw, 1e-6, cos, sin)
    assert all(g.shape == (heads, n, hd) and g.is_contiguous() for g in got)
    _close(got[0], want[0], dtype)
    _close(got[1], want[1], dtype)
    assert torch.equal(got[2], want[2])


def _check_swiglu(rows, inner, dtype, device, limit) -> None:
    from kernels.triton.swiglu import swiglu

    gen = torch.Generator(device="cpu").manual_seed(1)
    gate_up = (torch.randn(rows, 2 * inner, generator=gen) * 4).to(dtype=dtype, device=device)
    gate, up = gate_up.chunk(2, dim=-1)  # the stacked GEMM's halves: rows strided
    if device == "cuda":
        _poison()
    got = swiglu(gate, up, limit)
    assert got.is_contiguous()
    assert (gate > limit).any() and (up.abs() > limit).any()  # the clamps are exercised
    _close(got, moe_ref.swiglu(gate, up, limit), dtype)


def _check_add_rms_norm(rows, d, dtype, device) -> None:
    from kernels.triton.norm import add_rms_norm

    gen = torch.Generator(device="cpu").manual_seed(2)
    x, delta = (torch.randn(rows, d, generator=gen) * 3 for _ in range(2))
    w = 1 + 0.2 * torch.randn(d, generator=gen)
    x, delta, w = (t.to(dtype=dtype, device=device) for t in (x, delta, w))
    if device == "cuda":
        _poison()
    total, normed = add_rms_norm(x, delta, w, 1e-6)
    want_total, want_normed = norm_ref.add_rms_norm(x, delta, w, 1e-6)
    assert torch.equal(total, want_total)
    _close(normed, want_normed, dtype)


def _check_rms_norm(rows, d, dtype, device) -> None:
    """From a strided x (every other row of a buffer) into a column slice of a wider buffer, its
    neighbour columns untouched; and into a fresh tensor."""
    from kernels.triton.norm import rms_norm

    gen = torch.Generator(device="cpu").manual_seed(3)
    x = (torch.randn(2 * rows, d, generator=gen) * 3).to(dtype=dtype, device=device)[::2]
    w = (1 + 0.2 * torch.randn(d, generator=gen)).to(dtype=dtype, device=device)
    want = norm_ref.rms_norm(x, w, 1e-6)
    wide = torch.full((rows, 2 * d + 3), 7.0, dtype=dtype, device=device)
    got = rms_norm(x, w, 1e-6, out=wide[:, d : 2 * d])
    assert got.data_ptr() == wide[:, d:].data_ptr()
    _close(got, want, dtype)
    assert (wide[:, :d] == 7).all() and (wide[:, 2 * d :] == 7).all()
    _close(rms_norm(x, w, 1e-6), want, dtype)


# ---- CPU: the interpreter at tiny shapes ----


@cpu_interp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hd", [16, 12])  # 12: half a head is not a power of two (masked)
def test_qkv_heads_interp(dtype, hd) -> None:
    # two images: 4 x 6 and 2 x 4 patches, 32 rows in all plus 8 (a partial row block)
    _check_qkv([(1, 4, 6), (1, 2, 4), (2, 2, 2)], 2, hd, dtype, "cpu")


@cpu_interp
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_interp(dtype) -> None:
    _check_swiglu(5, 40, dtype, "cpu", limit=3.0)


@cpu_interp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 48])
def test_add_rms_norm_interp(dtype, d) -> None:
    _check_add_rms_norm(6, d, dtype, "cpu")


@cpu_interp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 48])
def test_rms_norm_interp(dtype, d) -> None:
    _check_rms_norm(5, d, dtype, "cpu")


def test_mlp_stack_follows_moves_and_loads() -> None:
    """gate/up run as one GEMM over the stacked weights after construction, a dtype change and
    a load into the parameters; a load that replaces them runs the two GEMMs apart (the stale
    stack is never read), and so does autograd over parts requiring grad. Either way the
    output is the unstacked computation's."""
    torch.manual_seed(0)
    mlp = VisionMLP(8, 12, True, 1.5, torch.float32)
    src = VisionMLP(8, 12, True, 1.5, torch.float32)
    for p in src.parameters():
        p.data.normal_()
    x = torch.randn(5, 8)

    def apart(m):  # gate and up as two GEMMs
        xm = x.to(m.gate_proj.weight.dtype)
        return m.down_proj(moe_ref.swiglu(m.gate_proj(xm), m.up_proj(xm), m.limit))

    assert mlp._stacked()
    mlp.load_state_dict(src.state_dict())
    assert mlp._stacked() and torch.equal(mlp.gate_up_weight[:12], src.gate_proj.weight)
    assert torch.allclose(mlp(x), apart(src), atol=1e-6)
    mlp.to(torch.float64)
    assert mlp._stacked() and mlp.gate_up_weight.dtype == torch.float64
    assert torch.allclose(mlp(x.double()), apart(src).double(), atol=1e-6)
    fresh = {k: v.double().clone() * 2 for k, v in src.state_dict().items()}
    mlp.load_state_dict(fresh, assign=True)
    assert not mlp._stacked()
    assert torch.allclose(mlp(x.double()), apart(mlp), atol=1e-12)
    assert set(mlp.state_dict()) == set(src.state_dict())  # the checkpoint's names only
    src.requires_grad_(True)
    assert not src._stacked()  # training: the parts' GEMMs, so their gradients flow
    src(x).sum().backward()
    assert src.gate_proj.weight.grad is not None and src.up_proj.bias.grad is not None


# ---- CUDA: the real shapes ----


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grid", [(1, 32, 32), (1, 52, 92)])  # 1,024 and 4,784 patches
def test_qkv_heads_real(dtype, grid) -> None:
    _check_qkv([grid], REAL.num_heads, REAL.head_dim, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1024, 4784])
def test_swiglu_real(dtype, rows) -> None:
    _check_swiglu(rows, REAL.intermediate_size, dtype, "cuda", REAL.swiglu_limit)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1024, 4784])
def test_add_rms_norm_real(dtype, rows) -> None:
    _check_add_rms_norm(rows, REAL.hidden_size, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [2, 8192])
def test_rms_norm_real(dtype, rows) -> None:
    # GLM-5.3-Flash's hidden (the draft's norms, the final norm)
    _check_rms_norm(rows, 4096, dtype, "cuda")


@pytest.mark.gpu
def test_real_tower_fast_path_against_the_torch_path() -> None:
    """Two images in one call (448x448 and 1280x720: two attention segments), random weights:
    the bf16 fast path's error against the float32 torch path within 1.5x the bf16 torch
    path's (+1e-3), and the tower's fused path really taken (stacked gate/up)."""
    from kernels import torch_path
    from serving.models.random_init import random_vision

    tower = random_vision(SimpleNamespace(vision=REAL), torch.float32, "cuda", seed=5)
    grids = [(1, 32, 32), (1, 52, 92)]
    width = REAL.in_channels * REAL.temporal_patch_size * REAL.patch_size**2
    gen = torch.Generator(device="cuda").manual_seed(6)
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), width, generator=gen, device="cuda")
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.inference_mode(), torch_path():
            want = tower(pixels, grids).float()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    tower.to(torch.bfloat16)
    assert all(block.mlp._stacked() for block in tower.blocks) and tower.merger._stacked()
    with torch.inference_mode():
        with torch_path():
            ref = tower(pixels, grids).float()
        _poison()
        got = tower(pixels, grids).float()
    assert got.shape == want.shape == (sum(h * w // 4 for _, h, w in grids), 4096)
    assert torch.isfinite(got).all()
    ref_err = ((ref - want).norm() / want.norm()).item()
    got_err = ((got - want).norm() / want.norm()).item()
    assert got_err <= 1.5 * ref_err + 1e-3, (got_err, ref_err)

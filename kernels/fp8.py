"""Block-scaled FP8 (e4m3) weights and W8A8 linears: the plain-torch references.

The convention of GLM-5 / DeepSeek-V3 FP8 checkpoints: a quantized weight W [out, in] is stored
as float8_e4m3fn W8 beside float32 `weight_scale_inv` S [ceil(out/128), ceil(in/128)], and
W[i, j] = W8[i, j] * S[i // 128, j // 128] (blocks at the edges are partial). Activations are
quantized online, per token and per group of 128 channels: x[t, j] ~ x8[t, j] * s[t, j // 128].

kernels/triton/fp8.py has the same functions for CUDA; these are the CPU path, the oracle the GPU
tests compare with, and what the checkpoint writer uses.

Rounding, here and in the Triton kernels: an activation group's scale is amax / 448 (amax
floored at 1e-10: an all-zero group quantizes to zeros), its values are x * (448 / amax) rounded
to nearest-even on the e4m3 grid, clamped to +-448. Both quotients are IEEE-rounded divisions
on both sides (torch.div of two tensors here, tl.math.div_rn there) and the rest are single fp32
products, so the FP8 bits and scales are equal on CPU, GPU and the interpreter (up to the sign of
zero). Hazard: torch's `448 / t` is t.reciprocal() * 448 and, on CUDA, `t / 448` multiplies by a
host-side reciprocal; each is an ulp off the quotient in about a fifth of the groups, which moves
every e4m3 tie of such a group (frequent with bf16 inputs) one step, a 1-2% error on a K=128
linear.
"""

from __future__ import annotations

import torch

BLOCK = 128  # the only weight_block_size supported: [128, 128]; also the activation group
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_FLOOR = 1e-10


def blocks(n: int) -> int:
    return -(-n // BLOCK)


def expand_scales(scale: torch.Tensor, rows: int, cols: int, row0: int = 0) -> torch.Tensor:
    """Per-element scales [..., rows, cols] from block scales [..., R, C], where local row 0 is
    row `row0` of the block grid's first block row (a shard that starts inside a block)."""
    s = scale.float().repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    return s[..., row0 : row0 + rows, :cols]


def dequantize(w8: torch.Tensor, scale: torch.Tensor, row0: int = 0) -> torch.Tensor:
    """float32 W from W8 [..., out, in] and its block scales (see expand_scales for row0)."""
    return w8.float() * expand_scales(scale, w8.shape[-2], w8.shape[-1], row0)


def quantize_weight(w: torch.Tensor, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(W8, S) of a weight [..., out, in], per 128 x 128 block: S = amax / 448 (ue8m0: rounded
    up to a power of two, as checkpoints with scale_fmt "ue8m0" store them)."""
    *lead, rows, cols = w.shape
    rb, cb = blocks(rows), blocks(cols)
    padded = w.float().new_zeros(*lead, rb * BLOCK, cb * BLOCK)
    padded[..., :rows, :cols] = w.float()
    tiles = padded.view(*lead, rb, BLOCK, cb, BLOCK)
    amax = tiles.abs().amax(dim=(-3, -1)).clamp(min=AMAX_FLOOR)  # [..., rb, cb]
    scale = amax / FP8_MAX
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = tiles / scale[..., :, None, :, None]
    w8 = q.clamp(-FP8_MAX, FP8_MAX).to(FP8).view(*lead, rb * BLOCK, cb * BLOCK)
    return w8[..., :rows, :cols].contiguous(), scale.contiguous()


def quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, per group of 128 channels: (x8 [T, K] float8_e4m3fn, scales [T, ceil(K/128)]
    float32), x ~ x8 * scale. The last group may be partial."""
    tokens, k = x.shape
    kb = blocks(k)
    padded = x.float().new_zeros(tokens, kb * BLOCK)
    padded[:, :k] = x.float()
    groups = padded.view(tokens, kb, BLOCK)
    amax = groups.abs().amax(dim=-1).clamp(min=AMAX_FLOOR)
    fp8_max = torch.full_like(amax, FP8_MAX)  # tensor / tensor: IEEE division (see above)
    q = groups * torch.div(fp8_max, amax)[..., None]
    x8 = q.clamp(-FP8_MAX, FP8_MAX).to(FP8).view(tokens, kb * BLOCK)[:, :k]
    return x8.contiguous(), torch.div(amax, fp8_max)


def block_fp8_linear(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y = x W^T with W in block FP8 and x quantized per token group (W8A8), fp32 math.
    x [T, in] (any leading dims), w8 [out, in], scale [ceil(out/128), ceil(in/128)]; returns
    [..., out] in x's dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    x8, xs = quantize_act(x.reshape(-1, k))
    xd = x8.float() * xs.repeat_interleave(BLOCK, dim=-1)[:, :k]
    y = xd @ dequantize(w8, scale).T
    return y.to(x.dtype).view(*lead, w8.shape[0])

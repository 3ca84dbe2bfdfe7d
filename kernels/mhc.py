"""mHC mixing weights: pre / post / Sinkhorn-normalised comb from the hyper-connection logits.

The Sinkhorn loop is ~40 tiny elementwise ops per call; on CUDA one Triton program per token
does all of it in registers (decode is launch-bound, so this matters).
"""

from __future__ import annotations

import torch


def mhc_mix_reference(
    mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mix: [T, (2+hc)*hc] float32 -> pre [T, hc], post [T, hc], comb [T, hc, hc]."""
    pre_w, post_w, comb_w = mix.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = comb_w.view(-1, hc, hc) * scale[2] + comb_b.view(hc, hc)
    comb = torch.softmax(comb, dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def mhc_mix(
    mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if mix.is_cuda:
        from kernels.triton.mhc import mhc_mix_triton

        return mhc_mix_triton(mix, base, scale, hc, iters, eps)
    return mhc_mix_reference(mix, base, scale, hc, iters, eps)

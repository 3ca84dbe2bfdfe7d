"""Triton version of kernels.mhc.mhc_mix_reference (same signature and results)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mhc_mix_kernel(
    mix_ptr,
    base_ptr,
    scale_ptr,
    pre_ptr,
    post_ptr,
    comb_ptr,
    iters,
    eps,
    HC: tl.constexpr,
    P: tl.constexpr,
):
    t = tl.program_id(0)
    width = (2 + HC) * HC
    row = mix_ptr + t * width
    i = tl.arange(0, P)
    vec_mask = i < HC
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    pre = tl.load(row + i, mask=vec_mask, other=0.0) * s0 + tl.load(base_ptr + i, mask=vec_mask)
    tl.store(pre_ptr + t * HC + i, tl.sigmoid(pre) + eps, mask=vec_mask)
    post = tl.load(row + HC + i, mask=vec_mask, other=0.0) * s1
    post += tl.load(base_ptr + HC + i, mask=vec_mask)
    tl.store(post_ptr + t * HC + i, 2.0 * tl.sigmoid(post), mask=vec_mask)

    r = tl.arange(0, P)[:, None]
    c = tl.arange(0, P)[None, :]
    m = (r < HC) & (c < HC)
    offs = 2 * HC + r * HC + c
    logits = tl.load(row + offs, mask=m, other=0.0) * s2 + tl.load(base_ptr + offs, mask=m)
    logits = tl.where(m, logits, float("-inf"))
    logits = logits - tl.max(logits, axis=1)[:, None]
    e = tl.where(m, tl.exp(logits), 0.0)
    comb = tl.where(m, e / tl.sum(e, axis=1)[:, None] + eps, 0.0)
    comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
    tl.store(comb_ptr + t * HC * HC + r * HC + c, comb, mask=m)


def mhc_mix_triton(
    mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mix = mix.contiguous().float()
    n = mix.shape[0]
    pre = torch.empty(n, hc, device=mix.device, dtype=torch.float32)
    post = torch.empty_like(pre)
    comb = torch.empty(n, hc, hc, device=mix.device, dtype=torch.float32)
    if n:
        _mhc_mix_kernel[(n,)](
            mix,
            base.contiguous().float(),
            scale.contiguous().float(),
            pre,
            post,
            comb,
            iters,
            eps,
            HC=hc,
            P=triton.next_power_of_2(hc),
        )
    return pre, post, comb

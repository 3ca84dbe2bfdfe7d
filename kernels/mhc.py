"""mHC: the hyper-connection's mixing weights (pre / post / Sinkhorn-normalised comb from its
logits), the collapse of the residual streams into a sublayer's (RMS-normed) input, and the
expansion of the sublayer's output back onto the streams.

These are the references. On CUDA, kernels/triton/mhc.py does a collapse in two launches, an
expansion in one, and the boundary between two sublayers (one's expansion, the next one's
collapse: mhc_boundary_reference) in one for a decode-sized batch, past it as that expansion
and collapse (here about 20 and 6 ops, twice per layer: decode at TP8 is launch-bound; the
Sinkhorn loop alone is ~40 tiny elementwise ops). Pure torch on every device: the oracle the
fast path is held to (PDSERVE_TORCH_KERNELS=1 on CUDA runs these and nothing else).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.norm import rms_norm


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


def mhc_pre_reference(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    iters: int,
    eps: float,
    norm_eps: float,
    weight: torch.Tensor,
    rms_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, hc, Hd] -> (post [T, hc], comb [T, hc, hc], x [T, Hd]): the mixing logits
    F.linear(RMS-normalised flat streams, fn) in float32, pre/post/comb from them
    (mhc_mix_reference), the streams collapsed with pre (rounded to their dtype), then
    rms_norm(weight, rms_eps)."""
    hc = streams.shape[1]
    flat = streams.flatten(1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mix = F.linear(flat, fn)
    pre, post, comb = mhc_mix_reference(mix, base, scale, hc, iters, eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(1).to(streams.dtype)
    return post, comb, rms_norm(collapsed, weight, rms_eps)


def mhc_post_reference(
    out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """out [T, Hd] sublayer output; residual [T, hc, Hd] -> new streams [T, hc, Hd]:
    post_i * out + sum_j comb[j, i] * residual_j, with post and comb rounded to the streams'
    dtype (each term rounded to it, as a bf16 matmul and add)."""
    dtype = residual.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), residual
    )


def mhc_boundary_reference(
    out: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    iters: int,
    eps: float,
    norm_eps: float,
    weight: torch.Tensor,
    rms_eps: float,
    counter: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The boundary between two sublayers: the expansion of `out` [T, Hd] onto `residual`
    [T, hc, Hd] with the previous collapse's post and comb (mhc_post_reference), then the next
    collapse of the new streams with its fn/base/scale and RMSNorm weight (mhc_pre_reference).
    Returns (new streams, post, comb, normed x). counter: the fused kernel's (unused here)."""
    new = mhc_post_reference(out, residual, post, comb)
    return new, *mhc_pre_reference(new, fn, base, scale, iters, eps, norm_eps, weight, rms_eps)

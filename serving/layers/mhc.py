"""mHC hyper-connections: the residual streams' collapse and expansion around each sublayer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import mhc as mhc_kernels
from serving.config import ModelConfig
from serving.layers.linear import param


class HyperConnection(nn.Module):
    """mHC: collapse `hc` residual streams into the sublayer input, then mix them back.

    `pre` collapses the streams, `post` places the sublayer output on each stream, `comb` (a
    Sinkhorn-normalised, doubly stochastic hc x hc matrix) mixes the residual streams.
    Parameters stay float32 (the mixing is computed in float32).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hc = config.hc_mult
        self.hc, self.eps = hc, config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.iters = config.hc_sinkhorn_iters
        mix = (2 + hc) * hc
        self.fn = param(mix, hc * config.hidden_size, dtype=torch.float32)
        self.base = param(mix, dtype=torch.float32)
        self.scale = param(3, dtype=torch.float32)

    def collapse(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams: [T, hc, Hd] -> (post [T, hc], comb [T, hc, hc], collapsed [T, Hd])."""
        hc = self.hc
        flat = streams.flatten(1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        mix = F.linear(flat, self.fn)
        pre, post, comb = mhc_kernels.mhc_mix(mix, self.base, self.scale, hc, self.iters, self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def expand(
        out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """out: [T, Hd] sublayer output; residual: [T, hc, Hd] -> new streams [T, hc, Hd]."""
        dtype = residual.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), residual
        )

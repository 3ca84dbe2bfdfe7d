"""mHC hyper-connections: the residual streams' collapse and expansion around each sublayer.

The kernel choice: kernels.mhc's references on CPU, kernels/triton/mhc.py on CUDA (two launches
per collapse, its RMSNorm included, and one per expansion)."""

from __future__ import annotations

import torch
from torch import nn

from kernels import fast_path
from kernels import mhc as mhc_kernels
from serving.config import ModelConfig
from serving.layers.linear import param
from serving.layers.norm import RMSNorm


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

    def collapse(
        self, streams: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams: [T, hc, Hd] -> (post [T, hc], comb [T, hc, hc], norm(collapsed) [T, Hd])."""
        if fast_path(streams):
            from kernels.triton.mhc import mhc_pre
        else:
            mhc_pre = mhc_kernels.mhc_pre_reference
        args = (self.fn, self.base, self.scale, self.iters, self.eps, self.norm_eps)
        return mhc_pre(streams, *args, norm.weight, norm.eps)

    @staticmethod
    def expand(
        out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """out: [T, Hd] sublayer output; residual: [T, hc, Hd] -> new streams [T, hc, Hd]."""
        if fast_path(residual):
            from kernels.triton.mhc import mhc_post

            return mhc_post(out, residual, post, comb)
        return mhc_kernels.mhc_post_reference(out, residual, post, comb)

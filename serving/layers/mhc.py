"""mHC hyper-connections: the residual streams' collapse and expansion around each sublayer.

The kernel choice: kernels.mhc's references off the fast path, kernels/triton/mhc.py on it: a
collapse (its RMSNorm included) in two launches, an expansion in one, and the boundary between
two sublayers (the expansion of one's output, then the next one's collapse) in one launch for a
decode-sized batch (kernels/triton/mhc.py mhc_boundary; past BOUNDARY_MAX_TOKENS: mhc_post then
mhc_pre)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from kernels import fast_path
from kernels import mhc as mhc_kernels
from serving.config import ModelConfig
from serving.layers.linear import param
from serving.layers.norm import RMSNorm


class Streams(NamedTuple):
    """The residual streams and the mixing weights of their last collapse, with which the
    sublayer's output is expanded back onto them."""

    residual: torch.Tensor  # [T, hc, Hd]
    post: torch.Tensor  # [T, hc] float32
    comb: torch.Tensor  # [T, hc, hc] float32


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
        self._counter: torch.Tensor | None = None

    def _mixing(self) -> tuple:
        return self.fn, self.base, self.scale, self.iters, self.eps, self.norm_eps

    def collapse(self, streams: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, Streams]:
        """streams [T, hc, Hd] -> (norm(collapsed) [T, Hd], the streams with this collapse's
        post and comb)."""
        if fast_path(streams):
            from kernels.triton.mhc import mhc_pre
        else:
            mhc_pre = mhc_kernels.mhc_pre_reference
        post, comb, x = mhc_pre(streams, *self._mixing(), norm.weight, norm.eps)
        return x, Streams(streams, post, comb)

    def boundary(
        self, out: torch.Tensor, streams: Streams, norm: RMSNorm
    ) -> tuple[torch.Tensor, Streams]:
        """The previous sublayer's output `out` [T, Hd] expanded onto `streams`, then this
        collapse of the new streams: equal to expand() then collapse()."""
        if fast_path(out):
            from kernels.triton.mhc import mhc_boundary

            counter = self.counter(out.device)
        else:
            mhc_boundary, counter = mhc_kernels.mhc_boundary_reference, None
        new, post, comb, x = mhc_boundary(
            out, *streams, *self._mixing(), norm.weight, norm.eps, counter
        )
        return x, Streams(new, post, comb)

    def counter(self, device: torch.device) -> torch.Tensor:
        """This call site's arrival counters for the fused boundary (one per token block; the
        kernel leaves them zero). Made at the first call on a device, which for a captured
        decode graph is its warm-up. Hazard: never shared with another call site, since two
        boundaries in flight at once (programmatic dependent launch) would mix their counts."""
        if self._counter is None or self._counter.device != device:
            from kernels.triton.mhc import BOUNDARY_MAX_TOKENS

            self._counter = torch.zeros(BOUNDARY_MAX_TOKENS, dtype=torch.int32, device=device)
        return self._counter

    @staticmethod
    def expand(out: torch.Tensor, streams: Streams) -> torch.Tensor:
        """out: [T, Hd] sublayer output -> new streams [T, hc, Hd]."""
        if fast_path(streams.residual):
            from kernels.triton.mhc import mhc_post

            return mhc_post(out, *streams)
        return mhc_kernels.mhc_post_reference(out, *streams)

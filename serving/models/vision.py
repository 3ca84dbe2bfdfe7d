"""GLM-5.3-Flash's vision tower and merger (transformers 5.17 glm5_next: Glm5NextVisionModel),
and where the image embeddings go in the prompt (Glm5NextModel.forward).

Checkpoint names: the parameters here are named as transformers saves them under
`model.visual.` (Glm5NextForConditionalGeneration.model.visual; glm5_next's conversion mapping
renames no vision tensor), so a loader maps `model.visual.<name>` to `<name>` one to one. The
tower stays bf16 in FP8 releases.

Data flow for images with grids (t, h, w) in patches, N patches in all (serving/front/images.py
makes pixel_values and the grids):
  pixel_values [N, 3 * 2 * 14 * 14] -> patch_embed (a Conv3d whose stride is its kernel, run as
  one matmul over the flattened patch) -> [N, D]
  depth x block: x += attn(norm1(x)); x += mlp(norm2(x))
    attn: biased qkv -> RMSNorm of each head's q and k -> 2-D axial RoPE -> softmax attention
      among the patches of one frame only (transformers' cu_seqlens: a segment per frame, so
      images in one batch never see each other) -> biased proj
    mlp: down(silu(min(gate, L)) * clamp(up, -L, L)), L = swiglu_limit, all biased
  post_layernorm (RMSNorm) -> downsample: Conv2d 2x2 stride 2 over each run of 4 consecutive
  patches (the processor's block-major order makes them a 2x2 square) -> [N / 4, out_hidden]
  merger: proj -> LayerNorm -> GELU (erf) -> clamped SwiGLU out -> projection_intermediate -> out,
  no biases; out_hidden is the text model's hidden size.

RoPE: a patch at (row, col) of its frame, both counted in patches, rotates by row * f_i in the
first and third quarters of each head and by col * f_i in the second and fourth (rotate_half
pairs dim j with j + head_dim / 2), f_i = theta^(-4i / head_dim), i < head_dim / 4, in float32.

The prompt (scatter_image_embeddings): embed(input_ids), then the rows of the image tokens
replaced, in order, by the images' merged embeddings (one row per token). transformers takes as
image tokens every <|image|> outside a <|begin_of_video|> .. <|end_of_video|> span (one
placeholder serves both); video is refused, and so is a prompt with an <|image|> that is not
one of its images' (expand_image_token_ids), so the runs are those tokens (hazard: a
<|begin_of_video|> typed in a message must be refused too, or transformers would read the
images after it as video). Nothing else changes for them: the text model is NoPE and its
positions run 0, 1, 2, ... across them (no M-RoPE), under the same causal mask as any token.

NextN / MTP (EAGLE's draft): at a position whose next token is an image token the layer takes
that image's row, as the target did (serving/models/nextn.py says why).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kernels import fast_path
from kernels import moe as moe_kernels
from kernels import vision as vision_kernels
from serving.config import VisionConfig
from serving.layers.linear import param
from serving.layers.norm import RMSNorm, add_rms_norm

Grid = tuple[int, int, int]  # (frames, rows, cols) of one image, in patches


class VisionLinear(nn.Module):
    """x W^T (+ b): the tower's projections, whole on every rank for now."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = param(out_features, in_features, dtype=dtype)
        self.bias = param(out_features, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class StridedKernel(nn.Module):
    """A convolution whose stride is its kernel, over inputs already cut into kernel-sized
    pieces: each piece flattened in the kernel's (in channel, *window) order times the kernel
    flattened alike, one matmul (summed in another order than a convolution: not bit-equal)."""

    def __init__(self, out_channels: int, kernel: tuple[int, ...], dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = param(out_channels, *kernel, dtype=dtype)
        self.bias = param(out_channels, dtype=dtype)

    def forward(self, pieces: torch.Tensor) -> torch.Tensor:
        return F.linear(pieces, self.weight.flatten(1), self.bias)


class VisionPatchEmbed(nn.Module):
    """The Conv3d over (temporal, patch, patch) patches: pixel_values rows are already patches
    flattened as (channel, temporal, row, col)."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        c, t, p = config.in_channels, config.temporal_patch_size, config.patch_size
        self.proj = StridedKernel(config.hidden_size, (c, t, p, p), dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values.to(self.proj.weight.dtype))


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        d = config.hidden_size
        self.qkv = VisionLinear(d, 3 * d, config.attention_bias, dtype)
        self.proj = VisionLinear(d, d, config.attention_bias, dtype)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)

    def forward(
        self, x: torch.Tensor, segments: list[int], cos: torch.Tensor, signed_sin: torch.Tensor
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv_heads = vision_kernels.qkv_heads
        if fast_path(x):
            from kernels.triton.vision import qkv_heads
        # q_norm's eps is k_norm's (the config's rms_norm_eps)
        q, k, v = qkv_heads(  # each [heads, N, hd]
            self.qkv(x), self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, signed_sin
        )
        if len(segments) == 1:  # one frame: no split, no cat
            out = F.scaled_dot_product_attention(q[None], k[None], v[None])[0]
        else:
            out = torch.cat(
                [
                    F.scaled_dot_product_attention(qs[None], ks[None], vs[None])[0]
                    for qs, ks, vs in zip(
                        q.split(segments, 1), k.split(segments, 1), v.split(segments, 1)
                    )
                ],
                dim=1,
            )
        return self.proj(out.transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    """down(silu(min(gate, L)) * clamp(up, -L, L)): SwiGLU with clamped inputs, gate and up as
    one GEMM over their weights (and biases) stacked.

    The stack: gate_proj's and up_proj's parameters (the checkpoint's names) are views of one
    [2 * inner, dim] weight (and one bias), made at construction and again after every
    _apply (to(), to_empty(), cuda(): each replaces the parts' storage one by one), so loads
    that copy into the parameters (load_state_dict, the loaders) fill the stack. Hazard: a
    part's storage replaced otherwise (a new Parameter, load_state_dict(assign=True)) leaves
    the stack stale; forward then runs the two GEMMs apart (a check of host pointers), as it
    does under autograd with the parts requiring grad. The
    two parts' state_dict tensors share that storage: safetensors' save_file refuses them
    uncopied."""

    def __init__(self, dim: int, inner: int, bias: bool, limit: float, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = VisionLinear(dim, inner, bias, dtype)
        self.up_proj = VisionLinear(dim, inner, bias, dtype)
        self.down_proj = VisionLinear(inner, dim, bias, dtype)
        self.limit = limit
        self._stack()

    def _stack(self) -> None:
        # plain attributes, not parameters or buffers: no checkpoint name, and _apply leaves
        # them to _stack
        self.gate_up_weight = _stack_parts(self.gate_proj.weight, self.up_proj.weight)
        self.gate_up_bias = None
        if self.gate_proj.bias is not None:
            self.gate_up_bias = _stack_parts(self.gate_proj.bias, self.up_proj.bias)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._stack()
        return self

    def _stacked(self) -> bool:
        if torch.is_grad_enabled() and self.gate_proj.weight.requires_grad:
            return False  # the stack is no leaf: gradients would not reach the parts
        pairs = [(self.gate_up_weight, self.gate_proj.weight, self.up_proj.weight)]
        if self.gate_up_bias is not None:
            pairs.append((self.gate_up_bias, self.gate_proj.bias, self.up_proj.bias))
        return all(
            gate.data_ptr() == both.data_ptr() and up.data_ptr() == both[gate.shape[0] :].data_ptr()
            for both, gate, up in pairs
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._stacked():
            gate, up = F.linear(x, self.gate_up_weight, self.gate_up_bias).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        swiglu = moe_kernels.swiglu
        if fast_path(x):
            from kernels.triton.swiglu import swiglu
        return self.down_proj(swiglu(gate, up, self.limit))


def _stack_parts(first: nn.Parameter, second: nn.Parameter) -> torch.Tensor:
    """first's and second's rows in one new tensor, the two parameters becoming views of it."""
    with torch.no_grad():
        both = torch.cat([first.data, second.data])
    first.data, second.data = both.split(first.shape[0])
    return both


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.norm1 = RMSNorm(d, eps, dtype)
        self.norm2 = RMSNorm(d, eps, dtype)
        self.attn = VisionAttention(config, dtype)
        self.mlp = VisionMLP(
            d, config.intermediate_size, config.attention_bias, config.swiglu_limit, dtype
        )

    def forward(
        self,
        x: torch.Tensor,
        normed: torch.Tensor,
        next_norm: RMSNorm,
        segments: list[int],
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x and normed = norm1(x) -> (x + attn + mlp, next_norm of it): each residual add
        and the norm after it are one op (add_rms_norm)."""
        x, normed = add_rms_norm(x, self.attn(normed, segments, cos, signed_sin), self.norm2)
        return add_rms_norm(x, self.mlp(normed), next_norm)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = param(dim, dtype=dtype)
        self.bias = param(dim, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class VisionMerger(VisionMLP):
    """proj -> LayerNorm -> GELU (erf) -> the clamped SwiGLU, at the text width; no biases but
    the LayerNorm's (nn.LayerNorm's default eps)."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype) -> None:
        d = config.out_hidden_size
        super().__init__(d, config.projection_intermediate_size, False, config.swiglu_limit, dtype)
        self.proj = VisionLinear(d, d, False, dtype)
        self.post_projection_norm = LayerNorm(d, 1e-5, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.gelu(self.post_projection_norm(self.proj(x))))


class VisionTower(nn.Module):
    """Patches of a batch of images -> one text-width embedding per image token."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = VisionPatchEmbed(config, dtype)
        self.blocks = nn.ModuleList(VisionBlock(config, dtype) for _ in range(config.depth))
        self.post_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        m = config.spatial_merge_size
        self.downsample = StridedKernel(config.out_hidden_size, (config.hidden_size, m, m), dtype)
        self.merger = VisionMerger(config, dtype)

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """pixel_values [N, C * T * P * P] of the images in order, grids their (t, h, w) on the
        host -> [N / merge^2, out_hidden], image after image (num_tokens(grid) rows each)."""
        x = self.patch_embed(pixel_values)
        cos, signed_sin = self.rope(grids, x.device)
        segments = [h * w for t, h, w in grids for _ in range(t)]
        normed = self.blocks[0].norm1(x)
        next_norms = [b.norm1 for b in self.blocks[1:]] + [self.post_layernorm]
        for block, next_norm in zip(self.blocks, next_norms):
            x, normed = block(x, normed, next_norm, segments, cos, signed_sin)
        x = normed  # post_layernorm's
        # each run of m*m patches is one m x m square, the Conv2d's piece: (channel, row, col)
        m, d = self.config.spatial_merge_size, x.shape[-1]
        x = self.downsample(x.view(-1, m, m, d).permute(0, 3, 1, 2).reshape(-1, d * m * m))
        return self.merger(x)

    def rope(
        self, grids: Sequence[Grid], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [N, head_dim] (float32; kernels.vision.rotate's operands: sin
        with its first half negated) for the patches of these grids, in the processor's
        block-major order."""
        cfg = self.config
        m, quarter = cfg.spatial_merge_size, cfg.head_dim // 4
        inv_freq = 1.0 / cfg.rope_theta ** (
            torch.arange(0, 2 * quarter, 2, dtype=torch.float32, device=device) / (2 * quarter)
        )
        positions = []
        for t, h, w in grids:
            rows = torch.arange(h, device=device)[:, None].expand(h, w)
            cols = torch.arange(w, device=device)[None, :].expand(h, w)
            blocks = (h // m, m, w // m, m)
            rc = [p.reshape(blocks).transpose(1, 2).flatten() for p in (rows, cols)]
            positions.append(torch.stack(rc, dim=-1).repeat(t, 1))
        angles = torch.cat(positions)[..., None].float() * inv_freq  # [N, 2, quarter]
        angles = angles.flatten(1).repeat(1, 2)  # rows, cols, rows, cols
        sin = angles.sin()
        sin[:, : 2 * quarter] *= -1
        return angles.cos(), sin


def activation_bytes(config: VisionConfig, image_tokens: int, elem: int) -> int:
    """An upper estimate of the tower's activation peak for `image_tokens` merged tokens in one
    call (4 patches each): a block's live tensors per patch (the residual, its norm, qkv, the
    float32 RoPE of q and k, the attention output, gate, up and their product) and the float32
    cos/sin; attention itself runs in sdpa's fused kernels on CUDA (no patches x patches
    matrix). The merger's rows are a quarter as many and narrower than the blocks'."""
    d, inner = config.hidden_size, config.intermediate_size
    patches = image_tokens * config.spatial_merge_size**2
    per_patch = elem * (6 * d + 3 * inner) + 4 * (4 * d + 2 * config.head_dim)
    return patches * per_patch


# What the pool holds past one image's activation peak and the buffers: library workspaces made
# under its captures (cuBLASLt's for the biased projections, the attention kernels'), and the
# segments an earlier, smaller image's capture mapped that a larger one cannot reuse whole. On
# the H200 (fused tower, 2026-12-04): 448x448 alone 39-43 MB, 1280x720 captured after 448x448
# 106 MB (docs/BENCHMARKS.md, "Vision encoder"). Hazard: an estimate from those two orders; more
# grids of growing sizes may fragment further. Capturing a strip of the largest image first made
# it worse (146 MB), so the graphs capture on first use.
CAPTURE_WORKSPACE_BYTES = 128 << 20


def graph_bytes(config: VisionConfig, image_tokens: int, elem: int) -> int:
    """What the tower's CUDA graphs (serving/executor/vision_graphs.py) keep resident once the
    largest image, of `image_tokens` merged tokens, was captured: their shared pool (that
    image's activation peak; the graphs replay one at a time, so their blocks are shared) and
    the static pixel and embedding buffers sized for it."""
    patches = image_tokens * config.spatial_merge_size**2
    pixel_width = config.in_channels * config.temporal_patch_size * config.patch_size**2
    buffers = elem * (patches * pixel_width + image_tokens * config.out_hidden_size)
    return activation_bytes(config, image_tokens, elem) + buffers + CAPTURE_WORKSPACE_BYTES


def step_image_tokens(chunked_prefill_size: int, max_image_tokens: int) -> int:
    """The most image tokens one prefill step encodes: the images its chunk touches lie inside
    it but the last, which may run past it by up to one image."""
    return chunked_prefill_size + max_image_tokens


def num_tokens(grid: Grid, merge_size: int) -> int:
    t, h, w = grid
    return t * h * w // merge_size**2


def scatter_image_embeddings(
    inputs_embeds: torch.Tensor, positions: torch.Tensor, image_embeds: torch.Tensor
) -> torch.Tensor:
    """inputs_embeds [T, H] with rows `positions` [K] (the image tokens, ascending) replaced by
    image_embeds [K, H] cast to inputs_embeds' dtype: transformers' masked_scatter, whose mask
    is these positions. Positions come from the host (the runs the front expanded), never from
    a device mask: no sync, and a generated <|image|> re-prefilled after a retraction stays a
    plain token embedding, as transformers' generate keeps it."""
    return inputs_embeds.index_copy(0, positions, image_embeds.to(inputs_embeds.dtype))

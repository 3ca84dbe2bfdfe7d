"""Dense SwiGLU MLP and the MoE block (router, routed experts, shared experts)."""

from __future__ import annotations

import functools

import torch
from torch import nn

from kernels import fast_path
from kernels import moe as moe_kernels
from kernels.moe_small import Experts, SharedExpert
from serving.config import ModelConfig
from serving.distributed import all_reduce, split, state
from serving.layers.linear import Linear, block_scales, fp8_twin, param, shard
from serving.layers.stacked_projections import StackedProjections


class DenseMLP(nn.Module):
    """SwiGLU with the GLM clamp; gate/up column-parallel, down row-parallel (all-reduce after).
    kind: "dense_mlp" or "shared_expert" (FP8_KINDS)."""

    def __init__(
        self,
        hidden: int,
        inter: int,
        limit: float,
        dtype: torch.dtype,
        kind: str,
        reduce: bool = True,
    ) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, inter, dtype, split="column", kind=kind)
        self.up_proj = Linear(hidden, inter, dtype, split="column", kind=kind)
        self.down_proj = Linear(inter, hidden, dtype, split="row", reduce=reduce, kind=kind)
        self.limit = limit
        self.gate_up = StackedProjections(self, ("gate_proj", "up_proj"))

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP of x, plus `add` (MoE's routed output) inside the down GEMM."""
        gate, up = self.gate_up(x)
        if fast_path(x) and x.dim() == 2:
            from kernels.triton.swiglu import swiglu
        else:
            swiglu = moe_kernels.swiglu
        return self.down_proj(swiglu(gate, up, self.limit), add)


class Router(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = param(config.n_routed_experts, config.hidden_size, dtype=dtype)
        self.e_score_correction_bias = param(config.n_routed_experts, dtype=torch.float32)


class MoE(nn.Module):
    """Routed experts (stacked [E, ...], shardable by expert id) plus shared experts.

    Tokens are replicated on every rank. EP: this rank holds experts `experts` (a slice of the
    ids) and computes only those (a token's picks held by other ranks are skipped, not computed
    with weight 0); TP without EP: every expert, a slice of its intermediate size. Either way
    the routed and shared outputs are partial sums that meet in one all-reduce. The router is
    replicated, so every rank picks the same experts.

    Block FP8 (hold_fp8): w13/w2 float8_e4m3fn with w13_scale_inv [E, 2 * ceil(I/128),
    ceil(Hd/128)] (gate's blocks, then up's) and w2_scale_inv [E, ceil(Hd/128), ceil(I/128)]."""

    kind = "moe"

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        e, h, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        ps = state()
        self.experts = split(e, ps.ep_size, ps.ep_rank)
        e_local, i_local = e // ps.ep_size, i // ps.moe_tp_size
        self.gate = Router(config, dtype)
        # per expert: gate_proj rows, then up_proj rows (each this rank's share of them)
        self.w13 = param(e_local, 2 * i_local, h, dtype=dtype)
        self.w2 = param(e_local, h, i_local, dtype=dtype)
        shard(self.w13, 0, ps.moe_tp_size, ps.tp_rank)  # dims of one expert's checkpoint tensor
        shard(self.w2, 1, ps.moe_tp_size, ps.tp_rank)
        self.register_parameter("w13_scale_inv", None)
        self.register_parameter("w2_scale_inv", None)
        self.shared_experts = DenseMLP(
            h, i * config.n_shared_experts, config.swiglu_limit, dtype, "shared_expert", False
        )
        # the small-batch kernels' last-program counters (int32 zeros; made on the first small
        # batch, which the decode graphs' warm-up runs before capturing). Not a buffer: the
        # meta-device build and to_empty would leave it uninitialised.
        self.small_counters: torch.Tensor | None = None

    def hold_fp8(self) -> None:
        """Hold the routed experts in block FP8 (the shared expert is a DenseMLP of its own)."""
        if self.w13_scale_inv is not None:
            return
        self.w13, self.w2 = fp8_twin(self.w13), fp8_twin(self.w2)
        gate_blocks = block_scales(self.w13[:, : self.w13.shape[1] // 2])
        self.w13_scale_inv = nn.Parameter(gate_blocks.data.repeat(1, 2, 1), False)
        self.w2_scale_inv = block_scales(self.w2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        ps = state()
        # EP: ids become local; other ranks' experts id E, which the expert kernels skip
        local = (self.experts.start, self.w13.shape[0]) if ps.ep_size > 1 else None
        small = SMALL_MOE_MAX_TOKENS if self.w13_scale_inv is None else SMALL_MOE_MAX_TOKENS_FP8
        if fast_path(x) and c.n_group == 1 and 0 < x.shape[0] <= small:
            return self._forward_small(x, local)
        weights, ids = _route(x, c.n_group)(
            x,
            self.gate.weight,
            self.gate.e_score_correction_bias,
            c.num_experts_per_tok,
            c.n_group,
            c.topk_group,
            c.norm_topk_prob,
            c.routed_scaling_factor,
            local,
        )
        e_local, _, inter = self.w2.shape
        if self.w13_scale_inv is not None:
            scales = (self.w13_scale_inv, self.w2_scale_inv)
            experts = _experts_fp8(x, c.num_experts_per_tok, e_local, inter)
            routed = experts(x, self.w13, self.w2, *scales, weights, ids, c.swiglu_limit)
        else:
            experts = _experts(x, c.num_experts_per_tok, e_local, inter)
            routed = experts(x, self.w13, self.w2, weights, ids, c.swiglu_limit)
        if ps.tp_size > 1:  # shared expert TP-split too: one all-reduce for both
            return all_reduce(self.shared_experts(x, add=routed))
        if ps.ep_size > 1:
            return self.shared_experts(x, add=all_reduce(routed))
        return self.shared_experts(x, add=routed)

    def _forward_small(self, x: torch.Tensor, local: tuple[int, int] | None) -> torch.Tensor:
        """Router, routed experts and shared expert in three launches, no align and no sort
        (kernels/triton/moe_small.py). The shared expert joins the kernels where its output is
        a partial sum like the routed one (TP) or there is no all-reduce (world 1); under EP
        without TP every rank holds all of it, so it is added after the all-reduce, as in
        forward."""
        from kernels.triton.moe_small import counters_size, moe_small

        c = self.config
        ps = state()
        inside = ps.tp_size > 1 or ps.ep_size == 1
        mlp = self.shared_experts
        shared = (
            SharedExpert(
                mlp.gate_proj.weight,
                mlp.up_proj.weight,
                mlp.down_proj.weight,
                mlp.gate_proj.weight_scale_inv,
                mlp.up_proj.weight_scale_inv,
                mlp.down_proj.weight_scale_inv,
            )
            if inside
            else None
        )
        counters = self.small_counters
        if counters is None or counters.device != x.device:
            inter_sh = mlp.gate_proj.weight.shape[0] if inside else 0
            size = counters_size(c.hidden_size, self.w2.shape[2], inter_sh)
            counters = self.small_counters = torch.zeros(size, dtype=torch.int32, device=x.device)
        out = moe_small(
            x,
            self.gate.weight,
            self.gate.e_score_correction_bias,
            c.num_experts_per_tok,
            c.norm_topk_prob,
            c.routed_scaling_factor,
            local,
            Experts(self.w13, self.w2, self.w13_scale_inv, self.w2_scale_inv),
            shared,
            c.swiglu_limit,
            counters,
        )
        if ps.world > 1:
            out = all_reduce(out)
        return out if inside else self.shared_experts(x, add=out)


# On the fast path, batches of at most this many tokens take MoE._forward_small (three launches
# per layer, no align or sort; kernels/triton/moe_small.py, correct up to its MAX_TOKENS = 16),
# larger ones the fused align path. Issue 43's rule, tokens x top_k below the rank's local expert
# count, gives 4 at EP8 (top-8 of 288, 36 local experts). The H200 A/B of both paths at rank 0
# of EP8 (python -m bench.decode_moe, session 14): bf16 29.8 against 51.3 us at 1 token, 108
# against 122 at 4, 172 against 146 at 8; block FP8 59.7 against 75.2 us at 1 token but 136
# against 99 at 4. So bf16 up to 4 tokens, FP8 at 1.
SMALL_MOE_MAX_TOKENS = 4
SMALL_MOE_MAX_TOKENS_FP8 = 1

# With the torch kernels on CUDA (PDSERVE_TORCH_KERNELS=1), batches this small use the sync-free
# dense expert path, eager or captured alike, so CUDA graphs on and off compute the same thing;
# it is then also the most tokens a captured forward may hold (the sorted path syncs with the
# host). The fused Triton MoE has neither limit: one capturable path for every batch size.
DENSE_EXPERTS_MAX_TOKENS = 128


def _route(x: torch.Tensor, n_group: int):
    if fast_path(x) and n_group == 1:  # the fused router has no group selection
        from kernels.triton.route import route

        return route
    return moe_kernels.route


# On the fast path, batches with at least this many (token, slot) pairs per local expert,
# T * top_k / E (other ranks' pairs counted too: the rule sees host ints only), and experts at
# least GROUPED_MIN_INTER wide take the grouped GEMMs (bf16: kernels/triton/moe_grouped.py,
# torch._grouped_mm; block FP8: kernels/triton/moe_fp8_grouped.py, persistent TMA GEMMs)
# instead of the fused Triton MoE. H200, rank 0 of EP8 (36 experts, I 2048; python -m
# bench.prefill_moe, 2026-12-05), one MoE layer, fused -> grouped: bf16 1.04 -> 0.80 ms at 2,048
# tokens (455 pairs per expert), 1.39 -> 1.03 at 8,192, 2.46 -> 1.83 at 16,384; FP8 1.04 ->
# 0.42, 1.27 -> 0.78, 2.25 -> 1.40. The whole 8k chunk: bf16 220.9 -> 205.5 ms, FP8 226.7 ->
# 190.5 (bench.fast_path --variant). The bench preset's experts (I 768, 64 experts, 512 pairs
# each at 8k) lost: its 8k prefill 31.5 -> 39.8 ms, hence the width rule. Below 2,048 tokens at
# the rank the grouped path is unmeasured, so it starts there.
GROUPED_MIN_PAIRS_PER_EXPERT: float | None = 450
FP8_GROUPED_MIN_PAIRS_PER_EXPERT: float | None = 450
GROUPED_MIN_INTER = 2048


@functools.cache
def _hopper(device: torch.device) -> bool:
    """The grouped GEMMs need sm_90+ (TMA descriptors; torch._grouped_mm's kernels)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _grouped_fits(x: torch.Tensor, top_k: int, num_experts: int, inter: int, threshold) -> bool:
    if threshold is None or inter < GROUPED_MIN_INTER or not _hopper(x.device):
        return False
    return x.shape[0] * top_k >= threshold * num_experts


def _experts(x: torch.Tensor, top_k: int, num_experts: int, inter: int):
    if fast_path(x):
        if _grouped(x, top_k, num_experts, inter):
            from kernels.triton.moe_grouped import experts_grouped

            return experts_grouped
        from kernels.triton.moe import experts

        return experts
    if x.is_cuda and x.shape[0] <= DENSE_EXPERTS_MAX_TOKENS:
        return moe_kernels.experts_dense
    return moe_kernels.experts


def _grouped(x: torch.Tensor, top_k: int, num_experts: int, inter: int) -> bool:
    if x.dtype != torch.bfloat16:  # _grouped_mm syncs for other dtypes
        return False
    return _grouped_fits(x, top_k, num_experts, inter, GROUPED_MIN_PAIRS_PER_EXPERT)


def _experts_fp8(x: torch.Tensor, top_k: int, num_experts: int, inter: int):
    if fast_path(x):
        if _grouped_fits(x, top_k, num_experts, inter, FP8_GROUPED_MIN_PAIRS_PER_EXPERT):
            from kernels.triton.moe_fp8_grouped import experts_fp8_grouped

            return experts_fp8_grouped
        from kernels.triton.moe import experts_fp8

        return experts_fp8
    return moe_kernels.experts_fp8  # sync-free too: capturable at any batch size


def max_captured_tokens(device: torch.device) -> int | None:
    """The most tokens one captured forward may hold on `device` (None: no limit)."""
    probe = torch.empty(0, device=device)
    return None if fast_path(probe) else DENSE_EXPERTS_MAX_TOKENS


def make_mlp(config: ModelConfig, layer: int, dtype: torch.dtype) -> nn.Module:
    if layer < config.num_hidden_layers and config.mlp_layer_types[layer] == "dense":
        return DenseMLP(
            config.hidden_size, config.intermediate_size, config.swiglu_limit, dtype, "dense_mlp"
        )
    return MoE(config, dtype)

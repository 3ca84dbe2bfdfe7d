"""One rank's memory plan from config.json alone: no weights, no device.

Weights per rank come from the sharded modules built on the meta device (the code that builds
them for serving), bytes per token and per request row from the pool's own formulas
(serving/memory/pool.py), rows = running + extra + 1 (the padding row). `python -m
serving.tools.plan` prints it; a worker logs it at start-up beside what it actually built, so a
difference between the two is seen at once.

Block-FP8 checkpoints are planned as a CUDA rank loads them: the modules whose checkpoint
tensors are FP8 (read from the safetensors headers) hold 1-byte weights plus float32 scales,
minus the kinds in --fp8-keep-bf16. A config-only checkpoint with `quantization_config`
(`tiny_model --preset real --fp8`) counts every module with FP8 kernels as FP8, as a simulated
rank builds it. The projection shapes a CUDA start-up finds FP8 not faster for
(serving/models/fp8_choice.py) are dense in the plan that worker logs; offline they count FP8.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from serving.config import ModelConfig
from serving.distributed import ParallelState, check_sizes, rank_cache_config, set_state, state
from serving.memory.cache import tail_slots_for
from serving.memory.pool import (
    fit_kv_tokens,
    kda_state_bytes,
    row_bytes,
    table_width,
    token_bytes,
)
from serving.models.fp8_loading import fp8_modules, hold_fp8_modules
from serving.models.fp8_weights import TensorInfo, fp8_weights, read_header
from serving.models.glm5_next import Glm5NextForCausalLM
from serving.models.nextn import NextNDraft
from serving.models.vision import VisionTower, activation_bytes, graph_bytes

GIB = 2**30


@dataclass(frozen=True)
class Fp8Plan:
    """What decides which modules hold FP8: the checkpoint's headers (None: config only), the
    kinds kept in bf16, and the projection shapes a worker's start-up found FP8 not faster for
    (serving/models/fp8_choice.py; None: not decided, as offline, where every one counts FP8)."""

    header: dict[str, TensorInfo] | None
    fp8: frozenset[str]
    keep_bf16: frozenset[str]
    dense_shapes: frozenset[tuple[int, int]] | None = None

    def describe(self, stored: str) -> str:
        kept = f", {','.join(sorted(self.keep_bf16))} kept in {stored}" if self.keep_bf16 else ""
        if self.dense_shapes:
            kept += f", {len(self.dense_shapes)} projection shapes in {stored} (FP8 not faster)"
        return f"block FP8 + {stored}{kept}"


def fp8_plan(
    model_path: str, config: ModelConfig, keep_bf16: frozenset[str], headers: bool = True
) -> Fp8Plan | None:
    """The FP8 plan of a checkpoint: from its safetensors headers, else (no files, or headers
    False: a simulated rank builds from config.json alone) from `quantization_config`."""
    files = sorted(Path(model_path).glob("*.safetensors")) if headers else []
    if files:
        header = {}
        for path in files:
            header.update(read_header(path))
        fp8 = fp8_weights(header)
        return Fp8Plan(header, frozenset(fp8), keep_bf16) if fp8 else None
    if config.quantization is not None:
        return Fp8Plan(None, frozenset(), keep_bf16)
    return None


def module_weights(
    config: ModelConfig, dtype: torch.dtype, draft: bool, fp8: Fp8Plan | None = None
) -> tuple[int, int]:
    """(parameters, bytes) of the target (+ draft) as the current ParallelState shards them and
    a CUDA rank holds them (FP8 modules: 1-byte weights plus their float32 scales)."""
    with torch.device("meta"):
        modules = {"target": Glm5NextForCausalLM(config, dtype)}
        if draft:
            modules["draft"] = NextNDraft(config, dtype)
        if config.vision is not None:  # whole, in the model dtype (never FP8), on rank 0 only
            # (the binding rank: TP/EP followers take its embeddings, tp_worker.py)
            modules["vision"] = VisionTower(config.vision, dtype)
    if fp8 is not None:
        selected = fp8_modules(
            modules, fp8.header, set(fp8.fp8), config, draft, state(), fp8.keep_bf16
        )
        hold_fp8_modules(selected, fp8.dense_shapes or frozenset())
    params = [p for m in modules.values() for p in m.parameters()]
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


@dataclass(frozen=True)
class RankPlan:
    tp_size: int
    ep_size: int
    dtype: torch.dtype
    draft: bool
    full_params: int  # the whole model, one rank
    full_weight_bytes: int
    params: int  # one rank's shard
    weight_bytes: int
    running: int
    extra: int
    context: int
    row_bytes: int  # per request row: KDA states + compression tails
    kda_row_bytes: int
    token_bytes: int  # per KV token (replicated over the ranks)
    page_size: int
    mem_fraction_static: float
    total_memory: int | None  # device bytes; None: no device plan (the CPU)
    fp8: Fp8Plan | None = None
    # the prefix cache's KDA snapshots: this share of the KV pool's bytes again (plan_pool's
    # rule, --mamba-full-memory-ratio; 0: no cache, as on PD decode)
    snapshot_ratio: float = 0.0
    vision_peak: int = 0  # bytes kept free for the vision tower (vision_peak below)
    vision_tokens: int = 0  # the image tokens one step encodes at most
    vision_graph_tokens: int = 0  # with the tower's CUDA graphs: one image's most tokens

    @property
    def rows(self) -> int:
        """Request rows allocated: running + extra + the padding row."""
        return self.running + self.extra + 1

    @property
    def table_bytes(self) -> int:
        return self.rows * self.context * 8

    def kv_tokens(self) -> int | None:
        """KV tokens per GPU (page-aligned); ValueError when nothing fits, None without a device."""
        if self.total_memory is None:
            return None
        tokens = fit_kv_tokens(
            self.total_memory,
            self.mem_fraction_static,
            self.weight_bytes + self.vision_peak,
            self.running + self.extra,
            self.context,
            self.row_bytes,
            int(self.token_bytes * (1 + self.snapshot_ratio)),
        )
        return tokens - tokens % self.page_size

    def snapshots(self, kv_tokens: int) -> int:
        """State snapshot slots beside `kv_tokens` (plan_pool's rule: at least 2 per row)."""
        by_ratio = int(self.snapshot_ratio * kv_tokens * self.token_bytes / self.kda_row_bytes)
        return max(2 * (self.running + self.extra), by_ratio)

    def lines(self, model: str) -> list[str]:
        name = str(self.dtype).removeprefix("torch.")
        if self.fp8 is not None:
            name = self.fp8.describe(name)
        out = [
            f"model {model}: {self.full_params / 1e9:.1f} B parameters "
            f"({self.full_weight_bytes / GIB:.1f} GiB {name}), draft "
            f"{'yes' if self.draft else 'no'}",
            f"ranks {max(self.tp_size, self.ep_size)} (tp {self.tp_size}, ep {self.ep_size})"
            + (
                f"; device {self.total_memory / GIB:g} GiB x {self.mem_fraction_static} = "
                f"{self.total_memory * self.mem_fraction_static / GIB:.1f} GiB static"
                if self.total_memory is not None
                else "; no device memory to plan against (CPU)"
            ),
            f"weights per rank        {self.weight_bytes / GIB:8.2f} GiB "
            f"({self.params / 1e6:.1f} M parameters)",
            f"request rows            {self.rows:8d} (running {self.running} + extra "
            f"{self.extra} + 1 padding)",
            f"bytes per request row   {self.row_bytes:8d} "
            f"({self.rows * self.row_bytes / GIB:.2f} GiB for all rows)",
            f"KDA state per row       {self.kda_row_bytes:8d} (conv + recurrent state, this "
            "rank's heads)",
            f"request table           {self.table_bytes / GIB:8.2f} GiB ({self.context} positions"
            " x 8 B per row)",
            f"bytes per KV token      {self.token_bytes:8d} (MLA latents + pooled index keys, "
            "replicated)",
        ]
        if self.vision_peak:
            what = (
                f"CUDA graphs holding an image of {self.vision_graph_tokens} tokens, and a "
                "capture's warm-up"
                if self.vision_graph_tokens
                else f"a step of {self.vision_tokens} image tokens"
            )
            out.append(
                f"vision activations      {self.vision_peak / GIB:8.2f} GiB ({what}; the "
                "tower's weights are in the weights)"
            )
        if self.fp8 is not None and self.fp8.dense_shapes is None:
            out.append(
                "FP8 projections         all counted FP8; a CUDA start-up dequantizes the shapes "
                "where FP8 is not faster (--fp8-linears timed) and logs its plan with them"
            )
        try:
            tokens = self.kv_tokens()
        except ValueError as exc:
            return [*out, f"does not fit: {exc}"]
        if tokens is not None:
            out.append(
                f"KV tokens per GPU       {tokens:8d} ({tokens * self.token_bytes / GIB:.2f} GiB; "
                f"{tokens / self.context:.1f} full {self.context}-token contexts)"
            )
            if self.snapshot_ratio > 0 and self.kda_row_bytes:
                slots = self.snapshots(tokens)
                out.append(
                    f"state snapshots         {slots:8d} x {self.kda_row_bytes / 2**20:.1f} MiB "
                    f"({slots * self.kda_row_bytes / GIB:.2f} GiB; --mamba-full-memory-ratio "
                    f"{self.snapshot_ratio:g})"
                )
        return out


def predict_rank(
    config: ModelConfig,
    *,
    tp_size: int,
    ep_size: int,
    dtype: torch.dtype,
    context: int,
    running: int,
    extra: int,
    speculative_steps: int,
    page_size: int,
    mem_fraction_static: float,
    total_memory: int | None,
    rank: int = 0,
    fp8: Fp8Plan | None = None,
    snapshot_ratio: float = 0.0,
    vision_tokens: int = 0,
    vision_graph_tokens: int = 0,
) -> RankPlan:
    """The plan of rank `rank` (ValueError when the sizes do not split the checkpoint).
    vision_tokens: image tokens one prefill step encodes at most (step_image_tokens).
    vision_graph_tokens: with the tower's CUDA graphs, one image's most tokens (0: eager)."""
    check_sizes(config, tp_size, ep_size)
    elem = torch.tensor([], dtype=dtype).element_size()
    draft = speculative_steps > 0
    before = state()
    try:
        set_state(ParallelState())
        full_params, full_bytes = module_weights(config, dtype, draft, fp8)
        set_state(ParallelState(rank, tp_size, ep_size))
        params, weight_bytes = module_weights(config, dtype, draft, fp8)
        local = rank_cache_config(config)
    finally:
        set_state(before)
    return RankPlan(
        tp_size=tp_size,
        ep_size=ep_size,
        dtype=dtype,
        draft=draft,
        full_params=full_params,
        full_weight_bytes=full_bytes,
        params=params,
        weight_bytes=weight_bytes,
        running=running,
        extra=extra,
        context=table_width(context, draft, speculative_steps + 1),
        row_bytes=row_bytes(local, elem, tail_slots_for(config, speculative_steps + 1), draft),
        kda_row_bytes=kda_state_bytes(local, elem),
        token_bytes=token_bytes(config, elem, draft),
        page_size=page_size,
        mem_fraction_static=mem_fraction_static,
        total_memory=total_memory,
        fp8=fp8,
        snapshot_ratio=snapshot_ratio,
        vision_peak=vision_peak(config, vision_tokens, elem, vision_graph_tokens),
        vision_tokens=vision_tokens if config.vision is not None else 0,
        vision_graph_tokens=vision_graph_tokens if config.vision is not None else 0,
    )


def vision_peak(config: ModelConfig, vision_tokens: int, elem: int, graph_tokens: int = 0) -> int:
    """Bytes kept free for the vision tower beside the weights, out of the KV pool's budget
    (0: a text-only model), so the text prefill's activations never count on them. Eager
    (graph_tokens 0): one step's activation peak. With the tower's CUDA graphs (graph_tokens:
    the most tokens of one image, which the front enforces, so no captured grid is larger):
    what the graphs hold for good (graph_bytes) plus a capture's eager warm-up; the tower then
    runs image by image, so no step-wide eager peak occurs."""
    if config.vision is None:
        return 0
    vision = config.vision
    if graph_tokens:
        warm_up = activation_bytes(vision, graph_tokens, elem)
        return graph_bytes(vision, graph_tokens, elem) + warm_up
    return activation_bytes(vision, vision_tokens, elem)

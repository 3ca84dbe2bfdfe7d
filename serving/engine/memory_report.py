"""The memory log of a worker's start-up: serving.tools.plan's prediction for this rank beside
what was built (weights, KV tokens, rows, KDA state per row), and a WARNING when the weights
differ."""

from __future__ import annotations

import dataclasses
import logging

import torch

from serving.config import ModelConfig, parse_fp8_kinds
from serving.distributed import state
from serving.memory.pool import PoolPlan
from serving.models.fp8_choice import LinearChoice
from serving.models.rank_plan import GIB, fp8_plan, predict_rank
from serving.models.vision import step_image_tokens
from serving.server_args import ServerArgs

log = logging.getLogger(__name__)


def vision_step_tokens(args: ServerArgs) -> int:
    """The image tokens one prefill step encodes at most (images of the front's limit)."""
    limit = args.image_token_limit()
    return step_image_tokens(args.chunked_prefill_size, limit)


def vision_graph_tokens(args: ServerArgs) -> int:
    """With the tower's CUDA graphs, the most tokens of one image (the front refuses larger
    ones, so no captured grid is larger); 0 when the tower runs eagerly."""
    if not args.use_vision_graphs():
        return 0
    return args.image_token_limit()


def log_memory_plan(
    args: ServerArgs,
    config: ModelConfig,
    dtype: torch.dtype,
    weight_bytes: int,
    plan: PoolPlan,
    device: str,
    choice: LinearChoice | None = None,
) -> None:
    """serving.tools.plan's prediction for this rank, then what was built beside it; a WARNING
    when the weights differ (the plan or the build is wrong). `choice`: the model holds block
    FP8 (serving/models/fp8_choice.py; None: nothing held FP8, as on the CPU): planned as its
    checkpoint's headers say (a simulated rank: config.json), with the projection shapes the
    load sent to the dense path."""
    ps = state()
    total, fp8 = None, None
    if device == "cuda":
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if choice is not None:
        keep = parse_fp8_kinds(args.fp8_keep_bf16)
        fp8 = fp8_plan(args.model_path, config, keep, headers=not ps.simulated)
        if fp8 is not None:
            fp8 = dataclasses.replace(fp8, dense_shapes=choice.dense_shapes)
    predicted = predict_rank(
        config,
        tp_size=ps.tp_size,
        ep_size=ps.ep_size,
        rank=ps.rank,
        dtype=dtype,
        context=args.context_window(config),
        running=args.running_limit,
        extra=args.decode_extra_slots,
        speculative_steps=args.speculative_steps,
        page_size=plan.page_size,
        mem_fraction_static=args.mem_fraction_static,
        total_memory=total,
        fp8=fp8,
        snapshot_ratio=args.mamba_full_memory_ratio
        if args.radix_cache and args.max_mamba_cache_size is None
        else 0.0,
        vision_tokens=vision_step_tokens(args),
        vision_graph_tokens=vision_graph_tokens(args),
    )
    for line in predicted.lines(args.model_path):
        log.info("memory plan (serving.tools.plan): %s", line)
    tokens = plan.pages * plan.page_size
    used = (
        f"; device memory allocated {torch.cuda.memory_allocated() / GIB:.2f} GiB" if total else ""
    )
    log.info(
        "memory built: weights per GPU %.2f GiB (plan %.2f), KV tokens per GPU %d (plan %s), "
        "request rows %d (running %d + extra %d + 1 padding), KDA state %d B per row%s",
        weight_bytes / GIB,
        predicted.weight_bytes / GIB,
        tokens,
        predicted.kv_tokens() if total else "n/a on the CPU",
        plan.rows + 1,
        args.running_limit,
        args.decode_extra_slots,
        predicted.kda_row_bytes,
        used,
    )
    if weight_bytes != predicted.weight_bytes:
        log.warning(
            "weights per GPU: built %d B, the plan predicts %d B",
            weight_bytes,
            predicted.weight_bytes,
        )

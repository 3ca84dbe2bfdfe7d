"""The composition root: what a worker's scheduler process builds before its loop runs.

build_model: this rank's model shard, NextN draft and memory pool (every rank builds them the
same way; a simulated rank builds random weights for its shard). build_runner, build_eagle: the
forward's runner and EAGLE over them, given this rank's fanout (rank 0 of a TP/EP worker:
RankFanout; followers and one rank: the no-op Fanout). build_engine: rank 0's whole engine, the
scheduler with its role plugged in (also used in-process by tests and tools). prepare and warmup:
the start-up work before the first request.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from kernels import fast_path
from serving.config import ModelConfig, parse_fp8_kinds
from serving.distributed import min_over_ranks, state
from serving.engine.kernel_warmup import prepare_kernels
from serving.engine.memory_report import log_memory_plan, vision_graph_tokens, vision_step_tokens
from serving.engine.request import SchedulerConfig
from serving.engine.role import Role
from serving.engine.scheduler import Scheduler
from serving.engine.tp_worker import RankFanout
from serving.executor.fanout import ONE_RANK, Fanout
from serving.executor.model_runner import ModelRunner
from serving.executor.sampler import Sampler
from serving.executor.streams import use_compute_stream
from serving.memory.pool import MemoryPool, SnapshotBudget, plan_pool
from serving.models.fp8_choice import summary
from serving.models.glm5_next import Glm5NextForCausalLM
from serving.models.loader import load_weights, resolve_dtype
from serving.models.nextn import NextNDraft
from serving.models.random_init import random_vision, random_weights
from serving.models.rank_plan import vision_peak
from serving.models.vision import VisionTower
from serving.models.vision_loader import load_vision
from serving.protocol import GenerateRequest, SchedulerReady
from serving.sampling_params import SamplingParams
from serving.server_args import ServerArgs
from serving.speculative.eagle import Eagle, SpecConfig

log = logging.getLogger(__name__)

SIMULATED = (
    "SIMULATED RANK %d of a world of %d (tp %d, ep %d): random weights, collectives through "
    "torch's fake backend; every answer of this worker is meaningless. For per-rank memory and "
    "speed measurements only, never a deployment."
)


@dataclass
class RankModel:
    """This rank's share of the worker: model shard, draft (None without EAGLE), pool."""

    config: ModelConfig
    dtype: torch.dtype
    model: Glm5NextForCausalLM
    draft: NextNDraft | None
    pool: MemoryPool
    context: int  # the context window the pool was planned for
    vision: VisionTower | None = None  # the checkpoint's vision tower (None: text only)


def build_model(args: ServerArgs) -> RankModel:
    """This rank's model shard, draft and pool. A simulated rank (--simulate-rank) builds
    random weights for its shard instead of loading."""
    device = args.resolved_device()
    use_compute_stream(device)  # before anything is built: weights, pool and graphs live on it
    config = ModelConfig.from_pretrained(args.model_path)
    dtype = resolve_dtype(args.dtype, args.model_path, device)
    torch.manual_seed(args.random_seed)
    steps = args.speculative_steps
    ps = state()
    started = time.monotonic()
    keep = parse_fp8_kinds(args.fp8_keep_bf16)
    if ps.simulated:
        log.warning(SIMULATED, ps.rank, ps.world, ps.tp_size, ps.ep_size)
        model, draft = random_weights(
            config,
            dtype,
            device,
            args.random_seed,
            draft=steps > 0,
            keep_bf16=keep,
            fp8_linears=args.fp8_linears,
        )
    else:
        model, draft = load_weights(
            args.model_path,
            config,
            dtype,
            device,
            load_draft=steps > 0,
            keep_bf16=keep,
            fp8_linears=args.fp8_linears,
        )
    # PD decode receives KV and states only, and a TP/EP follower rank receives rank 0's
    # image embeddings (tp_worker.RankFanout.forward): neither builds or plans for a vision
    # tower (the config itself keeps vision_config: the PD handshake's fingerprint covers it)
    decode = args.disaggregation_mode == "decode"
    towerless = decode or (ps.rank > 0 and not ps.simulated)
    planned = dataclasses.replace(config, vision=None) if towerless else config
    vision = None
    if planned.vision is not None:
        vision = (
            random_vision(config, dtype, device, args.random_seed)
            if ps.simulated
            else load_vision(args.model_path, config, dtype, device)
        )
    _sync(device)
    log.info(
        "start-up: weights %s in %.1f s",
        ("built (random, block FP8)" if model.fp8_choice is not None else "built (random)")
        if ps.simulated
        else "loaded",
        time.monotonic() - started,
    )
    modules = [m for m in (model, draft, vision) if m is not None]
    weight_bytes = sum(p.numel() * p.element_size() for m in modules for p in m.parameters())
    # the tower's activations (one step's images, or what its CUDA graphs hold) are kept free
    # beside the weights
    elem = torch.tensor([], dtype=dtype).element_size()
    reserved = vision_peak(planned, vision_step_tokens(args), elem, vision_graph_tokens(args))
    num_params = sum(p.numel() for m in modules for p in m.parameters())
    kv_dtype = torch.bfloat16 if args.kv_cache_dtype in ("bf16", "bfloat16") else dtype
    context = args.context_window(config)
    plan = plan_pool(
        config,
        rows=args.running_limit + args.decode_extra_slots,
        max_context=context,
        page_size=args.page_size,
        dtype=kv_dtype,
        device=device,
        max_total_tokens=args.max_total_tokens,
        mem_fraction_static=args.mem_fraction_static,
        weight_bytes=weight_bytes + reserved,
        with_draft=steps > 0,
        num_draft_tokens=steps + 1,
        snapshots=SnapshotBudget(args.mamba_full_memory_ratio, args.max_mamba_cache_size)
        if args.radix_cache
        else None,
    )
    if ps.world > 1:  # rank 0 hands out pages and slots that every rank's pool must have
        plan = dataclasses.replace(
            plan,
            pages=min_over_ranks(plan.pages),
            state_slots=min_over_ranks(plan.state_slots),
        )
    started = time.monotonic()
    pool = MemoryPool(config, plan, kv_dtype, device)
    _sync(device)
    log.info(
        "rank %d/%d (tp %d, ep %d): %s %s: %.1f M parameters (%.2f GiB), %s on %s, %s; "
        "pool: %s (allocated in %.1f s)",
        ps.rank,
        ps.world,
        ps.tp_size,
        ps.ep_size,
        "random weights for" if ps.simulated else "loaded",
        args.model_path,
        num_params / 1e6,
        weight_bytes / 2**30,
        dtype,
        device,
        f"speculative EAGLE {steps} step(s) with the NextN draft" if steps else "no speculation",
        pool.describe(),
        time.monotonic() - started,
    )
    log_memory_plan(args, planned, dtype, weight_bytes, plan, device, model.fp8_choice)
    return RankModel(config, dtype, model, draft, pool, context, vision)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def build_runner(args: ServerArgs, built: RankModel, fanout: Fanout = ONE_RANK) -> ModelRunner:
    """The forward's runner, its decode graphs captured (none with EAGLE: decode is Eagle's).
    The vision tower (rank 0's alone under TP/EP) runs in its prefill steps, through CUDA
    graphs captured as image sizes come when --cuda-graph-backend-vision is on."""
    runner = ModelRunner(built.model, built.pool, fanout, built.vision)
    if built.vision is not None and args.use_vision_graphs():  # captured per image size later
        runner.enable_vision_graphs(args.cuda_graph_vision_max_shapes, vision_graph_tokens(args))
    if args.use_decode_graphs() and args.speculative_steps == 0:
        started = time.monotonic()
        runner.enable_decode_graphs(args.cuda_graph_max_bs_decode)
        log.info(
            "start-up: decode graphs up to batch %d captured in %.1f s",
            args.cuda_graph_max_bs_decode,
            time.monotonic() - started,
        )
    return runner


def build_eagle(
    args: ServerArgs, built: RankModel, sampler: Sampler | None, fanout: Fanout = ONE_RANK
) -> Eagle | None:
    """EAGLE over the model and its draft, its graphs captured; None without speculation.
    sampler: None on a follower (only rank 0 samples)."""
    if args.speculative_steps == 0:
        return None
    spec = Eagle(
        built.model, built.draft, built.pool, sampler, SpecConfig(args.speculative_steps), fanout
    )
    if args.use_decode_graphs():
        started = time.monotonic()
        spec.enable_graphs(args.cuda_graph_max_bs_decode)
        log.info(
            "start-up: EAGLE graphs up to batch %d captured in %.1f s",
            args.cuda_graph_max_bs_decode,
            time.monotonic() - started,
        )
    return spec


def build_engine(args: ServerArgs, role: Role | None = None) -> tuple[Scheduler, SchedulerReady]:
    """Model + pool + runner + sampler + scheduler for `args`, and the ready message for the
    front. `role` plugs a worker role (workers/prefill.py, workers/decode.py) into the
    scheduler. Under TP/EP this is rank 0; its fanout sends every forward to the other ranks."""
    device = args.resolved_device()
    role = role if role is not None else Role()
    built = build_model(args)
    pool, ps = built.pool, state()
    fanout = RankFanout(pool, ps.processes - 1) if ps.processes > 1 else ONE_RANK
    runner = build_runner(args, built, fanout)
    tokenizer_file = os.path.join(args.tokenizer_path or args.model_path, "tokenizer.json")
    sampler = Sampler(
        built.config.vocab_size, device, args.random_seed, tokenizer_file=tokenizer_file
    )
    spec = build_eagle(args, built, sampler, fanout)
    tokenizer = Tokenizer.from_file(tokenizer_file)
    scheduler = Scheduler(
        runner,
        pool,
        sampler,
        SchedulerConfig(
            args.running_limit,
            args.chunked_prefill_size,
            args.max_prefill_tokens,
            built.context,
            args.queue_limit,
            prefix_cache=args.radix_cache,
            page_cache=args.decode_page_cache,
            track_interval=args.mamba_track_interval,
            overlap=not args.disable_overlap_schedule,
            disaggregation_mode=args.disaggregation_mode,
            decode_log_interval=args.decode_log_interval,
            log_requests=args.log_requests,
        ),
        frozenset(built.config.eos_token_ids),
        detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
        hooks=role,
        spec=spec,
    )
    role.attach(scheduler, pool, fanout)
    model, draft = built.model, built.draft
    roles = {"target": model} if draft is None else {"target": model, "draft": draft}
    fp8 = summary(roles, model.fp8_choice, parse_fp8_kinds(args.fp8_keep_bf16))
    ready = SchedulerReady(
        vocab_size=built.config.vocab_size,
        context_length=built.context,
        eos_token_ids=list(built.config.eos_token_ids),
        max_running_requests=args.running_limit,
        total_rows=pool.plan.rows,
        total_pages=pool.plan.pages,
        page_size=pool.plan.page_size,
        device=device,
        dtype=str(built.dtype).removeprefix("torch."),
        fp8=fp8,
    )
    return scheduler, ready


def prepare(scheduler: Scheduler, image_tokens: int = 0) -> None:
    """Compile and tune the Triton kernels every prefill shape needs (engine/kernel_warmup.py),
    on the fast path only (CPU runs torch). Not skipped by --skip-server-warmup, which skips
    SGLang's warm-up request only: a kernel compiled under a user's request costs it seconds.
    image_tokens: ServerArgs.image_token_limit() where the model has a vision tower."""
    if fast_path(scheduler.pool.req_to_token):
        started = time.monotonic()
        count = prepare_kernels(scheduler, image_tokens)
        log.info(
            "start-up: kernels prepared by %d requests in %.1f s",
            count,
            time.monotonic() - started,
        )


def warmup(scheduler: Scheduler) -> None:
    scheduler.add(
        GenerateRequest("warmup", [1, 2, 3, 4], SamplingParams(max_new_tokens=2, temperature=0.0))
    )
    while scheduler.has_work:
        scheduler.step()

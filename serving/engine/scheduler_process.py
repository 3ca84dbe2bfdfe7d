"""The scheduler process: loads the model, owns the pools, runs the batching loop.

It talks to the HTTP front over two ZMQ sockets (serving/protocol.py). It exits when the front
says so, when its parent dies, or when one step outlives --watchdog-timeout.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import traceback

from serving.executor.fanout import ONE_RANK
from serving.protocol import (
    SHUTDOWN,
    AbortRequest,
    BatchOutput,
    ControlReply,
    ControlRequest,
    FlushCache,
    GenerateRequest,
    SamplingParams,
    SchedulerFailed,
    SchedulerReady,
    StartProfile,
    StopProfile,
)
from serving.server_args import ServerArgs

log = logging.getLogger(__name__)


SIMULATED = (
    "SIMULATED RANK %d of a world of %d (tp %d, ep %d): random weights, collectives through "
    "torch's fake backend; every answer of this worker is meaningless. For per-rank memory and "
    "speed measurements only, never a deployment."
)


def build_model(args: ServerArgs):
    """This rank's model shard, draft, pool and runner (every rank builds these the same way).
    A simulated rank (--simulate-rank) builds random weights for its shard instead of loading."""
    import torch

    from serving.config import ModelConfig, parse_fp8_kinds
    from serving.distributed import min_over_ranks, state
    from serving.executor.streams import use_compute_stream
    from serving.memory.pool import MemoryPool, SnapshotBudget, plan_pool
    from serving.models.loader import load_weights, resolve_dtype
    from serving.models.random_init import random_weights

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
    _sync(device)
    log.info(
        "start-up: weights %s in %.1f s",
        ("built (random, block FP8)" if model.fp8_choice is not None else "built (random)")
        if ps.simulated
        else "loaded",
        time.monotonic() - started,
    )
    modules = [model] if draft is None else [model, draft]
    weight_bytes = sum(p.numel() * p.element_size() for m in modules for p in m.parameters())
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
        weight_bytes=weight_bytes,
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
    log_memory_plan(args, config, dtype, weight_bytes, plan, device, model.fp8_choice)
    return config, dtype, model, draft, pool, plan, context


def build_runner(args: ServerArgs, model, pool, fanout=ONE_RANK):
    """The forward's runner, its decode graphs captured (none with EAGLE: decode is Eagle's)."""
    from serving.executor.model_runner import ModelRunner

    runner = ModelRunner(model, pool, fanout)
    if args.use_decode_graphs() and args.speculative_steps == 0:
        started = time.monotonic()
        runner.enable_decode_graphs(args.cuda_graph_max_bs_decode)
        log.info(
            "start-up: decode graphs up to batch %d captured in %.1f s",
            args.cuda_graph_max_bs_decode,
            time.monotonic() - started,
        )
    return runner


def build_eagle(args: ServerArgs, model, draft, pool, sampler, fanout=ONE_RANK):
    """EAGLE over the model and its draft, its graphs captured; None without speculation.
    sampler: None on a follower (only rank 0 samples)."""
    if args.speculative_steps == 0:
        return None
    from serving.speculative.eagle import Eagle, SpecConfig

    spec = Eagle(model, draft, pool, sampler, SpecConfig(args.speculative_steps), fanout)
    if args.use_decode_graphs():
        started = time.monotonic()
        spec.enable_graphs(args.cuda_graph_max_bs_decode)
        log.info(
            "start-up: EAGLE graphs up to batch %d captured in %.1f s",
            args.cuda_graph_max_bs_decode,
            time.monotonic() - started,
        )
    return spec


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def log_memory_plan(
    args: ServerArgs, config, dtype, weight_bytes: int, plan, device: str, choice=None
) -> None:
    """serving.tools.plan's prediction for this rank, then what was built beside it; a WARNING
    when the weights differ (the plan or the build is wrong). `choice`: the model holds block
    FP8 (serving/models/fp8_choice.py; None: nothing held FP8, as on the CPU): planned as its
    checkpoint's headers say (a simulated rank: config.json), with the projection shapes the
    load sent to the dense path."""
    import torch

    from serving.config import parse_fp8_kinds
    from serving.distributed import state
    from serving.models.rank_plan import GIB, fp8_plan, predict_rank

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


def build_engine(args: ServerArgs, role=None):
    """Model + pool + runner + sampler + scheduler for `args` (also used in-process by tests).

    `role` plugs a worker role (workers/prefill.py, workers/decode.py) into the scheduler.
    Under TP/EP this is rank 0; its fanout sends every forward to the other ranks."""
    from tokenizers import Tokenizer

    from serving.config import parse_fp8_kinds
    from serving.distributed import state
    from serving.engine.request import SchedulerConfig
    from serving.engine.role import Role
    from serving.engine.scheduler import Scheduler
    from serving.engine.tp_worker import RankFanout
    from serving.executor.sampler import Sampler
    from serving.models.fp8_choice import summary

    device = args.resolved_device()
    role = role if role is not None else Role()
    config, dtype, model, draft, pool, plan, context = build_model(args)
    ps = state()
    fanout = RankFanout(pool, ps.processes - 1) if ps.processes > 1 else ONE_RANK
    runner = build_runner(args, model, pool, fanout)
    tokenizer_file = os.path.join(args.tokenizer_path or args.model_path, "tokenizer.json")
    sampler = Sampler(config.vocab_size, device, args.random_seed, tokenizer_file=tokenizer_file)
    spec = build_eagle(args, model, draft, pool, sampler, fanout)
    tokenizer = Tokenizer.from_file(tokenizer_file)
    scheduler = Scheduler(
        runner,
        pool,
        sampler,
        SchedulerConfig(
            args.running_limit,
            args.chunked_prefill_size,
            args.max_prefill_tokens,
            context,
            args.queue_limit,
            prefix_cache=args.radix_cache,
            track_interval=args.mamba_track_interval,
            overlap=not args.disable_overlap_schedule,
            disaggregation_mode=args.disaggregation_mode,
            decode_log_interval=args.decode_log_interval,
            log_requests=args.log_requests,
        ),
        frozenset(config.eos_token_ids),
        detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
        hooks=role,
        spec=spec,
    )
    role.attach(scheduler, pool, fanout)
    roles = {"target": model} if draft is None else {"target": model, "draft": draft}
    fp8 = summary(roles, model.fp8_choice, parse_fp8_kinds(args.fp8_keep_bf16))
    ready = SchedulerReady(
        vocab_size=config.vocab_size,
        context_length=context,
        eos_token_ids=list(config.eos_token_ids),
        max_running_requests=args.running_limit,
        total_rows=plan.rows,
        total_pages=plan.pages,
        page_size=plan.page_size,
        device=device,
        dtype=str(dtype).removeprefix("torch."),
        fp8=fp8,
    )
    return scheduler, ready


def prepare(scheduler) -> None:
    """Compile and tune the Triton kernels every prefill shape needs (engine/kernel_warmup.py),
    on the fast path only (CPU runs torch). Not skipped by --skip-server-warmup, which skips
    SGLang's warm-up request only: a kernel compiled under a user's request costs it seconds."""
    from kernels import fast_path
    from serving.engine.kernel_warmup import prepare_kernels

    if fast_path(scheduler.pool.req_to_token):
        started = time.monotonic()
        count = prepare_kernels(scheduler)
        log.info(
            "start-up: kernels prepared by %d requests in %.1f s",
            count,
            time.monotonic() - started,
        )


def warmup(scheduler) -> None:
    scheduler.add(
        GenerateRequest("warmup", [1, 2, 3, 4], SamplingParams(max_new_tokens=2, temperature=0.0))
    )
    while scheduler.has_work:
        scheduler.step()


class Watchdog:
    """Kills the process when one step takes longer than `timeout` seconds (a hung kernel)."""

    def __init__(self, timeout: float) -> None:
        self.timeout, self.started = timeout, None
        threading.Thread(target=self._watch, daemon=True, name="watchdog").start()

    def _watch(self) -> None:
        parent = os.getppid()
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(0)  # the front is gone; no orphan
            started = self.started
            if started is not None and time.monotonic() - started > self.timeout:
                log.error(
                    "a scheduler step ran over --watchdog-timeout %.0fs; exiting", self.timeout
                )
                os._exit(1)


def answer_control(msg: ControlRequest, scheduler, profiler) -> ControlReply:
    """The scheduler's reply to an admin command (the front's /flush_cache, /start_profile,
    /stop_profile); an error reply for a command it does not know."""
    if isinstance(msg, FlushCache):
        return ControlReply(msg.id, scheduler.flush_cache())
    if isinstance(msg, StartProfile):
        return ControlReply(msg.id, profiler.start(msg))
    if isinstance(msg, StopProfile):
        error, paths = profiler.stop()
        return ControlReply(msg.id, error, paths)
    return ControlReply(msg.id, f"unknown command {type(msg).__name__}")


def run_scheduler(args: ServerArgs, recv_addr: str, send_addr: str, make_role=None) -> None:
    """Process main. `make_role(args)` builds the worker role (None: a plain worker)."""
    import zmq

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.bind(recv_addr)
    send = ctx.socket(zmq.PUSH)
    send.connect(send_addr)
    started = time.monotonic()
    try:
        if args.world_size > 1:
            from serving.engine.tp_worker import join_group

            join_group(args, 0)
        from serving.engine.role import Role

        role = make_role(args) if make_role is not None else Role()
        scheduler, ready = build_engine(args, role)
        prepare(scheduler)
        if not args.skip_server_warmup:
            warm = time.monotonic()
            warmup(scheduler)
            log.info("start-up: warm-up request in %.1f s", time.monotonic() - warm)
        log.info(
            "start-up: scheduler ready %.1f s after its process began", time.monotonic() - started
        )
        if args.simulate_rank is not None:
            log.warning(SIMULATED, args.simulate_rank, args.world_size, args.tp_size, args.ep_size)
    except Exception as exc:  # report one line to the operator, the trace to the log
        log.debug("start-up failed:\n%s", traceback.format_exc())
        send.send_pyobj(SchedulerFailed(f"{type(exc).__name__}: {exc}"))
        time.sleep(0.5)
        return
    send.send_pyobj(ready)
    watchdog = Watchdog(args.watchdog_timeout)
    fanout = scheduler.runner.fanout  # TP/EP: the other ranks follow this one's forwards
    from serving.distributed import state
    from serving.engine.profiler import ProfileControl, RankProfiler, rank_name

    own = RankProfiler(rank_name(state().rank, args.ep_size), args.profile_dir)
    profiler = ProfileControl(own, fanout)
    last_stats = None
    poller = zmq.Poller()
    for sock in [recv, *role.sockets()]:
        poller.register(sock, zmq.POLLIN)
    while True:
        events = dict(poller.poll(0 if scheduler.has_work else 2 if role.busy else 50))
        while events.get(recv) or recv.poll(0):
            events.pop(recv, None)
            msg = recv.recv_pyobj()
            if msg == SHUTDOWN:
                fanout.stop()
                return
            if isinstance(msg, GenerateRequest):
                role.submit(msg)
            elif isinstance(msg, AbortRequest):
                role.abort(msg.rid, msg.reason)
            elif isinstance(msg, ControlRequest):
                send.send_pyobj(answer_control(msg, scheduler, profiler))
        role.poll()
        if scheduler.has_work or scheduler.pending_outputs:
            watchdog.started = time.monotonic()
            with profiler.step_range():
                outputs = scheduler.step()
            watchdog.started = None
            profiler.after_step()
        else:
            outputs = []
            scheduler.refresh_stats()
            fanout.keepalive()
        if outputs or scheduler.stats != last_stats:
            last_stats = dataclasses.replace(scheduler.stats)
            send.send_pyobj(BatchOutput(outputs, last_stats))


def run_follower(args: ServerArgs, rank: int, make_role=None) -> None:
    """Process main of TP/EP rank `rank` > 0: the same model shard and pool as rank 0, running
    whatever rank 0 broadcasts (tp_worker.Follower), until rank 0 says stop. Any failure exits
    non-zero (the launcher names the rank); the group's timeout bounds every wait. `make_role(args,
    pool)` builds the follower's end of a PD role (workers/rank_transfer.py), which answers
    rank 0's role orders; None: a plain worker."""
    from serving.engine.tp_worker import Follower, join_group

    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s",
    )
    Watchdog(args.watchdog_timeout)  # exits with the launcher
    join_group(args, rank)
    from serving.distributed import destroy_parallel
    from serving.engine.profiler import RankProfiler, rank_name

    log.info("rank %d of %d: pid %d", rank, args.world_size, os.getpid())
    config, dtype, model, draft, pool, _, _ = build_model(args)
    runner = build_runner(args, model, pool)
    spec = build_eagle(args, model, draft, pool, None)
    role = make_role(args, pool) if make_role is not None else None
    profiler = RankProfiler(rank_name(rank, args.ep_size), args.profile_dir)
    decode = args.disaggregation_mode == "decode"
    Follower(runner, spec, role, profiler, config.hidden_size, dtype, decode).follow()
    destroy_parallel()

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

from serving.protocol import (
    SHUTDOWN,
    AbortRequest,
    BatchOutput,
    GenerateRequest,
    SamplingParams,
    SchedulerFailed,
    SchedulerReady,
)
from serving.server_args import ServerArgs

log = logging.getLogger(__name__)


def build_engine(args: ServerArgs, role=None):
    """Model + pool + runner + sampler + scheduler for `args` (also used in-process by tests).

    `role` plugs a worker role (workers/prefill.py, workers/decode.py) into the scheduler."""
    import torch
    from tokenizers import Tokenizer

    from serving.config import ModelConfig
    from serving.engine.request import SchedulerConfig
    from serving.engine.scheduler import Scheduler
    from serving.executor.model_runner import ModelRunner
    from serving.executor.sampler import Sampler
    from serving.memory.pool import MemoryPool, plan_pool
    from serving.models.loader import load_weights, resolve_dtype

    device = args.resolved_device()
    config = ModelConfig.from_pretrained(args.model_path)
    dtype = resolve_dtype(args.dtype, args.model_path)
    torch.manual_seed(args.random_seed)
    steps = args.speculative_steps
    model, draft = load_weights(args.model_path, config, dtype, device, load_draft=steps > 0)
    modules = [model] if draft is None else [model, draft]
    weight_bytes = sum(p.numel() * p.element_size() for m in modules for p in m.parameters())
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
    )
    pool = MemoryPool(config, plan, kv_dtype, device)
    log.info(
        "loaded %s: %.1f M parameters, %s on %s; pool: %s",
        args.model_path,
        weight_bytes / dtype.itemsize / 1e6,
        dtype,
        device,
        pool.describe(),
    )
    runner = ModelRunner(model, pool)
    if args.use_decode_graphs() and steps == 0:  # with EAGLE, decode is Eagle.step
        runner.enable_decode_graphs(args.cuda_graph_max_bs_decode)
    tokenizer_file = os.path.join(args.tokenizer_path or args.model_path, "tokenizer.json")
    sampler = Sampler(config.vocab_size, device, args.random_seed, tokenizer_file=tokenizer_file)
    spec = None
    if steps > 0:
        from serving.speculative.eagle import Eagle, SpecConfig

        spec = Eagle(model, draft, pool, sampler, SpecConfig(steps))
        if args.use_decode_graphs():
            spec.enable_graphs(args.cuda_graph_max_bs_decode)
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
        ),
        frozenset(config.eos_token_ids),
        detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
        role=role,
        spec=spec,
    )
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
    )
    return scheduler, ready


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
    try:
        role = make_role(args) if make_role is not None else None
        scheduler, ready = build_engine(args, role)
        if not args.skip_server_warmup:
            warmup(scheduler)
    except Exception as exc:  # report one line to the operator, the trace to the log
        log.debug("start-up failed:\n%s", traceback.format_exc())
        send.send_pyobj(SchedulerFailed(f"{type(exc).__name__}: {exc}"))
        time.sleep(0.5)
        return
    send.send_pyobj(ready)
    watchdog = Watchdog(args.watchdog_timeout)
    role = scheduler.role
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
                return
            if isinstance(msg, GenerateRequest):
                role.submit(msg)
            elif isinstance(msg, AbortRequest):
                role.abort(msg.rid, msg.reason)
        role.poll()
        if scheduler.has_work or scheduler.pending_outputs:
            watchdog.started = time.monotonic()
            outputs = scheduler.step()
            watchdog.started = None
        else:
            outputs = []
            scheduler.refresh_stats()
        if outputs or scheduler.stats != last_stats:
            last_stats = dataclasses.replace(scheduler.stats)
            send.send_pyobj(BatchOutput(outputs, last_stats))

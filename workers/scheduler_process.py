"""The scheduler process: its main on rank 0 (run_scheduler: builds the engine, then the ZMQ
loop) and on every other rank of a TP/EP worker (run_follower: the same model shard and pool,
running whatever rank 0 broadcasts).

It lives in workers/, above the engine, because it picks the worker's role: the plain Role, or
a PD role (workers/prefill.py, workers/decode.py; on ranks > 0 rank_transfer.FollowerKV), which
the engine must not import. rank 0 talks to the HTTP front over two ZMQ sockets
(serving/protocol.py) and exits when the front says so, when its parent dies, or when one step
outlives --watchdog-timeout.

The launcher (serving/launch_server.py, whose process runs the HTTP front) imports this module to
spawn the process mains: it must not load torch, so everything heavy is imported inside them.
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
    ControlReply,
    ControlRequest,
    FlushCache,
    GenerateRequest,
    SchedulerFailed,
    StartProfile,
    StopProfile,
)
from serving.server_args import ServerArgs

log = logging.getLogger(__name__)


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


def make_role(args: ServerArgs):
    """Rank 0's role for --disaggregation-mode."""
    if args.disaggregation_mode == "prefill":
        from workers.prefill import PrefillRole

        return PrefillRole(args)
    if args.disaggregation_mode == "decode":
        from workers.decode import DecodeRole

        return DecodeRole(args)
    from serving.engine.role import Role

    return Role()


def answer_control(msg: ControlRequest, scheduler, profiler) -> ControlReply:
    """The scheduler's reply to an admin command (the front's /flush_cache, /start_profile,
    /stop_profile); an error reply for a command it does not know."""
    match msg:
        case FlushCache():
            return ControlReply(msg.id, scheduler.flush_cache())
        case StartProfile():
            return ControlReply(msg.id, profiler.start(msg))
        case StopProfile():
            error, paths = profiler.stop()
            return ControlReply(msg.id, error, paths)
    return ControlReply(msg.id, f"unknown command {type(msg).__name__}")


def run_scheduler(args: ServerArgs, recv_addr: str, send_addr: str) -> None:
    """Rank 0's process main."""
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
        from serving.engine.build import SIMULATED, build_engine, prepare, warmup

        role = make_role(args)
        scheduler, ready = build_engine(args, role)
        prepare(scheduler, args.image_token_limit())
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
    # the stats before ready: the front reports healthy on ready, and /server_info must not
    # answer without them (a fresh server's empty internal_states failed tests under load)
    scheduler.refresh_stats()
    last_stats = dataclasses.replace(scheduler.stats)
    send.send_pyobj(BatchOutput([], last_stats))
    send.send_pyobj(ready)
    watchdog = Watchdog(args.watchdog_timeout)
    fanout = scheduler.runner.fanout  # TP/EP: the other ranks follow this one's forwards
    from serving.distributed import state
    from serving.engine.profiler import ProfileControl, RankProfiler, rank_name

    own = RankProfiler(rank_name(state().rank, args.ep_size), args.profile_dir)
    profiler = ProfileControl(own, fanout)
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
            match msg:
                case GenerateRequest():
                    role.submit(msg)
                case AbortRequest():
                    role.abort(msg.rid, msg.reason)
                case ControlRequest():
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


def run_follower(args: ServerArgs, rank: int) -> None:
    """Process main of TP/EP rank `rank` > 0: the same model shard and pool as rank 0, running
    whatever rank 0 broadcasts (tp_worker.Follower), until rank 0 says stop. Any failure exits
    non-zero (the launcher names the rank); the group's timeout bounds every wait. On a PD
    worker its role plug (workers/rank_transfer.FollowerKV) answers rank 0's role orders."""
    from serving.engine.tp_worker import Follower, join_group

    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s",
    )
    Watchdog(args.watchdog_timeout)  # exits with the launcher
    join_group(args, rank)
    from serving.distributed import destroy_parallel
    from serving.engine.build import build_eagle, build_model, build_runner
    from serving.engine.profiler import RankProfiler, rank_name

    log.info("rank %d of %d: pid %d", rank, args.world_size, os.getpid())
    built = build_model(args)
    runner = build_runner(args, built)
    spec = build_eagle(args, built, None)
    role = None
    if args.disaggregation_mode != "null":
        from workers.rank_transfer import FollowerKV

        role = FollowerKV(args, built.pool)
    profiler = RankProfiler(rank_name(rank, args.ep_size), args.profile_dir)
    decode = args.disaggregation_mode == "decode"
    hidden = built.config.hidden_size
    Follower(runner, spec, role, profiler, hidden, built.dtype, decode).follow()
    destroy_parallel()

"""Entry point: `python -m serving.launch_server --model-path DIR [SGLang flags]`.

The main process runs the HTTP front (FastAPI + uvicorn); a spawned child runs the scheduler
(model, pools, batching). They talk over two ZMQ ipc sockets in a private temp directory.
SIGINT/SIGTERM drain in-flight requests, then both processes exit.

With --tp-size/--ep-size N the scheduler is rank 0 of N spawned rank processes (one per GPU;
gloo processes on CPU) that rendezvous on --nccl-port (or --dist-init-addr across --nnodes).
When any rank dies the worker fails (the front answers 503), the others are stopped, and the
launcher exits non-zero naming the rank. On a node other than 0 only followers run, no front.
With --simulate-rank R the scheduler process is rank R alone (no followers; docs/DEPLOY.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import shutil
import socket
import sys
import tempfile
import threading
import time

from serving.config import ConfigError, ModelConfig
from serving.server_args import ArgsError, ServerArgs


def main(argv: list[str] | None = None) -> None:
    args = ServerArgs.from_cli(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        args.validate()
        args.validate_for_model(ModelConfig.from_pretrained(args.model_path))
        if args.rank_processes > 1 and args.nccl_port is None and not args.dist_init_addr:
            args = dataclasses.replace(args, nccl_port=_free_port())
        if args.simulate_rank is not None:
            logging.warning(
                "--simulate-rank %d: this worker runs only rank %d of a world of %d on random "
                "weights; its answers are meaningless (measurement only, never a deployment)",
                args.simulate_rank,
                args.simulate_rank,
                args.world_size,
            )
        if args.node_rank > 0:
            sys.exit(run_followers_only(args))
        from serving.front.engine_client import EngineClient, EngineUnavailable
        from serving.front.http_server import create_app, serve
        from workers.scheduler_process import run_scheduler

        ipc_dir = tempfile.mkdtemp(prefix="pdserve-")
        to_scheduler, to_front = f"ipc://{ipc_dir}/scheduler", f"ipc://{ipc_dir}/front"
        metrics = None
        if args.enable_metrics:
            from serving.front.metrics import WorkerMetrics

            metrics = WorkerMetrics(args.model_name, args.disaggregation_mode)
        client = EngineClient(send_addr=to_scheduler, recv_addr=to_front, metrics=metrics)
        app = create_app(args, client)
        bootstrap = start_bootstrap(args)
    except (ArgsError, ConfigError) as exc:
        sys.exit(f"error: {exc}")
    ctx = mp.get_context("spawn")
    rank0 = ctx.Process(
        target=run_scheduler,
        args=(args, to_scheduler, to_front),
        daemon=True,
        name="pdserve-scheduler",
    )
    scheduler = RankProcesses({0: rank0, **_spawn_followers(args, ctx)})
    rank0.start()
    scheduler.watch()
    try:
        asyncio.run(serve(app, args, client, scheduler))
    except EngineUnavailable as exc:
        dead = scheduler.dead()  # with N ranks: which one went first
        sys.exit(f"error: scheduler failed: {exc}" + (f"; {dead}" if dead else ""))
    finally:
        scheduler.stop()
        if bootstrap is not None:
            bootstrap.stop()
        shutil.rmtree(ipc_dir, ignore_errors=True)


class RankProcesses:
    """The worker's rank processes seen as one scheduler: alive while every rank is."""

    def __init__(self, procs: dict[int, mp.Process]) -> None:
        self.procs = procs
        self.exits: list[int] = []  # ranks in the order they exited (the first is the cause)

    def watch(self) -> None:
        """Record exit order from the processes' sentinels (call after every rank started)."""
        threading.Thread(target=self._watch, daemon=True, name="rank-watch").start()

    def _watch(self) -> None:
        left = {p.sentinel: rank for rank, p in self.procs.items()}
        while left:
            for sentinel in mp_connection.wait(list(left)):
                self.exits.append(left.pop(sentinel))

    def is_alive(self) -> bool:
        return all(p.is_alive() for p in self.procs.values())

    @property
    def exitcode(self) -> int | None:
        """The exit code of the first rank that exited."""
        order = self.exits + list(self.procs)
        return next(
            (self.procs[r].exitcode for r in order if self.procs[r].exitcode is not None), None
        )

    def dead(self) -> str | None:
        """'scheduler rank R exited (code C)' for the first rank found dead (None: all alive)."""
        if len(self.procs) == 1:
            return None
        time.sleep(0.2)  # let the watcher see the exit it is being asked about
        dead = self.exits + [r for r, p in sorted(self.procs.items()) if p.exitcode is not None]
        if not dead:
            return None
        rank = dead[0]
        code = self.procs[rank].exitcode
        return f"scheduler rank {rank} of {len(self.procs)} exited first (code {code})"

    def stop(self) -> None:
        """Rank 0 first (it tells the others to stop); then whatever is left is killed."""
        for p in self.procs.values():
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_followers(args: ServerArgs, ctx) -> dict[int, mp.Process]:
    """Start this node's ranks other than 0 (each joins the group, then waits for rank 0)."""
    from workers.scheduler_process import run_follower

    first = args.node_rank * args.ranks_per_node
    procs = {}
    for rank in range(max(first, 1), first + args.ranks_per_node):
        procs[rank] = ctx.Process(
            target=run_follower,
            args=(args, rank),
            daemon=True,
            name=f"pdserve-rank{rank}",
        )
        procs[rank].start()
    return procs


def run_followers_only(args: ServerArgs) -> int:
    """A node other than 0: its ranks only; exit status non-zero when any of them failed."""
    ranks = RankProcesses(_spawn_followers(args, mp.get_context("spawn")))
    for p in ranks.procs.values():
        p.join()
    dead = [f"rank {r} (code {p.exitcode})" for r, p in ranks.procs.items() if p.exitcode]
    if dead:
        logging.error("scheduler %s exited", ", ".join(dead))
        return 1
    return 0


def start_bootstrap(args: ServerArgs):
    """A PD prefill worker's bootstrap server (in this process, so it answers while the
    scheduler is busy), started; None for other roles. The scheduler process picks the role
    itself (workers/scheduler_process.py)."""
    if args.disaggregation_mode != "prefill":
        return None
    from workers.bootstrap_server import BootstrapServer

    try:
        bootstrap = BootstrapServer(args.host, args.disaggregation_bootstrap_port, args.api_key)
    except OSError as exc:
        raise ArgsError(
            f"--disaggregation-bootstrap-port {args.disaggregation_bootstrap_port}: {exc}"
        ) from exc
    bootstrap.start()
    return bootstrap


if __name__ == "__main__":
    main()

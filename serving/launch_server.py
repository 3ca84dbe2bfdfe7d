"""Entry point: `python -m serving.launch_server --model-path DIR [SGLang flags]`.

The main process runs the HTTP front (FastAPI + uvicorn); a spawned child runs the scheduler
(model, pools, batching). They talk over two ZMQ ipc sockets in a private temp directory.
SIGINT/SIGTERM drain in-flight requests, then both processes exit.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import shutil
import sys
import tempfile

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
        from serving.engine.scheduler_process import run_scheduler
        from serving.front.engine_client import EngineClient, EngineUnavailable
        from serving.front.http_server import create_app, serve

        ipc_dir = tempfile.mkdtemp(prefix="pdserve-")
        to_scheduler, to_front = f"ipc://{ipc_dir}/scheduler", f"ipc://{ipc_dir}/front"
        client = EngineClient(send_addr=to_scheduler, recv_addr=to_front)
        app = create_app(args, client)
        make_role, bootstrap = pick_role(args)
    except (ArgsError, ConfigError) as exc:
        sys.exit(f"error: {exc}")
    scheduler = mp.get_context("spawn").Process(
        target=run_scheduler,
        args=(args, to_scheduler, to_front, make_role),
        daemon=True,
        name="pdserve-scheduler",
    )
    scheduler.start()
    try:
        asyncio.run(serve(app, args, client, scheduler))
    except EngineUnavailable as exc:
        sys.exit(f"error: scheduler failed: {exc}")
    finally:
        scheduler.join(timeout=10)
        if scheduler.is_alive():
            scheduler.kill()
        if bootstrap is not None:
            bootstrap.stop()
        shutil.rmtree(ipc_dir, ignore_errors=True)


def pick_role(args: ServerArgs):
    """(role class for the scheduler process, bootstrap server) for --disaggregation-mode."""
    if args.disaggregation_mode == "prefill":
        from workers.bootstrap_server import BootstrapServer
        from workers.prefill import PrefillRole

        try:
            bootstrap = BootstrapServer(args.host, args.disaggregation_bootstrap_port, args.api_key)
        except OSError as exc:
            raise ArgsError(
                f"--disaggregation-bootstrap-port {args.disaggregation_bootstrap_port}: {exc}"
            ) from exc
        bootstrap.start()
        return PrefillRole, bootstrap
    if args.disaggregation_mode == "decode":
        from workers.decode import DecodeRole

        return DecodeRole, None
    return None, None


if __name__ == "__main__":
    main()

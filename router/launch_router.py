"""Entry point: `python -m router.launch_router [sglang-router's flags]`.

    python -m router.launch_router --pd-disaggregation \\
        --prefill http://P:32171 28998 --decode http://D:32172 \\
        --prefill-policy round_robin --decode-policy round_robin \\
        --host 0.0.0.0 --port 30000 --request-timeout-secs 1800 --model-path PATH

The router serves at once, whatever state the workers are in; it admits them as their health
probes succeed and answers 503 (naming why) while a role has no healthy worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator

import uvicorn

from router.app import RouterApp
from router.config import RouterConfig

GRACEFUL_SHUTDOWN_S = 10


class _Server(uvicorn.Server):
    """SIGINT/SIGTERM stop the server gracefully and the process exits 0 (uvicorn would
    re-raise the signal once stopped, ending the process with -15)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        yield


def main(argv: list[str] | None = None) -> None:
    config = RouterConfig.from_cli(argv)
    level = "warning" if config.log_level == "warn" else config.log_level
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = RouterApp(config)
    if config.prometheus_port is not None:
        from prometheus_client import start_http_server

        start_http_server(config.prometheus_port, config.prometheus_host, app.metrics.registry)
    mode = "PD" if config.pd_disaggregation else "plain"
    workers = ", ".join(f"{w.role} {w.url}" for w in app.registry.workers)
    logging.getLogger(__name__).info("%s mode, workers: %s", mode, workers)
    uv = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=level,
        access_log=False,
        proxy_headers=False,  # the client address is not used; its middleware costs per request
        lifespan="on",
        server_header=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    _Server(uv).run()


if __name__ == "__main__":
    main()

"""The HTTP front: an OpenAI- and SGLang-compatible FastAPI app over an EngineClient.

The front never loads the model: it tokenizes, renders chat templates, detokenizes and
streams; the scheduler process (reached through the EngineClient) does the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from types import FrameType

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from serving.front.api.admin_routes import admin_router
from serving.front.api.chat_routes import chat_router
from serving.front.api.completion_routes import completion_router
from serving.front.api.context import FrontContext
from serving.front.api.errors import error_response, install_error_handlers
from serving.front.api.guard import RequestGuard
from serving.front.api.native_routes import native_router
from serving.front.api.responses_api import responses_router
from serving.front.api.sequences import ClientDisconnected
from serving.front.engine_client import EngineClient, EngineUnavailable
from serving.server_args import ServerArgs

GRACEFUL_SHUTDOWN_S = 10
# Requests still running this long after the signal are aborted, so their streams end cleanly
# before uvicorn cancels what is left at GRACEFUL_SHUTDOWN_S.
DRAIN_S = GRACEFUL_SHUTDOWN_S - 2
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def create_app(args: ServerArgs, client: EngineClient) -> FastAPI:
    """Loads the tokenizer and chat template (ArgsError if they are missing); opens nothing."""
    ctx = FrontContext.load(args, client)
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: object, __: ClientDisconnected) -> JSONResponse:
        return error_response(499, "client disconnected")

    app.include_router(chat_router(ctx))
    app.include_router(completion_router(ctx))
    app.include_router(responses_router(ctx))
    app.include_router(native_router(ctx))
    app.include_router(admin_router(ctx))
    app.state.ctx = ctx
    return app


class _Server(uvicorn.Server):
    """Turns /health to 503 as soon as a shutdown signal arrives, while requests drain for up
    to DRAIN_S; then aborts the rest, so every stream ends with [DONE].

    uvicorn re-raises the signal once it has stopped, which would kill the process before
    `serve` closes the scheduler link; these handlers only stop the server.
    """

    def __init__(self, config: uvicorn.Config, client: EngineClient) -> None:
        super().__init__(config)
        self._client = client

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self._client.draining:
            message = f"server is shutting down (still running {DRAIN_S} s after the signal)"
            asyncio.get_running_loop().call_later(DRAIN_S, self._client.end_in_flight, message)
        self._client.begin_shutdown()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in _SIGNALS:
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in _SIGNALS:
                loop.remove_signal_handler(sig)


async def serve(
    app: FastAPI, args: ServerArgs, client: EngineClient, scheduler: BaseProcess | None = None
) -> None:
    """Run `app` (from create_app) until SIGINT/SIGTERM, or until the scheduler fails or (when
    given) its process exits; then drain for up to GRACEFUL_SHUTDOWN_S and close the link.

    Raises EngineUnavailable with the operator's one-line message if the scheduler failed.
    """
    guarded = RequestGuard(app, args.api_key, args.max_payload_size, args.body_read_timeout_secs)
    config = uvicorn.Config(
        guarded,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.log_level == "debug",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    server = _Server(config, client)
    await client.start()
    watcher = asyncio.create_task(_watch_scheduler(server, client, scheduler))
    try:
        await server.serve()
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await client.close()
    if client.failure is not None:
        raise EngineUnavailable(client.failure)


async def _watch_scheduler(
    server: uvicorn.Server, client: EngineClient, scheduler: BaseProcess | None
) -> None:
    while client.failure is None:
        if scheduler is not None and not scheduler.is_alive():
            client.fail(f"the scheduler process exited (code {scheduler.exitcode})")
            break
        await asyncio.sleep(0.5)
    server.should_exit = True

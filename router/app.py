"""The router's HTTP front: a plain ASGI app that uvicorn runs.

    POST /v1/chat/completions, /v1/completions, /v1/responses, /generate -> router/dispatch.py
    GET  /health, /liveness        the router itself is up (200)
    GET  /readiness                200 when every role has a healthy worker, else 503
    GET  /health_generate          a one-token generation on a healthy worker of each role
    GET  /v1/models, /v1/models/{id}, /model_info, /get_model_info   a healthy worker's answer
    GET  /server_info, /get_server_info                      that, plus {"router": state}
    GET  /metrics                  Prometheus text
Anything else: 404 (or 405) with an OpenAI-style error body.

No web framework: the hot path is one dict lookup, one body read and the dispatcher, and the
ASGI messages are written directly (a framework's routing and request objects would be most of
the router's own CPU time per request).

A generation request still running after WATCH_AFTER_S is watched for a client disconnect
(most requests through a fast worker are over by then, and a timer is far cheaper than the
watcher task): the disconnect cancels the handler task, and the dispatcher's cleanup closes
both upstream requests. A client that leaves earlier is noticed at WATCH_AFTER_S.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from router.admission import Admission
from router.config import RouterConfig
from router.dispatch import ClientSink, Dispatcher
from router.errors import RETRY_AFTER, ClientError, error_body, error_message
from router.health import HealthChecker
from router.limits import MAX_JSON_DEPTH, OPEN_PATHS, authorized, is_json, json_too_deep
from router.metrics import RouterMetrics
from router.upstream import UpstreamError
from router.workers import Worker, WorkerRegistry

log = logging.getLogger(__name__)

MODEL_PREFIX = "/v1/models/"  # GET /v1/models/{id}: a healthy worker's answer (404 if unknown)
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/generate")
WATCH_AFTER_S = 0.05  # a request over sooner never needs a disconnect watcher
BODY_TOTAL_FACTOR = 6  # the whole body must arrive within this many read timeouts
_BEARER = [(b"www-authenticate", b"Bearer")]
_FORWARDED = (b"authorization", b"x-request-id", b"traceparent", b"tracestate")
_JSON = [(b"content-type", b"application/json")]

Reply = tuple[int, list[tuple[bytes, bytes]], bytes]


class RouterApp:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.registry = WorkerRegistry.from_config(config)
        self.admission = Admission(
            config.max_concurrent_requests, config.queue_size, config.queue_timeout_secs
        )
        self.metrics = RouterMetrics(self.registry, self.admission, config.pd_disaggregation)
        self.dispatcher = Dispatcher(config, self.registry, self.metrics)
        self.health = HealthChecker(config, self.registry)
        self.roles = ("prefill", "decode") if config.pd_disaggregation else ("regular",)
        self._key = f"Bearer {config.api_key}".encode() if config.api_key else None
        # with a key of its own the router authenticates to the workers itself (upstream.Pool)
        self._forwarded = _FORWARDED[1:] if config.api_key else _FORWARDED
        self._get: dict[str, Callable[[], Awaitable[Reply]]] = {
            "/health": self._alive,
            "/liveness": self._alive,
            "/readiness": self._readiness,
            "/health_generate": self._health_generate,
            "/v1/models": self._models,
            "/model_info": self._model_info,
            "/get_model_info": self._model_info,
            "/server_info": self._server_info,
            "/get_server_info": self._server_info,
            "/metrics": self._metrics,
        }

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            path, method = scope["path"], scope["method"]
            if self._key is not None and path not in OPEN_PATHS:
                auth = next((v for k, v in scope["headers"] if k == b"authorization"), None)
                if not authorized(auth, self._key):
                    message = "invalid or missing API key (Bearer token)"
                    return await _reply(send, _error(401, message, _BEARER))
            if path in GENERATION_ROUTES:
                if method == "POST":
                    await self._generate(scope, receive, send, path)
                else:
                    await _reply(send, _error(405, f"{method} is not allowed on {path} (POST)"))
            elif path.startswith(MODEL_PREFIX) and method == "GET":
                raw = scope.get("raw_path") or path.encode()
                await _reply(send, await self._model(raw.decode("latin-1")))
            elif (handler := self._get.get(path)) is not None:
                if method == "GET":
                    await _reply(send, await handler())
                else:
                    await _reply(send, _error(405, f"{method} is not allowed on {path} (GET)"))
            else:
                await _reply(send, _error(404, f"no route {method} {path}"))
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    # ---- generation ----
    async def _generate(self, scope: dict[str, Any], receive: Any, send: Any, route: str) -> None:
        t0 = time.perf_counter()
        forwarded = b"content-type: application/json\r\n"
        echo = []
        declared = 0
        ctype = None
        for name, value in scope["headers"]:
            if name in self._forwarded:
                forwarded += b"%s: %s\r\n" % (name, value)
                if name == b"x-request-id":
                    echo.append((name, value))
            elif name == b"content-length":
                declared = int(value) if value.isdigit() else 0
            elif name == b"content-type":
                ctype = value
        client = ClientSink(send, echo)
        task = asyncio.current_task()
        watch: list[Any] = []  # the timer, then the watcher task
        admitted = False
        try:
            if not is_json(ctype):
                what = ctype.decode("latin-1")  # type: ignore[union-attr]
                raise ClientError(415, f"content type {what!r}: send application/json")
            raw = await self._read_body(receive, declared)
            if raw is None:  # the client left while sending
                client.gone = True
                return
            if json_too_deep(raw):
                raise ClientError(400, f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
            loop = asyncio.get_running_loop()
            watch.append(loop.call_later(WATCH_AFTER_S, _watch, receive, task, client, watch))
            await self.admission.acquire()
            admitted = True
            await self.dispatcher.generate(route, raw, forwarded, client)
        except ClientError as e:
            if not client.started:
                await client.error(e.status, e.message)
        except asyncio.CancelledError:
            if not client.gone:
                raise
            if hasattr(task, "uncancel"):
                task.uncancel()  # type: ignore[union-attr]
        except Exception as e:  # a bug here: the client still gets one clean error
            log.exception("%s failed", route)
            message = f"router error: {type(e).__name__}: {e}"
            if not client.started:
                await client.error(500, message)
            elif not client.finished:
                await client.stream_error(500, message)
        finally:
            for handle in watch:
                handle.cancel()
            if admitted:
                self.admission.release()
            ttfb = client.first_byte_at - t0 if client.started else None
            status = 499 if client.gone else client.status
            duration = time.perf_counter() - t0
            self.metrics.observe(route, status, duration, ttfb, client.streamed)

    async def _read_body(self, receive: Any, declared: int) -> bytes | None:
        """The body, None if the client left; 413 past --max-payload-size, 408 when no bytes
        came for --body-read-timeout-secs (or the whole took BODY_TOTAL_FACTOR times that).
        The deadline is a timer that cancels this task, not a wait_for per read: most bodies
        arrive in one message and the timer costs next to nothing."""
        limit = self.config.max_payload_size
        if declared > limit:
            raise ClientError(413, f"request body of {declared} bytes is over {limit}")
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        timeout = self.config.body_read_timeout_secs
        end = loop.time() + timeout * BODY_TOTAL_FACTOR
        late: list[bool] = []

        def expire() -> None:
            late.append(True)
            task.cancel()  # type: ignore[union-attr]

        timer = loop.call_later(timeout, expire)
        parts: list[bytes] = []
        size = 0
        try:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                parts.append(message.get("body", b""))
                size += len(parts[-1])
                if size > limit:
                    raise ClientError(413, f"request body is over {limit} bytes")
                if not message.get("more_body"):
                    return b"".join(parts)
                timer.cancel()
                timer = loop.call_later(max(0.0, min(timeout, end - loop.time())), expire)
        except asyncio.CancelledError:
            if not late:
                raise
            task.uncancel()  # type: ignore[union-attr]
            message = f"request body not received in time ({size} bytes came)"
            raise ClientError(408, message) from None
        finally:
            timer.cancel()

    # ---- everything else ----
    async def _alive(self) -> Reply:
        return 200, [], b""

    async def _readiness(self) -> Reply:
        healthy = {r: len(self.registry.healthy[r]) for r in self.roles}
        total = {r: len(self.registry.by_role[r]) for r in self.roles}
        ready = all(healthy.values())
        body = {"status": "ready" if ready else "not ready", "healthy": healthy, "total": total}
        return 200 if ready else 503, _JSON, json.dumps(body).encode()

    async def _health_generate(self) -> Reply:
        workers = []
        for role in self.roles:
            if not self.registry.healthy[role]:
                return _error(503, self.registry.unavailable(role))
            workers.append(self.registry.healthy[role][0])
        results = await asyncio.gather(*(self._proxy(w, "/health_generate") for w in workers))
        for w, (status, _, body) in zip(workers, results):
            if status != 200:
                why = f"/health_generate answered {status}: {error_message(body)}"
                return _error(503, f"{w.role} worker {w.url}: {why}")
        return 200, [], b""

    async def _models(self) -> Reply:
        worker = self._any_worker()
        if worker is not None:
            return await self._proxy(worker, "/v1/models")
        if self.config.model_path:
            card = {"id": self.config.model_path, "object": "model", "owned_by": "pdserve"}
            return 200, _JSON, json.dumps({"object": "list", "data": [card]}).encode()
        return _error(503, self._no_worker())

    async def _model(self, raw_path: str) -> Reply:
        worker = self._any_worker()
        if worker is None:
            return _error(503, self._no_worker())
        return await self._proxy(worker, raw_path)

    async def _model_info(self) -> Reply:
        worker = self._any_worker()
        if worker is None:
            return _error(503, self._no_worker())
        return await self._proxy(worker, "/model_info")

    async def _server_info(self) -> Reply:
        info: dict[str, Any] = {}
        worker = self._any_worker()
        if worker is not None:
            status, _, body = await self._proxy(worker, "/server_info")
            if status == 200:
                info = json.loads(body)
        info["router"] = self.state()
        return 200, _JSON, json.dumps(info).encode()

    async def _metrics(self) -> Reply:
        return 200, [(b"content-type", b"text/plain; version=0.0.4")], self.metrics.text()

    def state(self) -> dict[str, Any]:
        c = self.config
        return {
            "mode": "pd" if c.pd_disaggregation else "plain",
            "policies": {r: c.policy_for[r] for r in self.roles},
            "workers": [
                {
                    "url": w.url,
                    "role": w.role,
                    "bootstrap_port": w.bootstrap_port,
                    "healthy": w.healthy,
                    "last_error": w.last_error,
                    "in_flight": w.in_flight,
                    "requests": w.requests,
                    "failures": w.failures,
                }
                for w in self.registry.workers
            ],
            "active_requests": self.admission.active,
            "queued_requests": len(self.admission.waiting),
        }

    def _any_worker(self) -> Worker | None:
        for role in self.roles:  # prefill first in PD mode, as sglang-router does
            if self.registry.healthy[role]:
                return self.registry.healthy[role][0]
        return None

    def _no_worker(self) -> str:
        return "; ".join(self.registry.unavailable(r) for r in self.roles)

    async def _proxy(self, worker: Worker, path: str) -> Reply:
        try:
            status, body = await worker.pool.get(path, self.config.request_timeout_secs)
        except UpstreamError as e:
            return _error(502, f"{worker.role} worker {e}")
        return status, _JSON, body

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.health.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.health.stop()
                self.registry.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def _watch(receive: Any, task: asyncio.Task[Any], client: ClientSink, watch: list[Any]) -> None:
    watch.append(asyncio.ensure_future(_cancel_on_disconnect(receive, task, client)))


async def _cancel_on_disconnect(receive: Any, task: asyncio.Task[Any], client: ClientSink):
    """Cancel `task` if the client goes away before its response is complete. (uvicorn also
    reports a disconnect once the response is complete; that one is not the client leaving.)"""
    while (await receive())["type"] != "http.disconnect":
        pass
    if not client.finished:
        client.gone = True
        task.cancel()


def _error(status: int, message: str, extra: list[tuple[bytes, bytes]] | None = None) -> Reply:
    headers = [*_JSON, *(extra or ())]
    if status in (429, 503):
        headers.append(RETRY_AFTER)
    return status, headers, error_body(status, message)


async def _reply(send: Any, reply: Reply) -> None:
    status, headers, body = reply
    headers = [*headers, (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

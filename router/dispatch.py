"""Generation requests: pick worker(s), send, relay the answer, retry while nothing was sent.

PD mode, one attempt:
  1. pick a prefill and a decode worker (each role's policy); inject_bootstrap into the body
  2. send the same bytes to both at once
  3. relay decode's answer: a JSON body whole, an SSE stream event by event as it arrives.
     Prefill's body is never waited for: it matters only if prefill fails.
  4. if prefill fails while decode's request is still open, decode's request is failed with
     prefill's error (its connection closed, which makes the decode worker abort);
  5. if decode fails, or the client leaves (the handler task is cancelled), prefill's request
     is aborted the same way.
Plain mode: one worker, the body passed on as received (a malformed one gets the worker's 400).

Retries: an attempt that fails before any byte reached the client, with a retryable error (a
connect error, a disconnect, a 5xx from either side), is repeated on a freshly picked pair
with a fresh bootstrap_room, at most --retry-max-retries times; not when a worker refused for
load and no other worker of its role could take the retry. The client's response head is
held back until decode's first body bytes, so a prefill failure up to then is still
retryable. Once the client has bytes, a failure becomes an SSE error event, then [DONE].
"""

from __future__ import annotations

import asyncio
import json
import time
from functools import partial
from typing import Any

from router.bootstrap import inject_bootstrap
from router.config import RouterConfig
from router.errors import RETRY_AFTER, ClientError, error_body
from router.metrics import RouterMetrics
from router.policies import create_policy, prompt_text
from router.upstream import Aborted, Response, UpstreamError, WorkerStatus
from router.workers import Worker, WorkerRegistry

_RELAYED_HEADERS = (b"content-type", b"cache-control", b"x-accel-buffering")
_SSE_DONE = b"data: [DONE]\n\n"


class ClientSink:
    """The client's side: uvicorn's `send`, and what has gone out through it."""

    __slots__ = ("send", "extra_headers", "started", "finished", "gone", "status",
                 "first_byte_at", "streamed")  # fmt: skip

    def __init__(self, send: Any, extra_headers: list[tuple[bytes, bytes]]) -> None:
        self.send = send
        self.extra_headers = extra_headers  # e.g. the client's x-request-id, echoed
        self.started = False  # the response head has gone out: no retry, no new status
        self.finished = False  # ...and its last byte
        self.gone = False  # the client disconnected first
        self.status = 0
        self.first_byte_at = 0.0
        self.streamed = False  # the answer went out as a stream

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """A complete response in one go."""
        headers = [*headers, (b"content-length", b"%d" % len(body)), *self.extra_headers]
        await self._start(status, headers)
        self.finished = True
        await self.send({"type": "http.response.body", "body": body})

    async def error(self, status: int, message: str) -> None:
        body = error_body(status, message)
        headers = [(b"content-type", b"application/json")]
        if status in (429, 503):
            headers.append(RETRY_AFTER)
        await self.respond(status, headers, body)

    async def open_stream(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.streamed = True
        await self._start(status, [*headers, *self.extra_headers])

    async def chunk(self, data: bytes) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self, data: bytes = b"") -> None:
        self.finished = True
        await self.send({"type": "http.response.body", "body": data})

    async def stream_error(self, status: int, message: str) -> None:
        """The end of a stream that failed after it started: an error event, then [DONE]."""
        await self.end(b"data: " + error_body(status, message) + b"\n\n" + _SSE_DONE)

    async def _start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        self.status = status
        self.first_byte_at = time.perf_counter()
        await self.send({"type": "http.response.start", "status": status, "headers": headers})


class _Retry(Exception):
    def __init__(self, error: UpstreamError) -> None:
        self.error = error


class Dispatcher:
    def __init__(self, config: RouterConfig, registry: WorkerRegistry, metrics: RouterMetrics):
        self.pd = config.pd_disaggregation
        self.timeout = config.request_timeout_secs
        self.attempts = config.max_retries + 1
        self.registry = registry
        self.metrics = metrics
        roles = ("prefill", "decode") if self.pd else ("regular",)
        self.policies = {r: create_policy(config.policy_for[r], config) for r in roles}
        self.needs_text = any(p.needs_text for p in self.policies.values())
        self.roles = {
            w.url: ("" if w.role == "regular" else w.role + " ") for w in registry.workers
        }

    async def generate(self, route: str, raw: bytes, headers: bytes, client: ClientSink) -> None:
        """Answer one generation request through `client`; raises ClientError when the answer
        is an error made here, before anything was sent."""
        body = None
        if self.pd or self.needs_text:
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError) as e:
                if self.pd:  # the body must be read to add the bootstrap fields
                    raise ClientError(400, f"malformed JSON body: {e}") from None
            if self.pd and not isinstance(body, dict):
                raise ClientError(400, "the request body must be a JSON object")
        text = prompt_text(route, body) if self.needs_text else None
        path = route.encode()
        error: UpstreamError | None = None
        for attempt in range(self.attempts):
            if attempt:
                self.metrics.retry(error.origin, route)  # type: ignore[union-attr]
                await asyncio.sleep(min(0.01 * 2 ** (attempt - 1), 0.5))
            try:
                if self.pd:
                    await self._pd(route, path, body, headers, text, client)  # type: ignore[arg-type]
                else:
                    await self._plain(path, raw, headers, text, client)
                return
            except _Retry as r:
                error = r.error
                if self._overloaded_alone(error):
                    break
        else:
            self.metrics.retries_exhausted(error.origin, route)  # type: ignore[union-attr]
        tries = f"after {attempt + 1} attempt{'s' if attempt else ''}"
        raise ClientError(error.status, f"{self._describe(error)} ({tries})")

    def _overloaded_alone(self, error: UpstreamError) -> bool:
        """A worker refused for load (503 with Retry-After) and is the only one of its role:
        another attempt would land on it again and only add to its load, so the client gets
        the refusal now."""
        if not isinstance(error, WorkerStatus) or not error.retry_after:
            return False
        worker = self.registry.by_url.get(error.origin)
        return worker is not None and len(self.registry.healthy[worker.role]) <= 1

    def _pick(self, role: str, text: str | None) -> Worker:
        workers = self.registry.healthy[role]
        if not workers:
            raise ClientError(503, self.registry.unavailable(role))
        return self.policies[role].select(workers, text)

    async def _pd(
        self,
        route: str,
        path: bytes,
        body: dict[str, Any],
        headers: bytes,
        text: str | None,
        client: ClientSink,
    ) -> None:
        prefill = self._pick("prefill", text)
        decode = self._pick("decode", text)
        inject_bootstrap(route, body, prefill)
        data = json.dumps(body, separators=(",", ":")).encode()  # ASCII: lone surrogates pass
        p = prefill.start(b"POST", path, data, headers, self.timeout)
        d = decode.start(b"POST", path, data, headers, self.timeout)
        p.add_done_callback(partial(_prefill_ended, d))
        ok = False
        try:
            ok = await self._relay(d, client)
        finally:
            d.close()
            if not ok:  # decode failed or the client left: prefill's work is for nothing
                p.close()

    async def _plain(
        self, path: bytes, raw: bytes, headers: bytes, text: str | None, client: ClientSink
    ) -> None:
        resp = self._pick("regular", text).start(b"POST", path, raw, headers, self.timeout)
        try:
            await self._relay(resp, client)
        finally:
            resp.close()

    async def _relay(self, resp: Response, client: ClientSink) -> bool:
        """Pass `resp` on to the client; True when it was a complete success."""
        try:
            await resp.head()
            stream = resp.chunked and (resp.header(b"content-type") or b"").startswith(
                b"text/event-stream"
            )
            if not stream or resp.status >= 300:
                body = await resp.read()
                if resp.status >= 300:
                    later = resp.header(b"retry-after") is not None
                    raise WorkerStatus(resp.pool.origin, resp.status, body, _ctype(resp), later)
                await client.respond(resp.status, _relayed(resp), body)
                return True
            first = await resp.next_chunk()  # holds the head back: see the module docstring
        except UpstreamError as e:
            if e.retryable:
                raise _Retry(e) from None
            if isinstance(e, WorkerStatus):  # the worker's 4xx, for the client as it is
                await client.respond(e.status, [(b"content-type", e.content_type)], e.body)
                return False
            raise ClientError(e.status, self._describe(e)) from None
        await client.open_stream(resp.status, _relayed(resp))
        try:
            chunk = first
            while chunk is not None:
                await client.chunk(chunk)
                chunk = await resp.next_chunk()
        except UpstreamError as e:
            await client.stream_error(e.status, self._describe(e))
            return False
        await client.end()
        return True

    def _describe(self, error: UpstreamError) -> str:
        return f"{self.roles.get(error.origin, '')}worker {error}"


def _prefill_ended(decode: Response, prefill: Response) -> None:
    """Prefill's request is over; if it failed, decode's cannot succeed: end it with the cause.
    Unless decode has begun to answer: a worker holds its response head until the first token,
    so by then the KV has all arrived and decode finishes without prefill."""
    if decode.done or decode.status != 0 or isinstance(prefill.error, Aborted):
        return
    if prefill.error is not None:
        decode.fail(prefill.error)
    elif prefill.status >= 300:
        origin = prefill.pool.origin
        decode.fail(WorkerStatus(origin, prefill.status, prefill.body_so_far(), _ctype(prefill)))


def _ctype(resp: Response) -> bytes:
    return resp.header(b"content-type") or b"application/json"


def _relayed(resp: Response) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in resp.headers if k in _RELAYED_HEADERS]

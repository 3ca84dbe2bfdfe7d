"""Requests to the workers: HTTP/1.1 keep-alive connection pools, one per worker.

Why not httpx: on the 2-core development machine one httpx request costs ~640 us of CPU
(httpcore ~500 us, aiohttp ~180 us) against ~36 us for a protocol on httptools, and every PD
request makes two of them; with httpx the router could not stay under 1 ms of added latency
or near sglang-router's throughput (docs/notebook/2026-11-29_2026-12-03.md, "Router"; today's
figures: docs/BENCHMARKS.md, "Router overhead"). So this file is the
smallest client the router needs: httptools (llhttp, the parser uvicorn uses) reads the
responses, asyncio transports carry the bytes, and a Response is consumed as it arrives.

A Response is returned at once and fills in as bytes come: `await head()`, then
`await next_chunk()` until None, or `await read()`. `fail(exc)` ends it from outside (the other
side of a PD pair failed, the client left): waiters raise `exc` and an unfinished connection
is closed, which is what tells the worker to abort.

Hazards:
- A worker closes idle keep-alive connections (uvicorn: after 5 s); a connection idle longer
  than IDLE_EXPIRY_S is never reused, and one closed under a request surfaces as Disconnected
  before any byte (retryable).
- One request per connection at a time; a connection goes back to its pool only when its
  response is complete and the worker allows keep-alive.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

import httptools

from router.errors import error_message

IDLE_EXPIRY_S = 3.0
CONNECT_TIMEOUT_S = 10.0
PAUSE_BYTES = 1 << 20  # stop reading a worker whose answer the client does not take...
RESUME_BYTES = 1 << 18  # ...until it has taken this much of it


class UpstreamError(Exception):
    """A request to a worker that did not end in a response. `status` is what the client gets
    if this is the final word; `retryable` means another attempt may succeed."""

    status = 502
    retryable = True

    def __init__(self, origin: str, message: str) -> None:
        super().__init__(f"{origin}: {message}")
        self.origin = origin


class ConnectError(UpstreamError):
    """No connection could be opened: nothing reached the worker, which is likely down."""


class Disconnected(UpstreamError):
    """The worker closed the connection before its response was complete."""


class Timeout(UpstreamError):
    status = 504
    retryable = False


class Aborted(UpstreamError):
    """The router gave up on the request (the client left, or the other side failed)."""

    retryable = False


class WorkerStatus(UpstreamError):
    """A complete non-2xx answer. 4xx are the client's to read (passed through as they are);
    5xx may be retried."""

    def __init__(
        self, origin: str, status: int, body: bytes, content_type: bytes, retry_after: bool = False
    ) -> None:
        super().__init__(origin, f"answered {status}: {error_message(body)}")
        self.status = status
        self.retryable = status >= 500
        self.body = body
        self.content_type = content_type
        self.retry_after = retry_after  # the worker said when to come back: refused for load


class Response:
    __slots__ = ("pool", "status", "headers", "chunked", "complete", "error", "_chunks",
                 "_buffered", "_waiter", "_has_head", "_conn", "_callbacks", "_timer")  # fmt: skip

    def __init__(self, pool: Pool, timeout: float) -> None:
        self.pool = pool
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunked = False  # no content-length: a stream, relayed as it arrives
        self.complete = False
        self.error: BaseException | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._has_head = False
        self._conn: _Conn | None = None
        self._callbacks: list[Callable[[Response], None]] = []
        self._timer = pool.loop.call_later(timeout, self._expire, timeout)

    @property
    def done(self) -> bool:
        return self.complete or self.error is not None

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None

    # ---- consumer side ----
    async def head(self) -> None:
        while not self._has_head:
            if self.error is not None:
                raise self.error
            await self._wait()

    async def next_chunk(self) -> bytes | None:
        """The next piece of the body as it arrived; None at its end."""
        while not self._chunks:
            if self.error is not None:
                raise self.error
            if self.complete:
                return None
            await self._wait()
        if self.error is not None:
            raise self.error
        chunk = self._chunks.popleft()
        self._buffered -= len(chunk)
        conn = self._conn
        if conn is not None and conn.paused and self._buffered < RESUME_BYTES:
            conn.paused = False
            conn.transport.resume_reading()
        return chunk

    async def read(self) -> bytes:
        await self.head()
        parts = []
        while (chunk := await self.next_chunk()) is not None:
            parts.append(chunk)
        return b"".join(parts)

    def body_so_far(self) -> bytes:
        return b"".join(self._chunks)

    def fail(self, exc: BaseException) -> None:
        """End the request from outside; an unfinished connection is closed (not reused)."""
        if self.done:
            return
        self.error = exc
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.resp = None
            conn.transport.abort()
        self._finish()

    def close(self) -> None:
        """Let go of the response; aborts it when it is not complete."""
        if not self.done:
            self.fail(Aborted(self.pool.origin, "request abandoned"))

    def add_done_callback(self, fn: Callable[[Response], None]) -> None:
        """fn(response) once, when it is complete or has failed."""
        if self.done:
            fn(self)
        else:
            self._callbacks.append(fn)

    async def _wait(self) -> None:
        self._waiter = fut = self.pool.loop.create_future()
        try:
            await fut
        finally:
            self._waiter = None

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _expire(self, timeout: float) -> None:
        self.fail(Timeout(self.pool.origin, f"no complete answer within {timeout:g} s"))

    def _finish(self) -> None:
        self._timer.cancel()
        self._wake()
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)

    # ---- connection side ----
    def _on_head(self, status: int) -> None:
        self.status = status
        self.chunked = self.header(b"content-length") is None
        self._has_head = True
        self._wake()

    def _on_body(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        conn = self._conn
        if self._buffered > PAUSE_BYTES and conn is not None and not conn.paused:
            conn.paused = True
            conn.transport.pause_reading()
        self._wake()

    def _on_complete(self) -> None:
        self._conn = None
        self.complete = True
        self._finish()


class _Conn(asyncio.Protocol):
    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.resp: Response | None = None
        self.idle_since = 0.0
        self.closed = False
        self.paused = False

    def send(self, resp: Response, request: bytes) -> None:
        self.resp = resp
        resp._conn = self
        self.transport.write(request)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        resp, self.resp = self.resp, None
        if resp is not None:
            if (
                resp._has_head
                and resp.chunked
                and exc is None
                and not resp.header(b"transfer-encoding")
            ):  # a body delimited by the end of the connection (HTTP/1.0 style)
                resp._on_complete()
            else:
                reason = "closed the connection" + (f" ({exc})" if exc else "")
                resp.fail(Disconnected(self.pool.origin, reason))

    def eof_received(self) -> None:
        self.closed = True  # never handed out again; connection_lost follows

    def data_received(self, data: bytes) -> None:
        resp = self.resp
        if resp is None:  # nothing asked: an idle connection must stay silent
            self.closed = True
            self.transport.abort()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            resp.fail(Disconnected(self.pool.origin, f"malformed response ({e})"))

    # ---- httptools callbacks ----
    def on_header(self, name: bytes, value: bytes) -> None:
        self.resp.headers.append((name.lower(), value))  # type: ignore[union-attr]

    def on_headers_complete(self) -> None:
        self.resp._on_head(self.parser.get_status_code())  # type: ignore[union-attr]

    def on_body(self, body: bytes) -> None:
        self.resp._on_body(body)  # type: ignore[union-attr]

    def on_message_complete(self) -> None:
        resp, self.resp = self.resp, None
        if self.parser.should_keep_alive():
            self.pool._release(self)
        else:
            self.closed = True
            self.transport.close()
        resp._on_complete()  # type: ignore[union-attr]


class Pool:
    """Keep-alive connections to one worker; as many as there are requests in flight."""

    def __init__(self, host: str, port: int, origin: str = "") -> None:
        self.host = host
        self.port = port
        self.origin = origin or f"http://{host}:{port}"  # names the worker in errors
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set on first use
        self._idle: list[_Conn] = []
        name = f"[{host}]" if ":" in host else host  # an IPv6 literal needs its brackets
        self._host_line = b"HTTP/1.1\r\nhost: %s:%d\r\n" % (name.encode(), port)
        self._head = self._host_line

    def set_auth(self, header: bytes) -> None:
        """A complete "authorization: ...\r\n" line to send with every request from now on."""
        self._head = self._host_line + header

    def request(
        self, method: bytes, path: bytes, body: bytes, headers: bytes, timeout: float
    ) -> Response:
        """Start a request; `headers` are complete "name: value\\r\\n" lines."""
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        resp = Response(self, timeout)
        request = b"%s %s %scontent-length: %d\r\n%s\r\n%s" % (
            method, path, self._head, len(body), headers, body)  # fmt: skip
        conn = self._checkout()
        if conn is not None:
            conn.send(resp, request)
        else:
            self.loop.create_task(self._connect(resp, request))
        return resp

    async def get(self, path: str, timeout: float) -> tuple[int, bytes]:
        resp = self.request(b"GET", path.encode(), b"", b"accept: */*\r\n", timeout)
        try:
            body = await resp.read()
        finally:
            resp.close()
        return resp.status, body

    def close(self) -> None:
        for conn in self._idle:
            conn.transport.close()
        self._idle.clear()

    def _checkout(self) -> _Conn | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()  # the most recently used: the least likely to be stale
            if not conn.closed and now - conn.idle_since < IDLE_EXPIRY_S:
                return conn
            conn.transport.close()
        return None

    def _release(self, conn: _Conn) -> None:
        if conn.paused:
            conn.paused = False
            conn.transport.resume_reading()
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    def _forget(self, conn: _Conn) -> None:
        if conn in self._idle:
            self._idle.remove(conn)

    async def _connect(self, resp: Response, request: bytes) -> None:
        try:
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(lambda: _Conn(self), self.host, self.port),
                CONNECT_TIMEOUT_S,
            )
        except (OSError, asyncio.TimeoutError) as e:
            resp.fail(ConnectError(self.origin, f"cannot connect ({e or type(e).__name__})"))
            return
        if resp.done:  # abandoned while connecting: keep the connection for the next one
            self._release(conn)
        else:
            conn.send(resp, request)

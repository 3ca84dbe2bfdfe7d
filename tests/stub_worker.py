"""A stub worker: speaks the worker HTTP contract and answers at once, with no model.

It exists for two users. bench/router_overhead.py puts it behind the routers so that what is
measured is the router, not a model. The router tests run it as a real local HTTP server whose
behaviour they set at run time (health status, failures, delays, a stream cut in the middle)
and whose request log they read (order of arrival across workers, bodies, disconnects).

It is a raw asyncio protocol over httptools' parser, so that it costs far less CPU per request
than the routers it stands behind. One request at a time per connection (keep-alive, no
pipelining). Anything it cannot parse (e.g. a router's HTTP/2 probe) gets a 400 and a close.

    python -m tests.stub_worker --port 31001 [--port 31002 ...]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httptools

GENERATION_PATHS = ("/generate", "/v1/chat/completions", "/v1/completions")


@dataclass
class Behaviour:
    """What the stub does; tests change these fields while it runs."""

    health_status: int = 200
    fail_status: int | None = None  # answer generation routes with this status
    fail_count: int | None = None  # ...only the next N generation requests (None: all)
    delay_s: float = 0.0  # before the response head of a generation route
    chunks: int = 3  # SSE content events of a stream, before the finish event and [DONE]
    chunk_delay_s: float = 0.0  # between SSE events
    cut_after_chunks: int | None = None  # close the connection after this many SSE events
    model_id: str = "stub-model"


@dataclass
class Seen:
    """One request as the stub received it."""

    seq: int  # order of arrival across every stub of the process
    worker: str
    method: str
    path: str
    headers: dict[str, str]
    body: Any  # parsed JSON when it was JSON, else bytes
    t: float = field(default_factory=time.monotonic)


_order = itertools.count()


class StubWorker:
    """One stub listening on 127.0.0.1:port, in the calling event loop (`await start()`) or in
    a thread of its own (`start_in_thread()`, for tests that are not async)."""

    def __init__(self, port: int = 0, name: str = "", record: bool = True) -> None:
        self.port = port
        self.name = name or f"stub:{port}"
        self.record = record
        self.behaviour = Behaviour()
        self.seen: list[Seen] = []
        self.disconnects = 0  # connections closed by the peer while a request was in progress
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[_Conn] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def generation_requests(self) -> list[Seen]:
        return [s for s in self.seen if s.path in GENERATION_PATHS]

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._server = await self._loop.create_server(
            lambda: _Conn(self), "127.0.0.1", self.port, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening and drop every open connection at once (like a killed process)."""
        if self._server is not None:
            self._server.close()
            for conn in list(self._conns):
                conn.abort()
            await self._server.wait_closed()
            self._server = None

    def start_in_thread(self) -> StubWorker:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            loop.run_until_complete(self.start())
            ready.set()
            loop.run_forever()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def stop_thread(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        asyncio.run_coroutine_threadsafe(self.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        self._thread = None


class _Conn(asyncio.Protocol):
    def __init__(self, stub: StubWorker) -> None:
        self.stub = stub
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.busy = False  # a request is being answered
        self.task: asyncio.Task[None] | None = None

    # ---- asyncio.Protocol ----
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.stub._conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.stub._conns.discard(self)
        if self.busy:
            self.stub.disconnects += 1
        if self.task is not None:
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._write(400, b"text/plain", b"bad request", keep_alive=False)
            self.abort()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # ---- httptools callbacks ----
    def on_message_begin(self) -> None:
        self.url, self.headers, self.body = b"", [], []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.busy = True
        method = self.parser.get_method().decode()
        path = self.url.split(b"?", 1)[0].decode()
        body = b"".join(self.body)
        stub, b = self.stub, self.stub.behaviour
        parsed: Any = None
        if stub.record or path in GENERATION_PATHS:
            try:
                parsed = json.loads(body) if body else None
            except ValueError:
                parsed = body
        if stub.record:
            headers = {k.decode().lower(): v.decode() for k, v in self.headers}
            stub.seen.append(Seen(next(_order), stub.name, method, path, headers, parsed))
        if path in GENERATION_PATHS and method == "POST":
            slow = b.delay_s or b.chunk_delay_s or b.cut_after_chunks is not None
            if slow or self._failing():
                self.task = asyncio.ensure_future(self._generate_slow(path, parsed))
            else:  # the fast path: no task, the answer is written from this callback
                self._generate_now(path, parsed)
            return
        self._answer_info(method, path)

    # ---- answers ----
    def _failing(self) -> bool:
        b = self.stub.behaviour
        return b.fail_status is not None and (b.fail_count is None or b.fail_count > 0)

    def _answer_info(self, method: str, path: str) -> None:
        b = self.stub.behaviour
        if path in ("/health", "/health_generate"):
            body = b"" if b.health_status == 200 else _error(b.health_status, "stub unhealthy")
            self._write(b.health_status, b"application/json", body)
        elif path == "/v1/models":
            model = {"id": b.model_id, "object": "model", "owned_by": "stub"}
            self._json(200, {"object": "list", "data": [model]})
        elif path in ("/server_info", "/get_server_info"):
            self._json(200, {"stub": self.stub.name, "internal_states": [{}]})
        elif path in ("/model_info", "/get_model_info"):
            # No model_path: sglang-router would try to fetch a tokenizer for one.
            self._json(200, {"served_model_name": b.model_id, "is_generation": True})
        elif path == "/get_load":
            self._json(200, {"load": 0})
        else:
            self._write(404, b"application/json", _error(404, f"no route {method} {path}"))

    def _generate_now(self, path: str, body: Any) -> None:
        if not isinstance(body, dict):
            self._write(400, b"application/json", _error(400, "malformed JSON body"))
        elif body.get("stream"):
            events = [_event(path, i, self.stub.behaviour.chunks) for i in range(self._n())]
            self._write_chunked(b"".join(_chunk(e) for e in events) + _chunk(b""))
        else:
            self._json(200, _completion(path, self.stub.behaviour))

    async def _generate_slow(self, path: str, body: Any) -> None:
        b = self.stub.behaviour
        if b.delay_s:
            await asyncio.sleep(b.delay_s)
        if self._failing():
            if b.fail_count is not None:
                b.fail_count -= 1
            self._write(b.fail_status or 500, b"application/json", _error(500, "injected failure"))
            return
        if not isinstance(body, dict) or not body.get("stream"):
            self._generate_now(path, body)
            return
        self._write_head_chunked()
        for i in range(self._n()):
            if b.cut_after_chunks is not None and i >= b.cut_after_chunks:
                self.busy = False  # the stub's own doing, not a disconnect
                self.abort()
                return
            if i and b.chunk_delay_s:
                await asyncio.sleep(b.chunk_delay_s)
            self.transport.write(_chunk(_event(path, i, b.chunks)))  # type: ignore[union-attr]
        self.transport.write(_chunk(b""))  # type: ignore[union-attr]
        self.busy = False

    def _n(self) -> int:
        return self.stub.behaviour.chunks + 2  # content events, the finish event, [DONE]

    def _json(self, status: int, payload: Any) -> None:
        self._write(status, b"application/json", json.dumps(payload).encode())

    def _write(self, status: int, ctype: bytes, body: bytes, keep_alive: bool = True) -> None:
        conn = b"keep-alive" if keep_alive else b"close"
        head = b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\nconnection: %s\r\n\r\n"
        self.transport.write(  # type: ignore[union-attr]
            head % (status, _REASONS.get(status, b"Status"), ctype, len(body), conn) + body
        )
        self.busy = False

    def _write_head_chunked(self, chunks: bytes = b"") -> None:
        self.transport.write(_SSE_HEAD + chunks)  # type: ignore[union-attr]

    def _write_chunked(self, chunks: bytes) -> None:
        self._write_head_chunked(chunks)
        self.busy = False


_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"transfer-encoding: chunked\r\ncache-control: no-cache\r\n\r\n"
)
_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 500: b"Internal Server Error"}


def _error(status: int, message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "StubError", "code": status}}).encode()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _completion(path: str, b: Behaviour) -> dict[str, Any]:
    usage = {"prompt_tokens": 4, "completion_tokens": b.chunks, "total_tokens": 4 + b.chunks}
    text = "tok " * b.chunks
    if path == "/generate":
        return {"text": text, "output_ids": list(range(b.chunks)), "meta_info": usage}
    if path == "/v1/completions":
        choice = {"index": 0, "text": text, "finish_reason": "length"}
        return {"id": "cmpl-stub", "object": "text_completion", "choices": [choice], "usage": usage}
    message = {"role": "assistant", "content": text}
    choice = {"index": 0, "message": message, "finish_reason": "length"}
    return {"id": "chatcmpl-stub", "object": "chat.completion", "choices": [choice], "usage": usage}


def _event(path: str, i: int, chunks: int) -> bytes:
    """SSE event i of a stream: `chunks` content events, a finish event, then [DONE]."""
    if i == chunks + 1:
        return b"data: [DONE]\n\n"
    finish = "length" if i == chunks else None
    text = "" if i == chunks else "tok "
    if path == "/generate":
        payload: dict[str, Any] = {"text": "tok " * min(i + 1, chunks), "meta_info": {"id": i}}
    elif path == "/v1/completions":
        choice = {"index": 0, "text": text, "finish_reason": finish}
        payload = {"id": "cmpl-stub", "object": "text_completion", "choices": [choice]}
    else:
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
        payload = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "choices": [choice]}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tests.stub_worker", description=__doc__)
    ap.add_argument("--port", type=int, action="append", required=True, help="repeatable")
    ap.add_argument("--record", action="store_true", help="keep a log of requests (tests)")
    args = ap.parse_args(argv)

    async def serve() -> None:
        stubs = [StubWorker(p, record=args.record) for p in args.port]
        for stub in stubs:
            await stub.start()
        print("stub workers ready:", " ".join(s.url for s in stubs), flush=True)
        await asyncio.Event().wait()

    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    try:
        run(serve())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()

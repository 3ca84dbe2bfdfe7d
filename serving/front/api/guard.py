"""What every request passes before FastAPI sees it: the API key, the body size and the body
read deadline. A plain ASGI wrapper, so a refusal costs no routing, no parsing and no body read.

    Authorization: Bearer <--api-key>   every route but OPEN_PATHS (401 otherwise)
    content-length over the limit       413 before a byte of the body is read
    body over the limit as it arrives   413, the rest is never read
    no body bytes for the read timeout  408 (a client that declares 1000 bytes and sends 10)
    a content type that is not JSON     415 (the routes read JSON only)
    JSON nested deeper than MAX_JSON_DEPTH   400 (Python's parser would recurse out of stack)

The body is read here in full and handed on in one message; after it, the app's receive() is
the server's own, so a disconnect still reaches the routes that watch for it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
from typing import Any

from serving.front.api.errors import error_body

OPEN_PATHS = frozenset({"/health", "/metrics"})  # load balancers and scrapers carry no key
BODY_TOTAL_FACTOR = 6  # the whole body must arrive within this many read timeouts
MAX_JSON_DEPTH = 64  # arrays and objects inside one another; OpenAI bodies need under 20
_JSON_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


class RequestGuard:
    def __init__(
        self, app: Any, api_key: str | None, max_payload_size: int, read_timeout: float
    ) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.limit = max_payload_size
        self.read_timeout = read_timeout

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.expected is not None and scope["path"] not in OPEN_PATHS:
            if not authorized(headers.get(b"authorization"), self.expected):
                return await _refuse(send, 401, "invalid or missing API key (Bearer token)")
        if scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            return await self.app(scope, receive, send)
        if not is_json(headers.get(b"content-type")):
            ctype = headers[b"content-type"].decode("latin-1")
            return await _refuse(send, 415, f"content type {ctype!r}: send application/json")
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await _refuse(
                send, 413, f"request body of {int(declared)} bytes is over {self.limit} bytes"
            )
        try:
            body = await read_body(receive, self.limit, self.read_timeout)
        except BodyError as e:
            return await _refuse(send, e.status, e.message)
        if body is None:  # the client left while sending
            return
        if json_too_deep(body, MAX_JSON_DEPTH):
            return await _refuse(send, 400, f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class BodyError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def read_body(receive: Any, limit: int, read_timeout: float) -> bytes | None:
    """The whole body, None if the client disconnected; BodyError 413 past `limit`, 408 when
    no bytes came for `read_timeout` s or the whole took BODY_TOTAL_FACTOR times that."""
    loop = asyncio.get_running_loop()
    end = loop.time() + read_timeout * BODY_TOTAL_FACTOR
    parts: list[bytes] = []
    size = 0
    while True:
        wait = min(read_timeout, end - loop.time())
        try:
            message = await asyncio.wait_for(receive(), max(wait, 0.0))
        except asyncio.TimeoutError:
            raise BodyError(
                408, f"request body not received in time ({size} bytes after the deadline)"
            ) from None
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyError(413, f"request body is over {limit} bytes")
        parts.append(chunk)
        if not message.get("more_body"):
            return b"".join(parts)


def is_json(content_type: bytes | None) -> bool:
    """What FastAPI parses as JSON: no content type, application/json, application/*+json."""
    if not content_type:
        return True
    mime = content_type.split(b";", 1)[0].strip().lower()
    return mime == b"application/json" or (
        mime.startswith(b"application/") and mime.endswith(b"+json")
    )


def json_too_deep(raw: bytes, limit: int) -> bool:
    """Whether `raw` nests arrays/objects more than `limit` deep. Cheap for ordinary bodies:
    fewer than `limit` opening brackets cannot nest deeper, and only bodies with more pay for
    a scan of their brackets outside strings (malformed JSON is the parser's to report)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    depth = 0
    for b in brackets:
        depth += 1 if b in b"[{" else -1
        if depth > limit:
            return True
    return False


def authorized(header: bytes | None, expected: bytes) -> bool:
    """Constant-time comparison: the key must not leak through response timing."""
    return header is not None and hmac.compare_digest(header, expected)


async def _refuse(send: Any, status: int, message: str) -> None:
    body = json.dumps(error_body(status, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if status in (408, 413):
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

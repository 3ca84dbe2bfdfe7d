"""Checks on a request before it costs a worker anything: API key, content type, JSON depth.

Twins of serving/front/api/guard.py's (router/ imports nothing from serving): a body the router lets
through must be one the workers accept, and the other way round.
"""

from __future__ import annotations

import hmac
import re

MAX_JSON_DEPTH = 64  # arrays and objects inside one another; OpenAI bodies need under 20
OPEN_PATHS = frozenset({"/health", "/liveness", "/readiness", "/metrics"})
_JSON_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def authorized(header: bytes | None, expected: bytes) -> bool:
    """Constant-time comparison: the key must not leak through response timing."""
    return header is not None and hmac.compare_digest(header, expected)


def is_json(content_type: bytes | None) -> bool:
    """What the workers parse as JSON: no content type, application/json, application/*+json."""
    if not content_type:
        return True
    mime = content_type.split(b";", 1)[0].strip().lower()
    return mime == b"application/json" or (
        mime.startswith(b"application/") and mime.endswith(b"+json")
    )


def json_too_deep(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether `raw` nests arrays/objects more than `limit` deep (json.loads would raise
    RecursionError near 1000). Fewer than `limit` opening brackets cannot nest deeper; only
    bodies with more pay for a scan of their brackets outside strings."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    depth = 0
    for b in brackets:
        depth += 1 if b in b"[{" else -1
        if depth > limit:
            return True
    return False

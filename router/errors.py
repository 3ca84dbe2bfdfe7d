"""OpenAI-style error bodies: the one shape every failure the router reports takes."""

from __future__ import annotations

import json

_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    401: "AuthenticationError",
    408: "RequestTimeoutError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


RETRY_AFTER = (b"retry-after", b"1")  # sent with 429 and 503: the client may try again soon


class ClientError(Exception):
    """A request the router refuses or cannot finish, before anything was sent to the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_body(status: int, message: str) -> bytes:
    """OpenAI's nested form plus the flat copy SGLang's and vLLM's clients read (as the
    workers write it)."""
    error = {
        "message": message,
        "type": _TYPES.get(status, "BadRequestError" if status < 500 else "ServerError"),
        "param": None,
        "code": status,
    }
    return json.dumps({"object": "error", "error": error, **error}).encode()


def error_message(body: bytes) -> str:
    """The message inside a worker's error body, or the start of the body as text."""
    try:
        data = json.loads(body)
    except ValueError:
        return body[:300].decode(errors="replace").strip() or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(data.get("message"), str):
            return data["message"]
    return body[:300].decode(errors="replace")

"""OpenAI-style error bodies and the exception handlers that produce them."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.front.chat import ChatTemplateError
from serving.front.engine_client import EngineUnavailable, RidInUse
from serving.sampling_params import SamplingError

log = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


class APIError(Exception):
    """A request the server refuses or cannot finish; becomes an error body with `status`.
    `code` is OpenAI's error code where OpenAI defines one (e.g. "context_length_exceeded")."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's nested form, plus SGLang/vLLM's flat one for their clients. The flat `code` is
    always the status (SGLang's and vLLM's clients read an int); the nested one is OpenAI's
    code where one is given, since OpenAI's clients read it from there (openai-python's
    `BadRequestError.code`; LangChain looks for "context_length_exceeded" in the error)."""
    error = {
        "message": message,
        "type": _ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "ServerError"),
        "param": param,
        "code": status,
    }
    return {"object": "error", "error": {**error, "code": code or status}, **error}


RETRY_AFTER_S = 1  # what 429 and 503 tell a client to wait before trying again


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
    body = error_body(status, message, param, code)
    return JSONResponse(body, status_code=status, headers=headers)


def describe_validation_errors(errors: Sequence[Any]) -> tuple[str, str | None]:
    """pydantic's error list as one line naming the field(s), and the first field."""
    if errors and errors[0].get("type") == "json_invalid":
        detail = (errors[0].get("ctx") or {}).get("error", "invalid JSON")
        return f"malformed JSON body: {detail}", None
    by_field: dict[str, list[str]] = {}
    for e in errors:
        path = ".".join(str(part) for part in e.get("loc", ()) if not _is_type_tag(part))
        messages = by_field.setdefault(path or "request body", [])
        if e.get("msg") not in messages:
            messages.append(e.get("msg", "invalid value"))
    parts = [f"{field}: {' or '.join(msgs)}" for field, msgs in by_field.items()]
    first = next(iter(by_field), None)
    return "; ".join(parts), None if first == "request body" else first


def _is_type_tag(part: Any) -> bool:
    """Location segments pydantic adds: 'body', and the union member tried ('list[str]')."""
    if not isinstance(part, str):
        return False
    return part == "body" or part in _TYPE_TAGS or "[" in part or part[:1].isupper()


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_errors(e.errors())
        return error_response(400, message, param)

    @app.exception_handler(SamplingError)
    async def _sampling(_: Request, e: SamplingError) -> JSONResponse:
        return error_response(400, str(e), str(e).split(":", 1)[0])

    @app.exception_handler(ChatTemplateError)
    async def _template(_: Request, e: ChatTemplateError) -> JSONResponse:
        return error_response(400, str(e), "messages")

    @app.exception_handler(EngineUnavailable)
    async def _unavailable(_: Request, e: EngineUnavailable) -> JSONResponse:
        return error_response(503, str(e))

    @app.exception_handler(RidInUse)
    async def _rid_in_use(_: Request, e: RidInUse) -> JSONResponse:
        return error_response(409, str(e), "rid")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        if e.status_code == 404:
            message = f"{request.method} {request.url.path}: no such route"
        elif e.status_code == 405:
            message = f"{request.method} {request.url.path}: method not allowed"
        else:
            message = str(e.detail)
        return error_response(e.status_code, message)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(500, f"internal error: {type(e).__name__}: {e}")

"""Pieces of responses every generation route uses: SSE framing, finish reasons, usage."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi.responses import StreamingResponse

from serving.front.api.errors import APIError, error_body
from serving.front.api.sequences import Seq
from serving.front.engine_client import EngineUnavailable, RidInUse

log = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def stream_error(e: Exception) -> str:
    """The SSE event for a failure after the stream has started (the status is already 200)."""
    if isinstance(e, APIError):
        return sse(error_body(e.status, e.message, e.param, e.code))
    if isinstance(e, EngineUnavailable):
        return sse(error_body(503, str(e)))
    if isinstance(e, RidInUse):
        return sse(error_body(409, str(e), "rid"))
    log.error("stream failed", exc_info=e)
    return sse(error_body(500, f"internal error: {type(e).__name__}: {e}"))


def finish_reason(seq: Seq, tool_calls: bool = False) -> str | None:
    """OpenAI's finish_reason: stop, length, tool_calls, or SGLang's abort."""
    if seq.finish_reason is None:
        return None
    kind = seq.finish_reason.kind
    return "tool_calls" if kind == "stop" and tool_calls else kind


def matched_stop(seq: Seq) -> int | str | None:
    return seq.finish_reason.matched if seq.finish_reason is not None else None


def usage(seqs: Sequence[Seq], n: int, reasoning_tokens: int | None = None) -> dict[str, Any]:
    """Each prompt counts once however many sequences (n) sampled from it."""
    prompt = sum(seq.prompt_tokens for seq in seqs if seq.index % n == 0)
    completion = sum(len(seq.output_ids) for seq in seqs)
    counts: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {
            "cached_tokens": sum(seq.cached_tokens for seq in seqs if seq.index % n == 0)
        },
    }
    images = sum(im.num_tokens for seq in seqs if seq.index % n == 0 for im in seq.request.images)
    if images:  # the prompt's <|image|> tokens (counted in prompt_tokens too)
        counts["prompt_tokens_details"]["image_tokens"] = images
    if reasoning_tokens is not None:
        counts["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return counts

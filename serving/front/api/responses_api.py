"""POST /v1/responses: a chat completion (serving/front/api/responses_protocol.py) answered as a
Response with reasoning, message and function_call output items, whole or as typed SSE events.

Streaming follows OpenAI's event order: response.created, response.in_progress, then per output
item output_item.added, its content part and text (or argument) deltas, their .done events and
output_item.done, one item closed before the next opens, then response.completed (or
response.incomplete after max_output_tokens) with the whole Response.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from serving.front.api.chat_output import ChatOutputParser, parse_reply
from serving.front.api.chat_request import ChatRun, prepare_chat, reasoning_token_count
from serving.front.api.context import FrontContext
from serving.front.api.errors import APIError, error_body
from serving.front.api.responses import event_stream
from serving.front.api.responses_protocol import ResponsesRequest, chat_request
from serving.front.api.sequences import Seq, collect, run_seqs


def responses_router(ctx: FrontContext) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        chat = chat_request(body)
        run = await prepare_chat(ctx, chat)
        head = _head(ctx, body, run.rid)
        if body.stream:
            return event_stream(_stream(ctx, head, run))
        await collect(request, ctx.client, run.seqs)
        (seq,) = run.seqs
        reply = parse_reply(seq.text.text, run.reasoning, run.opens, run.tools)
        items = []
        if reply.reasoning:
            items.append(_reasoning_item(reply.reasoning))
        if reply.content or not reply.tool_calls:
            items.append(_message_item(reply.content))
        items += [_call_item(call) for call in reply.tool_calls]
        return JSONResponse(_finished(ctx, head, seq, items, reply.reasoned))

    return router


def _head(ctx: FrontContext, body: ResponsesRequest, rid: str) -> dict[str, Any]:
    """The Response's fields that do not depend on the output."""
    return {
        "id": "resp_" + rid.removeprefix("chatcmpl-"),
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "model": ctx.model_name,
        "output": [],
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": body.tools or [],
        "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls,
        "text": body.text or {"format": {"type": "text"}},
        "reasoning": body.reasoning,
        "metadata": body.metadata or {},
        "store": False,
        "error": None,
        "incomplete_details": None,
        "usage": None,
    }


def _finished(
    ctx: FrontContext, head: dict[str, Any], seq: Seq, items: list[dict], reasoned: bool
) -> dict[str, Any]:
    cut = seq.finish_reason is not None and seq.finish_reason.kind == "length"
    output = len(seq.output_ids)
    return {
        **head,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": items,
        "usage": {
            "input_tokens": seq.prompt_tokens,
            "input_tokens_details": {"cached_tokens": seq.cached_tokens},
            "output_tokens": output,
            "output_tokens_details": {
                "reasoning_tokens": reasoning_token_count(ctx, seq, reasoned)
            },
            "total_tokens": seq.prompt_tokens + output,
        },
    }


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id or _new_id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def _message_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id or _new_id("msg"),
        "role": "assistant",
        "status": "completed",
        "content": [_text_part(text)],
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(call: dict[str, Any], item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id or _new_id("fc"),
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": "completed",
    }


_TEXT_EVENTS = {"reasoning": "response.reasoning_text", "message": "response.output_text"}


class _Events:
    """Numbered SSE events, and the one output item open at a time."""

    def __init__(self) -> None:
        self.number = 0
        self.items: list[dict[str, Any]] = []  # closed items, whole
        self.kind: str | None = None  # the open item: "reasoning" | "message" | "function_call"
        self.item_id = ""
        self.text = ""  # its text or arguments so far
        self.call: dict[str, Any] = {}  # the open call's id and name

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def open(self, kind: str, call: dict[str, Any] | None = None) -> list[str]:
        out = self.close()
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        self.kind, self.item_id, self.text, self.call = kind, _new_id(prefix), "", call or {}
        index = len(self.items)
        if kind == "function_call":
            item = {**self._whole(), "status": "in_progress"}
            return out + [self.event("response.output_item.added", output_index=index, item=item)]
        empty = {**self._whole(), "status": "in_progress"}
        empty["content"] = []
        part = self._part("")
        return out + [
            self.event("response.output_item.added", output_index=index, item=empty),
            self.event("response.content_part.added", part=part, **self._at(index)),
        ]

    def delta(self, text: str) -> str:
        self.text += text
        index = len(self.items)
        if self.kind == "function_call":
            return self.event(
                "response.function_call_arguments.delta",
                item_id=self.item_id,
                output_index=index,
                delta=text,
            )
        extra = {} if self.kind == "reasoning" else {"logprobs": []}
        return self.event(
            _TEXT_EVENTS[self.kind] + ".delta", delta=text, **self._at(index), **extra
        )

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        index, whole = len(self.items), self._whole()
        if self.kind == "function_call":
            out = [
                self.event(
                    "response.function_call_arguments.done",
                    item_id=self.item_id,
                    output_index=index,
                    name=self.call.get("name"),
                    arguments=self.text,
                )
            ]
        else:
            done = _TEXT_EVENTS[self.kind] + ".done"
            extra = {} if self.kind == "reasoning" else {"logprobs": []}
            part = self._part(self.text)
            out = [
                self.event(done, text=self.text, **self._at(index), **extra),
                self.event("response.content_part.done", part=part, **self._at(index)),
            ]
        out.append(self.event("response.output_item.done", output_index=index, item=whole))
        self.items.append(whole)
        self.kind = None
        return out

    def _at(self, index: int) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": index, "content_index": 0}

    def _part(self, text: str) -> dict[str, Any]:
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return _text_part(text)

    def _whole(self) -> dict[str, Any]:
        if self.kind == "reasoning":
            return _reasoning_item(self.text, self.item_id)
        if self.kind == "message":
            return _message_item(self.text, self.item_id)
        call = {"id": self.call.get("id"), "function": {**self.call, "arguments": self.text}}
        return _call_item(call, self.item_id)


async def _stream(ctx: FrontContext, head: dict[str, Any], run: ChatRun) -> AsyncIterator[str]:
    events = _Events()
    (seq,) = run.seqs
    parser = ChatOutputParser(run.reasoning, run.opens, run.tools)
    yield events.event("response.created", response=head)
    yield events.event("response.in_progress", response=head)
    try:
        async with aclosing(run_seqs(ctx.client, run.seqs)) as updates:
            async for update in updates:
                if (error := seq.error()) is not None:
                    yield _error(events, error.status, error.message)
                    return
                parsed = parser.feed(update.text, final=seq.finished)
                if parsed.reasoning:
                    if events.kind != "reasoning":
                        for event in events.open("reasoning"):
                            yield event
                    yield events.delta(parsed.reasoning)
                if parsed.content:
                    if events.kind != "message":
                        for event in events.open("message"):
                            yield event
                    yield events.delta(parsed.content)
                for call in parsed.tool_calls:
                    if call.get("id"):  # a new call starts
                        named = {"id": call["id"], "name": call["function"].get("name")}
                        for event in events.open("function_call", named):
                            yield event
                    if call["function"].get("arguments"):
                        yield events.delta(call["function"]["arguments"])
    except APIError as e:
        yield _error(events, e.status, e.message)
        return
    except Exception as e:
        yield _error(events, 500, f"internal error: {type(e).__name__}: {e}")
        return
    if not events.items and events.kind is None:  # nothing at all: an empty message
        for event in events.open("message"):
            yield event
    for event in events.close():
        yield event
    final = _finished(ctx, head, seq, events.items, parser.reasoned)
    kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
    yield events.event(kind, response=final)


def _error(events: _Events, status: int, message: str) -> str:
    error = error_body(status, message)["error"]
    return events.event("error", code=str(error.get("code")), message=message, param=None)

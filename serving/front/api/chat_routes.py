"""POST /v1/chat/completions: whole replies or a stream of chunks, each choice split into
reasoning, content and tool calls."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from serving.front.api.chat_output import ChatDelta, ChatOutputParser, parse_reply
from serving.front.api.chat_request import prepare_chat, reasoning_token_count
from serving.front.api.context import FrontContext
from serving.front.api.logprobs import chat_logprobs
from serving.front.api.openai_protocol import ChatCompletionRequest
from serving.front.api.openai_request import usage_mode
from serving.front.api.openai_stream import ChunkStream
from serving.front.api.responses import event_stream, finish_reason, matched_stop, usage
from serving.front.api.sequences import Seq, Update, collect, start_seqs


def chat_router(ctx: FrontContext) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        run = await prepare_chat(ctx, body)
        seqs, rid, reasoning = run.seqs, run.rid, run.reasoning
        if body.stream:
            parsers = [ChatOutputParser(reasoning, run.opens, run.tools) for _ in seqs]
            updates = await start_seqs(request, ctx.client, seqs)
            stream = _ChatStream(
                ctx, rid, seqs, usage_mode(body), parsers, body.stream_reasoning, reasoning
            )
            return event_stream(stream.run(updates))
        await collect(request, ctx.client, seqs)
        choices, reasoning_tokens = [], 0
        for seq in seqs:
            reply = parse_reply(seq.text.text, reasoning, run.opens, run.tools)
            choices.append(_chat_choice(ctx, seq, reply.reasoning, reply.content, reply.tool_calls))
            reasoning_tokens += reasoning_token_count(ctx, seq, reply.reasoned)
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": ctx.model_name,
                "choices": choices,
                "usage": usage(seqs, body.n, reasoning_tokens if reasoning else None),
            }
        )

    return router


def _chat_choice(
    ctx: FrontContext,
    seq: Seq,
    reasoning: str,
    content: str,
    tool_calls: list[dict[str, Any]],
) -> dict[str, Any]:
    message = {
        "role": "assistant",
        "content": content,  # "" rather than null with tool calls, as SGLang
        "reasoning_content": reasoning or None,
        "tool_calls": tool_calls or None,
    }
    logprobs = chat_logprobs(ctx.tokenizer, seq.logprobs) if seq.request.return_logprob else None
    return {
        "index": seq.index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason(seq, bool(tool_calls)),
        "matched_stop": matched_stop(seq),
    }


class _ChatStream(ChunkStream):
    object_name = "chat.completion.chunk"
    part = "delta"

    def __init__(
        self,
        ctx: FrontContext,
        rid: str,
        seqs: list[Seq],
        usage_mode: tuple[bool, bool],
        parsers: list[ChatOutputParser],
        stream_reasoning: bool,
        reasoning: bool,
    ) -> None:
        super().__init__(ctx, rid, seqs, usage_mode)
        self.parsers = parsers
        self.stream_reasoning = stream_reasoning
        self.reasoning = reasoning
        self.held_reasoning = ["" for _ in seqs]  # stream_reasoning=False: sent whole, when it ends
        self.reasoning_tokens = 0

    def opening(self) -> Iterator[str]:
        for seq in self.seqs:
            yield self.chunk(seq.index, {"role": "assistant", "content": ""})

    def events(self, update: Update) -> Iterator[str]:
        seq = update.seq
        parser = self.parsers[seq.index]
        parsed = parser.feed(update.text, final=seq.finished)
        if not self.stream_reasoning:
            held = self.held_reasoning
            held[seq.index] += parsed.reasoning
            parsed.reasoning = ""
            if parsed.content or parsed.tool_calls or seq.finished:
                parsed.reasoning, held[seq.index] = held[seq.index], ""
        delta = _chat_delta(parsed)
        logprobs = (
            chat_logprobs(self.ctx.tokenizer, update.logprobs)
            if seq.request.return_logprob and update.logprobs
            else None
        )
        if delta or logprobs:
            yield self.chunk(seq.index, delta or {"content": ""}, logprobs=logprobs)
        if seq.finished:
            self.reasoning_tokens += reasoning_token_count(self.ctx, seq, parser.reasoned)
            yield self.chunk(
                seq.index,
                {},
                finish_reason=finish_reason(seq, parser.tool_call_count > 0),
                matched_stop=matched_stop(seq),
            )

    def final_usage(self) -> dict[str, Any]:
        return usage(self.seqs, len(self.seqs), self.reasoning_tokens if self.reasoning else None)


def _chat_delta(parsed: ChatDelta) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if parsed.reasoning:
        delta["reasoning_content"] = parsed.reasoning
    if parsed.content:
        delta["content"] = parsed.content
    if parsed.tool_calls:
        delta["tool_calls"] = parsed.tool_calls
    return delta

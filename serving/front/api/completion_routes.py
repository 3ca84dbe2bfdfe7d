"""POST /v1/completions: OpenAI's legacy text completions, with echo and prompt logprobs."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from serving.front.api.context import FrontContext
from serving.front.api.errors import APIError
from serving.front.api.image_request import attach_images
from serving.front.api.logprobs import completion_logprobs
from serving.front.api.openai_protocol import CompletionRequest
from serving.front.api.openai_request import (
    bootstrap_fields,
    check_common,
    constrain,
    usage_mode,
)
from serving.front.api.openai_stream import ChunkStream
from serving.front.api.responses import event_stream, finish_reason, matched_stop, usage
from serving.front.api.sampling import check_prompt_ids, check_top_logprobs, request_sampling
from serving.front.api.sequences import Seq, Update, collect, make_seqs, start_seqs
from serving.front.api.structured_output import requested_constraint
from serving.protocol import SchedulerReady

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy default; chat defaults to the room left


def completion_router(ctx: FrontContext) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        ready = ctx.scheduler()
        check_common(ctx, body)
        if body.logprobs is not None:
            check_top_logprobs(body.logprobs, "logprobs")
        prompt_logprobs = body.echo and body.logprobs is not None  # scored from the prefill
        if body.suffix is not None:
            raise APIError(400, "suffix: not supported by this server", "suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of: only best_of == n is supported", "best_of")
        prompts = await _completion_prompts(ctx, body.prompt, ready)
        samplings = [
            request_sampling(
                ctx.sampling_defaults,
                body,
                ready,
                len(ids),
                max_tokens=body.max_tokens,
                default_max_tokens=COMPLETION_DEFAULT_MAX_TOKENS,
                seed=body.seed,
                min_new_tokens=body.min_tokens,
                scoring_prompt=prompt_logprobs,
            )
            for ids in prompts
        ]
        constraint = requested_constraint(
            body.response_format, body.regex, body.ebnf, body.json_schema
        )
        constrain(ctx, samplings, constraint)
        rid = body.rid or f"cmpl-{uuid.uuid4().hex}"
        seqs = make_seqs(
            ctx.tokenizer,
            rid,
            prompts,
            samplings,
            body.n,
            return_logprob=body.logprobs is not None,
            top_logprobs_num=body.logprobs or 0,
            logprob_start_len=0 if prompt_logprobs else -1,
            **bootstrap_fields(body),
        )
        echoes = [_echo(ctx, body, seq) for seq in seqs]
        if body.stream:
            updates = await start_seqs(request, ctx.client, seqs)
            stream = _CompletionStream(ctx, rid, seqs, usage_mode(body), echoes, body.n)
            return event_stream(stream.run(updates))
        await collect(request, ctx.client, seqs)
        choices = [_completion_choice(ctx, seq, echo) for seq, echo in zip(seqs, echoes)]
        return JSONResponse(
            {
                "id": rid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": ctx.model_name,
                "choices": choices,
                "usage": usage(seqs, body.n),
            }
        )

    return router


def _completion_choice(ctx: FrontContext, seq: Seq, echo: str) -> dict[str, Any]:
    logprobs = None
    if seq.request.return_logprob:
        if seq.request.logprob_start_len == 0:  # echo: the prompt's tokens come first
            logprobs = completion_logprobs(ctx.tokenizer, seq.input_logprobs + seq.logprobs, 0)
        else:
            logprobs = completion_logprobs(ctx.tokenizer, seq.logprobs, len(echo))
    return {
        "index": seq.index,
        "text": echo + seq.text.text,
        "logprobs": logprobs,
        "finish_reason": finish_reason(seq),
        "matched_stop": matched_stop(seq),
    }


async def _completion_prompts(
    ctx: FrontContext,
    prompt: str | list[str] | list[int] | list[list[int]],
    ready: SchedulerReady,
) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]  # type: ignore[list-item]
    for p in prompt:  # every text is length-checked before any is tokenised
        if isinstance(p, str):
            ctx.check_text_length(len(p), ready.context_length, "prompt")
    prompts = [
        await ctx.encode_checked(p, True, ready.context_length, "prompt")
        if isinstance(p, str)
        else list(p)
        for p in prompt
    ]
    if not prompts:
        raise APIError(400, "prompt: must not be empty", "prompt")
    for ids in prompts:
        check_prompt_ids(ids, ready.vocab_size, "prompt")
        # completions take no images: an <|image|> here would be an image-less placeholder
        # (and share prefix-cache keys with image runs)
        attach_images(ctx.vision, ids, [], "prompt")
    return prompts


def _echo(ctx: FrontContext, body: CompletionRequest, seq: Seq) -> str:
    if not body.echo:
        return ""
    return ctx.tokenizer.decode(seq.request.input_ids, skip_special_tokens=False)


class _CompletionStream(ChunkStream):
    """Echo with logprobs: the echo waits for the prompt's logprobs, which come with the first
    output, and both go out in that chunk."""

    object_name = "text_completion"
    part = "text"

    def __init__(
        self,
        ctx: FrontContext,
        rid: str,
        seqs: list[Seq],
        usage_mode: tuple[bool, bool],
        echoes: list[str],
        n: int,
    ) -> None:
        super().__init__(ctx, rid, seqs, usage_mode)
        self.echoes = echoes
        self.n = n
        self.scored = [seq.request.logprob_start_len == 0 for seq in seqs]
        self.held = [echo if s else "" for echo, s in zip(echoes, self.scored)]
        self.text_offsets = [0 if s else len(echo) for echo, s in zip(echoes, self.scored)]

    def opening(self) -> Iterator[str]:
        for seq, echo, scored in zip(self.seqs, self.echoes, self.scored):
            if echo and not scored:
                yield self.chunk(seq.index, echo)

    def events(self, update: Update) -> Iterator[str]:
        seq = update.seq
        text, self.held[seq.index] = self.held[seq.index] + update.text, ""
        entries = update.input_logprobs + update.logprobs
        logprobs = None
        if seq.request.return_logprob and entries:
            logprobs = completion_logprobs(
                self.ctx.tokenizer, entries, self.text_offsets[seq.index]
            )
            self.text_offsets[seq.index] += sum(len(t) for t in logprobs["tokens"])
        if seq.finished:  # the last text and logprobs come with the finish reason
            yield self.chunk(
                seq.index,
                text,
                logprobs=logprobs,
                finish_reason=finish_reason(seq),
                matched_stop=matched_stop(seq),
            )
        elif text or logprobs:
            yield self.chunk(seq.index, text, logprobs=logprobs)

    def final_usage(self) -> dict[str, Any]:
        return usage(self.seqs, self.n)

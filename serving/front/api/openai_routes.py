"""POST /v1/chat/completions and /v1/completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from serving.front.api.chat_output import ChatDelta, ChatOutputParser, parse_reply
from serving.front.api.context import FrontContext
from serving.front.api.errors import APIError
from serving.front.api.logprobs import chat_logprobs, completion_logprobs
from serving.front.api.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ContentPart,
    NamedToolChoice,
    SamplingRequest,
)
from serving.front.api.openai_stream import ChunkStream, usage_mode
from serving.front.api.reasoning import prompt_opens_reasoning
from serving.front.api.responses import (
    event_stream,
    finish_reason,
    matched_stop,
    usage,
)
from serving.front.api.sampling import (
    check_n,
    check_prompt_ids,
    check_top_logprobs,
    request_sampling,
)
from serving.front.api.sequences import Seq, Update, collect, make_seqs, start_seqs
from serving.front.api.structured_output import (
    Constraint,
    after_reasoning,
    forced_tool_calls,
    requested_constraint,
)
from serving.protocol import SamplingParams, SchedulerReady

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy default; chat defaults to the room left


def openai_router(ctx: FrontContext) -> APIRouter:
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

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        ready = ctx.scheduler()
        _check_common(ctx, body)
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
        _constrain(ctx, samplings, constraint)
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
            **_bootstrap(body),
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


@dataclass
class ChatRun:
    """A chat request made ready to run: its sequences and how to parse their text."""

    seqs: list[Seq]
    rid: str
    reasoning: bool  # split the reasoning off
    opens: bool  # the prompt leaves the model inside <think>
    tools: list[dict[str, Any]] | None  # parse tool calls against these; None: markup is text


async def prepare_chat(ctx: FrontContext, body: ChatCompletionRequest) -> ChatRun:
    """Validate, render, tokenize and constrain a chat request (the Responses API's too)."""
    ready = ctx.scheduler()
    _check_common(ctx, body)
    if not body.messages:
        raise APIError(400, "messages: must not be empty", "messages")
    if ctx.chat_template is None:
        raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
    top = body.top_logprobs or 0
    check_top_logprobs(top, "top_logprobs")
    if top and not body.logprobs:
        raise APIError(400, "top_logprobs: needs logprobs true", "top_logprobs")
    # The template renders every message's content: content past the bound is refused here,
    # before the copies that rendering and model_dump make of it.
    chars = sum(_content_chars(m.content) for m in body.messages)
    ctx.check_text_length(chars, ready.context_length, "messages", "the messages' content")
    tools, forced = _tool_choice(body)
    prompt = ctx.chat_template.render(
        [m.model_dump(exclude_none=True) for m in body.messages],
        tools=tools,
        add_generation_prompt=not body.continue_final_message,
        continue_final_message=body.continue_final_message,
        **(body.chat_template_kwargs or {}),
    )
    ids = await ctx.encode_checked(prompt, False, ready.context_length, "messages")
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    sampling = request_sampling(
        ctx.sampling_defaults,
        body,
        ready,
        len(ids),
        max_tokens=max_tokens,
        default_max_tokens=None,  # the room left
        seed=body.seed,
        min_new_tokens=body.min_tokens,
        prompt_param="messages",
    )
    reasoning = ctx.args.reasoning_parser is not None and body.separate_reasoning
    opens = prompt_opens_reasoning(prompt)
    parsed_tools = tools if ctx.args.tool_call_parser else None
    if ctx.args.reasoning_parser or parsed_tools:
        sampling.skip_special_tokens = False  # the markup tokens stay in the text
    _constrain(ctx, [sampling], _chat_constraint(ctx, body, tools, forced, reasoning, opens))
    rid = body.rid or f"chatcmpl-{uuid.uuid4().hex}"
    seqs = make_seqs(
        ctx.tokenizer,
        rid,
        [ids],
        [sampling],
        body.n,
        return_logprob=body.logprobs,
        top_logprobs_num=top,
        **_bootstrap(body),
    )
    return ChatRun(seqs, rid, reasoning, opens, parsed_tools)


def _content_chars(content: str | list[ContentPart] | None) -> int:
    if isinstance(content, str):
        return len(content)
    return sum(len(part.text or "") for part in content or ())


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


def reasoning_token_count(ctx: FrontContext, seq: Seq, reasoned: bool) -> int:
    """Output tokens before `</think>` (all of them when the reply never left the reasoning)."""
    if not reasoned:
        return 0
    end = ctx.glm_tokens.think_end if ctx.glm_tokens is not None else None
    ids = seq.output_ids
    return ids.index(end) if end in ids else len(ids)


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


def _check_common(ctx: FrontContext, body: SamplingRequest) -> None:
    ctx.check_model(body.model)
    check_n(body.n)
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options: only allowed when stream is true", "stream_options")


def _tool_choice(body: ChatCompletionRequest) -> tuple[list[dict[str, Any]] | None, str | None]:
    """(the tools the template shows and the parser knows, and what a call is forced to:
    None = not forced, "" = any tool, else that function's name). As SGLang: tool_choice
    "none" shows no tools, a named function shows only that one."""
    choice = body.tool_choice or ("auto" if body.tools else "none")
    if choice == "none":
        return None, None
    if not body.tools:
        raise APIError(400, "tool_choice: needs tools", "tool_choice")
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    if choice == "auto":
        return tools, None
    if choice == "required":
        return tools, ""
    name = choice.function.name if isinstance(choice, NamedToolChoice) else ""
    named = [t for t in tools if t["function"]["name"] == name]
    if not named:  # a 400, as OpenAI and vLLM (docs/PROTOCOL.md); worded as SGLang and vLLM
        offered = ", ".join(repr(t["function"]["name"]) for t in tools)
        raise APIError(
            400,
            f"tool_choice: Tool {name!r} not found in tools list ({offered}): the tool "
            "specified in `tool_choice` does not match any of the specified `tools`",
            "tool_choice",
        )
    return named, name


def _chat_constraint(
    ctx: FrontContext,
    body: ChatCompletionRequest,
    tools: list[dict[str, Any]] | None,
    forced: str | None,
    reasoning: bool,
    opens_reasoning: bool,
) -> Constraint | None:
    """The reply's constraint: the forced tool call, or the requested format (after the
    reasoning when the reply starts in it and the reasoning is split off)."""
    constraint = requested_constraint(body.response_format, body.regex, body.ebnf, None)
    if forced is None:
        if constraint is not None and reasoning and opens_reasoning and ctx.glm_tokens:
            return after_reasoning(constraint, ctx.glm_tokens)
        return constraint
    if constraint is not None:
        raise APIError(
            400,
            "tool_choice: cannot force a tool call and a response format at once",
            "tool_choice",
        )
    if ctx.args.tool_call_parser is None or ctx.glm_tokens is None:
        raise APIError(
            400,
            "tool_choice: forcing a tool call needs --tool-call-parser glm47 and GLM's markup "
            "tokens in the tokenizer",
            "tool_choice",
        )
    return forced_tool_calls(
        tools, forced or None, body.parallel_tool_calls, ctx.glm_tokens, opens_reasoning
    )


def _constrain(
    ctx: FrontContext, samplings: list[SamplingParams], constraint: Constraint | None
) -> None:
    """Put the output constraint on each prompt's sampling parameters; 400 if it does not
    compile."""
    if constraint is None:
        return
    for sampling in samplings:
        setattr(sampling, constraint.field, constraint.text)
    ctx.check_constraint(samplings[0])


def _bootstrap(body: SamplingRequest) -> dict[str, Any]:
    return {
        "bootstrap_host": body.bootstrap_host,
        "bootstrap_port": body.bootstrap_port,
        "bootstrap_room": body.bootstrap_room,
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
    return prompts


def _echo(ctx: FrontContext, body: CompletionRequest, seq: Seq) -> str:
    if not body.echo:
        return ""
    return ctx.tokenizer.decode(seq.request.input_ids, skip_special_tokens=False)


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

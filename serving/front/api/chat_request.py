"""A chat request made ready to run, for POST /v1/chat/completions and the Responses API:
checked, rendered with its tools, tokenized and constrained; and the reasoning tokens of a
reply, which both report."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from serving.front.api.context import FrontContext
from serving.front.api.errors import APIError
from serving.front.api.image_request import attach_images, chat_image_sources, load_images
from serving.front.api.openai_protocol import ChatCompletionRequest, ContentPart, NamedToolChoice
from serving.front.api.openai_request import bootstrap_fields, check_common, constrain
from serving.front.api.reasoning import prompt_opens_reasoning
from serving.front.api.sampling import check_top_logprobs, request_sampling
from serving.front.api.sequences import Seq, make_seqs
from serving.front.api.structured_output import (
    Constraint,
    after_reasoning,
    forced_tool_calls,
    requested_constraint,
)


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
    check_common(ctx, body)
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
    images = await load_images(ctx.vision, chat_image_sources(body.messages), "messages")
    prompt = ctx.chat_template.render(
        [m.model_dump(exclude_none=True) for m in body.messages],
        tools=tools,
        add_generation_prompt=not body.continue_final_message,
        continue_final_message=body.continue_final_message,
        **(body.chat_template_kwargs or {}),
    )
    ids = await ctx.encode_checked(prompt, False, ready.context_length, "messages")
    ids, image_inputs = attach_images(ctx.vision, ids, images, "messages")
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
    constrain(ctx, [sampling], _chat_constraint(ctx, body, tools, forced, reasoning, opens))
    rid = body.rid or f"chatcmpl-{uuid.uuid4().hex}"
    seqs = make_seqs(
        ctx.tokenizer,
        rid,
        [ids],
        [sampling],
        body.n,
        return_logprob=body.logprobs,
        top_logprobs_num=top,
        images=[image_inputs],  # one list per prompt
        **bootstrap_fields(body),
    )
    return ChatRun(seqs, rid, reasoning, opens, parsed_tools)


def reasoning_token_count(ctx: FrontContext, seq: Seq, reasoned: bool) -> int:
    """Output tokens before `</think>` (all of them when the reply never left the reasoning)."""
    if not reasoned:
        return 0
    end = ctx.glm_tokens.think_end if ctx.glm_tokens is not None else None
    ids = seq.output_ids
    return ids.index(end) if end in ids else len(ids)


def _content_chars(content: str | list[ContentPart] | None) -> int:
    if isinstance(content, str):
        return len(content)
    return sum(len(part.text or "") for part in content or ())


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

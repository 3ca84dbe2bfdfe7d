"""Request bodies of /v1/chat/completions and /v1/completions (OpenAI names, SGLang extras)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class OpenBody(BaseModel):
    """Unknown fields are accepted and ignored, as OpenAI-compatible servers do."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far on every chunk too


class JsonSchemaFormat(OpenBody):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenBody):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(OpenBody):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(OpenBody):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(OpenBody):
    name: str


class NamedToolChoice(OpenBody):
    type: Literal["function"] = "function"
    function: FunctionName


class ImageURL(OpenBody):
    url: str
    detail: str | None = None  # accepted; every image is processed at its own size


class ContentPart(OpenBody):
    type: str
    text: str | None = None
    image_url: ImageURL | str | None = None


class ChatMessage(OpenBody):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class SamplingRequest(OpenBody):
    """Fields chat and text completions share."""

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None
    rid: str | None = None
    return_hidden_states: bool = False
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    json_schema: str | None = None

"""POST /v1/responses (OpenAI's Responses API): the request body and its chat translation.

A response is one chat completion: `instructions` become the system message, `input` items
become messages (function_call items the assistant's tool calls, function_call_output items
tool messages, reasoning items the next assistant message's reasoning_content), and the
function tools, tool_choice and text.format map onto their chat names. Nothing is stored, so
previous_response_id is refused.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from serving.front.api.errors import APIError, describe_validation_errors
from serving.front.api.openai_protocol import ChatCompletionRequest, OpenBody

_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(OpenBody):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None


# SGLang extras and the PD triple pass through to the chat request as they are.
_PASSED = (
    *("seed", "top_k", "min_p", "stop", "stop_regex", "chat_template_kwargs", "rid"),
    *("ignore_eos", "logit_bias", "bootstrap_host", "bootstrap_port", "bootstrap_room"),
)


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion this response is; APIError 400 for what does not map."""
    if body.previous_response_id is not None:
        raise APIError(
            400,
            "previous_response_id: this server stores no responses; send the whole input",
            "previous_response_id",
        )
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    messages += _messages(body.input)
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "parallel_tool_calls": body.parallel_tool_calls,
        "user": body.user,
    }
    if body.tools:
        fields["tools"] = [_chat_tool(t) for t in body.tools]
    # "auto" and "none" without tools ask for nothing: the Responses API sends "auto" by
    # default (SGLang's tests do), where a chat completion would refuse a choice without tools.
    if body.tool_choice is not None and (body.tools or body.tool_choice not in ("auto", "none")):
        fields["tool_choice"] = _chat_tool_choice(body.tool_choice)
    if body.text and body.text.get("format"):
        fields["response_format"] = _response_format(body.text["format"])
    extra = body.model_extra or {}
    fields.update({k: extra[k] for k in _PASSED if k in extra})
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in fields.items() if v is not None}
        )
    except ValidationError as e:
        message, param = describe_validation_errors(e.errors())
        raise APIError(400, message, param) from e


def _messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    reasoning = ""  # a reasoning item's text, for the assistant message after it
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item.get("role") == "developer" else item.get("role")
            message = {"role": role, "content": _text(item.get("content"), i)}
            if role == "assistant" and reasoning:
                message["reasoning_content"], reasoning = reasoning, ""
            out.append(message)
        elif kind == "function_call":
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant" or last["content"]:
                last = {"role": "assistant", "content": ""}
                out.append(last)
            if reasoning:
                last["reasoning_content"], reasoning = reasoning, ""
            call = {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}
            last.setdefault("tool_calls", []).append(
                {"id": item.get("call_id"), "type": "function", "function": call}
            )
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text(output, i)
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning += "".join(p.get("text") or "" for p in parts if isinstance(p, dict))
        else:
            raise APIError(400, f"input.{i}: items of type {kind!r} are not supported", "input")
    return out


def _text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"input.{i}.content: must be a string or a list of parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise APIError(
                400, f"input.{i}.content: parts of type {kind!r} are not supported", "input"
            )
        texts.append(part.get("text") or "")
    return "".join(texts)


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise APIError(400, f"tools: only function tools are served, not {tool.get('type')!r}")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, "tool_choice: a mode or {type: function, name}", "tool_choice")


def _response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    kind = fmt.get("type")
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": kind}

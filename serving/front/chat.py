"""Chat template loading and rendering, with transformers' apply_chat_template conventions."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from serving.server_args import ArgsError

TEMPLATE_FILE = "chat_template.jinja"
_RESERVED_VARIABLES = ("messages", "tools", "add_generation_prompt")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered; the message says why (becomes an HTTP 400)."""


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.filters["fromjson"] = json.loads
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(source)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text. `continue_final_message` ends it inside the last message instead of
        opening a new assistant turn (the client prefills the reply)."""
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "continue_final_message and add_generation_prompt cannot both be true"
            )
        for name in _RESERVED_VARIABLES:
            if name in template_kwargs:
                raise ChatTemplateError(f"chat_template_kwargs: {name!r} cannot be overridden")
        prepared = prepare_messages(messages)
        try:
            text = self._template.render(
                **template_kwargs,
                messages=prepared,
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template: {e}") from e
        if continue_final_message:
            text = _cut_after_final_message(text, prepared)
        return text


def prepare_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copies of the messages: content parts checked (text, and image_url, which becomes
    {"type": "image"}: GLM's template renders that as its image placeholder; the route has
    loaded the image or refused it, a text-only model included), tool-call arguments given as
    JSON strings decoded to mappings."""
    out = []
    for i, message in enumerate(messages):
        m = dict(message)
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                if kind == "image_url":  # loaded by the route (front/api/image_request.py)
                    parts.append({"type": "image"})
                    continue
                if kind != "text":
                    raise ChatTemplateError(
                        f"messages[{i}].content[{j}]: content type {kind!r} is not supported "
                        "(text and image_url only)"
                    )
                parts.append(part)
            m["content"] = parts
        if m.get("tool_calls"):
            m["tool_calls"] = [
                _decode_tool_call(tc, f"messages[{i}].tool_calls[{j}]")
                for j, tc in enumerate(m["tool_calls"])
            ]
        out.append(m)
    return out


def _decode_tool_call(tool_call: Mapping[str, Any], where: str) -> dict[str, Any]:
    call = dict(tool_call)
    function = call.get("function")
    if not isinstance(function, Mapping):
        raise ChatTemplateError(f"{where}.function: must be an object with name and arguments")
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ChatTemplateError(f"{where}.function.arguments: not valid JSON ({e})") from e
    if args is not None and not isinstance(args, Mapping):
        raise ChatTemplateError(f"{where}.function.arguments: must be a JSON object")
    call["function"] = {**function, "arguments": args or {}}
    return call


def _cut_after_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    if not messages:
        raise ChatTemplateError("continue_final_message: there is no final message")
    final = _visible_text(messages[-1].get("content")).strip()
    end = text.rfind(final)
    if not final or end == -1:
        raise ChatTemplateError(
            "continue_final_message: the final message's text does not appear in the prompt"
        )
    return text[: end + len(final)]


def _visible_text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, Mapping))
    return content if isinstance(content, str) else ""


def read_chat_template(
    model_path: str | Path, tokenizer_path: str | Path | None = None, override: str | None = None
) -> str | None:
    """The template source: `override` (a file), else chat_template.jinja next to the model or
    tokenizer, else tokenizer_config.json's chat_template; None if there is none."""
    if override is not None:
        path = Path(override)
        if not path.is_file():
            raise ArgsError(f"--chat-template {override}: no such file")
        return path.read_text(encoding="utf-8")
    dirs = list(dict.fromkeys(Path(p) for p in (model_path, tokenizer_path) if p is not None))
    for d in dirs:
        if (d / TEMPLATE_FILE).is_file():
            return (d / TEMPLATE_FILE).read_text(encoding="utf-8")
    for d in reversed(dirs):
        config_path = d / "tokenizer_config.json"
        if not config_path.is_file():
            continue
        template = json.loads(config_path.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}], transformers' form
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        if isinstance(template, str):
            return template
    return None


def load_chat_template(
    model_path: str | Path, tokenizer_path: str | Path | None = None, override: str | None = None
) -> ChatTemplate | None:
    source = read_chat_template(model_path, tokenizer_path, override)
    return None if source is None else ChatTemplate(source)

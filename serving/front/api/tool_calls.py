"""GLM-4.7 / GLM-5 tool calls (`--tool-call-parser glm47`), parsed as the text streams in.

    <tool_call>NAME<arg_key>K1</arg_key><arg_value>V1</arg_value>...</tool_call>

Several calls may follow each other; text around them is content. A value is raw text: it
stays a string for a "string" parameter and is typed by the parameter's JSON schema otherwise
(tool_schema.typed_value). Calls come out as OpenAI `tool_calls` delta entries. Streaming, a
call's entry is sent once its name is known (id, type, name, arguments ""), then its arguments
JSON in fragments: `{"k": ` when a value opens, a string value's text as it arrives, other
values when they close, `}` at the end. The fragments of a call concatenate to its arguments
JSON.

Markup that breaks the grammar (an unknown function name, text where a tag belongs, a tag out
of place) and a call the output ends inside are text. Without streaming (`stream=False`) that
is the whole call's markup. Streaming, a call is sent as soon as its name is known, so a call
that breaks later keeps what it has so far and only the markup after that is text; either way
the result does not depend on how the text was split into pieces.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from serving.front.api.tool_schema import function_schemas, schema_types, typed_value
from serving.front.detokenizer import partial_stop_len

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
KEY_START, KEY_END = "<arg_key>", "</arg_key>"
VALUE_START, VALUE_END = "<arg_value>", "</arg_value>"
MARKUP = (CALL_START, CALL_END, KEY_START, KEY_END, VALUE_START, VALUE_END)

# Where the parser is: outside calls, then inside one call.
TEXT, NAME, KEY, AFTER_KEY, VALUE, AFTER_VALUE = range(6)


@dataclass
class _Call:
    raw: str  # the call's markup so far
    name: str = ""
    key: str = ""
    value: str = ""
    string_value: bool = False
    args: int = 0
    entry: dict[str, Any] | None = None  # the delta entry, once the name is known
    arguments: str = ""  # arguments JSON not yet handed out
    unsent: str = ""  # markup after the last piece of the entry or its arguments


@dataclass
class ToolCallOutput:
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


# (state, marker) -> next state; any other marker inside a call breaks it.
_TRANSITIONS = {
    (NAME, KEY_START): KEY,
    (NAME, CALL_END): TEXT,
    (KEY, KEY_END): AFTER_KEY,
    (AFTER_KEY, VALUE_START): VALUE,
    (VALUE, VALUE_END): AFTER_VALUE,
    (AFTER_VALUE, KEY_START): KEY,
    (AFTER_VALUE, CALL_END): TEXT,
}


class ToolCallParser:
    """Feed it the assistant's text (after reasoning); it returns content and call deltas."""

    def __init__(self, tools: Sequence[Mapping[str, Any]], stream: bool) -> None:
        self._functions = function_schemas(tools)
        self._stream = stream
        self._pending = ""
        self._state = TEXT
        self._call: _Call | None = None
        self.count = 0  # calls handed out; their indices are 0 .. count-1

    def feed(self, text: str, final: bool = False) -> ToolCallOutput:
        out = ToolCallOutput()
        self._pending += text
        while self._pending:
            markers = (CALL_START,) if self._state == TEXT else MARKUP
            at, marker = _first_marker(self._pending, markers)
            if marker is None:
                keep = 0 if final else partial_stop_len(self._pending, markers)
                piece = self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(piece) :]
                self._text(piece, out)
                break
            self._text(self._pending[:at], out)
            self._pending = self._pending[at + len(marker) :]
            self._marker(marker, out)
        if final and self._call is not None:
            self._break(out)
        if self._stream and self._call is not None and self._call.entry is not None:
            self._hand_out(out)
        return out

    def _text(self, text: str, out: ToolCallOutput) -> None:
        call = self._call
        if not text or call is None:
            out.content += text
            return
        call.raw += text
        call.unsent += text
        if self._state == NAME:
            call.name += text
        elif self._state == KEY:
            call.key += text
        elif self._state == VALUE:
            if call.string_value:
                self._arguments(json.dumps(text, ensure_ascii=False)[1:-1])
            else:
                call.value += text
        elif text.strip():  # between tags only whitespace may stand
            self._break(out)

    def _marker(self, marker: str, out: ToolCallOutput) -> None:
        call = self._call
        if call is None:  # the only marker looked for outside calls: CALL_START
            self._call = _Call(raw=marker, unsent=marker)
            self._state = NAME
            return
        state = _TRANSITIONS.get((self._state, marker))
        if (
            state is None
            or (self._state == NAME and call.name.strip() not in self._functions)
            or (self._state == KEY and not call.key.strip())
        ):
            self._break(out)
            if marker == CALL_START:
                self._marker(marker, out)
            else:
                out.content += marker
            return
        if self._state == NAME:
            self._open(call)
        call.raw += marker
        call.unsent += marker
        if marker == KEY_START:
            call.key = ""
        elif marker == VALUE_START:
            call.string_value = schema_types(self._schema(call)) == {"string"}
            call.value = ""
            opening = "{" if call.args == 0 else ", "
            key = json.dumps(call.key.strip(), ensure_ascii=False)
            self._arguments(f"{opening}{key}: " + ('"' if call.string_value else ""))
            call.args += 1
        elif marker == VALUE_END:
            value = '"' if call.string_value else None
            if value is None:
                value = json.dumps(typed_value(call.value, self._schema(call)), ensure_ascii=False)
            self._arguments(value)
        elif marker == CALL_END:
            self._arguments("}" if call.args else "{}")
            self._hand_out(out)
            self._call = None
        self._state = state

    def _schema(self, call: _Call) -> dict[str, Any] | None:
        """The JSON schema of the parameter being written (None: not in the tool's schema)."""
        properties = self._functions[call.entry["function"]["name"]].get("properties") or {}
        return properties.get(call.key.strip())

    def _open(self, call: _Call) -> None:
        """The name is complete and names a tool: the call has an entry from here on."""
        call.entry = {
            "index": -1,
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call.name.strip(), "arguments": ""},
        }
        call.unsent = ""

    def _arguments(self, fragment: str) -> None:
        self._call.arguments += fragment
        self._call.unsent = ""

    def _hand_out(self, out: ToolCallOutput) -> None:
        """The call's entry (the first time) or its new argument fragments, into `out`."""
        call = self._call
        if call.entry["index"] == -1:
            call.entry["index"] = self.count
            self.count += 1
            entry = {**call.entry, "function": {**call.entry["function"]}}
        else:
            entry = {"index": call.entry["index"], "function": {}}
        entry["function"]["arguments"] = call.arguments
        call.arguments = ""
        if "id" in entry or entry["function"]["arguments"]:
            out.tool_calls.append(entry)

    def _break(self, out: ToolCallOutput) -> None:
        """The markup stops being a call. Streaming, a call with a known name is kept with what
        it has so far and the markup after that is text; otherwise all of its markup is."""
        call = self._call
        if self._stream and call.entry is not None:
            self._hand_out(out)
            out.content += call.unsent
        else:
            out.content += call.raw
        self._call = None
        self._state = TEXT


def _first_marker(text: str, markers: Sequence[str]) -> tuple[int, str | None]:
    best, found = len(text), None
    for marker in markers:
        at = text.find(marker)
        if at != -1 and at < best:
            best, found = at, marker
    return best, found


def merge_tool_call_deltas(deltas: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Delta entries folded into whole calls (id, type, function: name, arguments)."""
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        call = calls.setdefault(
            delta["index"], {"id": None, "type": "function", "function": {"arguments": ""}}
        )
        call["id"] = delta.get("id") or call["id"]
        function = delta.get("function") or {}
        if function.get("name"):
            call["function"]["name"] = function["name"]
        call["function"]["arguments"] += function.get("arguments") or ""
    return [calls[i] for i in sorted(calls)]

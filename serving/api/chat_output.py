"""An assistant reply split into reasoning, content and tool calls as its text streams in.

GLM's formats: reasoning ends at `</think>` (the generation prompt already opened `<think>`
unless thinking is off); a tool call is
`<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`, V raw for string
parameters and JSON otherwise.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from serving.detokenizer import partial_stop_len

THINK_START, THINK_END = "<think>", "</think>"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class ChatOutputParser:
    """Feed it a sequence's visible text; it returns what each piece turned out to be.

    `reasoning`: parse `</think>`; `starts_in_reasoning`: the prompt ends inside `<think>`.
    `tools`: parse tool calls against these schemas (None: tool-call markup is content).
    Text that could still be the start of a marker is held until it is decided.
    """

    def __init__(
        self,
        reasoning: bool,
        starts_in_reasoning: bool,
        tools: Sequence[Mapping[str, Any]] | None,
    ) -> None:
        self._mode = ("reasoning" if starts_in_reasoning else "start") if reasoning else "content"
        self._schemas = {
            (t.get("function") or t).get("name"): (t.get("function") or t).get("parameters") or {}
            for t in tools or ()
        }
        self._parse_tools = tools is not None
        self._pending = ""
        self.tool_call_count = 0

    def feed(self, text: str, final: bool = False) -> ChatDelta:
        delta = ChatDelta()
        self._pending += text
        while self._pending:
            if self._mode == "start":
                if self._pending.startswith(THINK_START):
                    self._pending = self._pending[len(THINK_START) :]
                    self._mode = "reasoning"
                elif THINK_START.startswith(self._pending) and not final:
                    break
                else:
                    self._mode = "content"
            elif self._mode == "reasoning":
                end = self._pending.find(THINK_END)
                if end != -1:
                    delta.reasoning += self._pending[:end]
                    self._pending = self._pending[end + len(THINK_END) :]
                    self._mode = "content"
                    continue
                delta.reasoning += self._take_undecided(THINK_END, final)
                break
            elif not self._parse_tools:
                delta.content += self._pending
                self._pending = ""
            else:
                start = self._pending.find(CALL_START)
                if start == -1:
                    delta.content += self._take_undecided(CALL_START, final)
                    break
                delta.content += self._pending[:start]
                self._pending = self._pending[start:]
                end = self._pending.find(CALL_END)
                if end == -1:
                    if final:  # an unfinished call stays visible as text
                        delta.content += self._pending
                        self._pending = ""
                    break
                body = self._pending[len(CALL_START) : end]
                self._pending = self._pending[end + len(CALL_END) :]
                delta.tool_calls.append(self._tool_call(body))
        return delta

    def _take_undecided(self, marker: str, final: bool) -> str:
        """The pending text except a tail that may still become `marker`."""
        cut = len(self._pending) - (0 if final else partial_stop_len(self._pending, [marker]))
        out = self._pending[:cut]
        self._pending = self._pending[cut:]
        return out

    def _tool_call(self, body: str) -> dict[str, Any]:
        name = body.split("<arg_key>", 1)[0].strip()
        properties = self._schemas.get(name, {}).get("properties") or {}
        arguments = {
            key.strip(): _argument_value(value, (properties.get(key.strip()) or {}).get("type"))
            for key, value in _ARG.findall(body)
        }
        call = {
            "index": self.tool_call_count,
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
        }
        self.tool_call_count += 1
        return call


def _argument_value(raw: str, schema_type: Any) -> Any:
    if schema_type == "string":
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def prompt_opens_reasoning(prompt: str) -> bool:
    """The prompt ends inside a `<think>` block: the reply starts with reasoning."""
    return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)

"""An assistant reply split into reasoning, content and tool calls as its text streams in.

The same parser serves streaming (`feed` piece by piece) and whole replies (`parse_reply`):
the text of a reply is the reasoning parser's answer, then the tool-call parser's content.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from serving.front.api.reasoning import ReasoningParser
from serving.front.api.tool_calls import ToolCallParser, merge_tool_call_deltas


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI delta entries


class ChatOutputParser:
    """`reasoning`: split off the reasoning (glm45); `starts_in_reasoning`: the prompt left the
    model inside `<think>`. `tools`: parse tool calls against these tools (glm47); None: tool
    markup is content. `stream`: see serving/front/api/tool_calls.py for what differs."""

    def __init__(
        self,
        reasoning: bool,
        starts_in_reasoning: bool,
        tools: Sequence[Mapping[str, Any]] | None,
        stream: bool = True,
    ) -> None:
        self._reasoning = ReasoningParser(starts_in_reasoning) if reasoning else None
        self._tools = ToolCallParser(tools, stream) if tools is not None else None

    @property
    def tool_call_count(self) -> int:
        return self._tools.count if self._tools is not None else 0

    @property
    def reasoned(self) -> bool:
        return self._reasoning is not None and self._reasoning.reasoned

    def feed(self, text: str, final: bool = False) -> ChatDelta:
        delta = ChatDelta()
        if self._reasoning is not None:
            delta.reasoning, text = self._reasoning.feed(text, final)
        if self._tools is None:
            delta.content = text
            return delta
        parsed = self._tools.feed(text, final)
        delta.content, delta.tool_calls = parsed.content, parsed.tool_calls
        return delta


@dataclass
class Reply:
    reasoning: str
    content: str
    tool_calls: list[dict[str, Any]]  # whole calls: id, type, function {name, arguments}
    reasoned: bool


def parse_reply(
    text: str,
    reasoning: bool,
    starts_in_reasoning: bool,
    tools: Sequence[Mapping[str, Any]] | None,
) -> Reply:
    parser = ChatOutputParser(reasoning, starts_in_reasoning, tools, stream=False)
    delta = parser.feed(text, final=True)
    calls = merge_tool_call_deltas(delta.tool_calls)
    return Reply(delta.reasoning, delta.content, calls, parser.reasoned)

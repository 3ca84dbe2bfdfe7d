"""GLM reasoning (`--reasoning-parser glm45`): `<think>reasoning</think>answer`, as it streams.

The chat template usually opens `<think>` itself (thinking on), so the reply starts inside the
reasoning; with `enable_thinking: false` it closes it, and the reply is the answer unless the
model opens a `<think>` of its own first. A `<think>` the model repeats at the very start is
dropped. A reply that ends inside the reasoning is all reasoning (as SGLang's glm45).
"""

from __future__ import annotations

from serving.front.detokenizer import partial_stop_len

THINK_START, THINK_END = "<think>", "</think>"

START, REASONING, ANSWER = range(3)


def prompt_opens_reasoning(prompt: str) -> bool:
    """The prompt ends inside a `<think>` block: the reply starts with reasoning."""
    return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)


class ReasoningParser:
    def __init__(self, starts_in_reasoning: bool) -> None:
        self._starts_in_reasoning = starts_in_reasoning
        self._state = START
        self._pending = ""
        self.reasoned = False  # some of the reply was reasoning

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, answer) decided by this piece; text that may still be a marker waits."""
        reasoning = answer = ""
        self._pending += text
        if self._state == START:
            head = self._pending.lstrip()
            if head.startswith(THINK_START):
                self._pending = head[len(THINK_START) :]
                self._state = REASONING
            elif THINK_START.startswith(head) and not final:
                return "", ""
            else:
                self._state = REASONING if self._starts_in_reasoning else ANSWER
        if self._state == REASONING:
            end = self._pending.find(THINK_END)
            if end != -1:
                reasoning = self._pending[:end]
                self._pending = self._pending[end + len(THINK_END) :]
                self._state = ANSWER
            else:
                keep = 0 if final else partial_stop_len(self._pending, [THINK_END])
                reasoning = self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(reasoning) :]
            self.reasoned = self.reasoned or self._state == ANSWER or bool(reasoning)
        if self._state == ANSWER:
            answer, self._pending = self._pending, ""
        return reasoning, answer

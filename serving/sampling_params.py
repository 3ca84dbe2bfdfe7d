"""SamplingParams: how a sequence is sampled and when it stops, as the scheduler receives it
(the front maps OpenAI's and SGLang's request bodies onto it: serving/front/api/sampling.py),
and its validation against the model's vocabulary (SamplingError: a 400 naming the field)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field


class SamplingError(ValueError):
    """An invalid sampling parameter; the message names it (becomes an HTTP 400)."""


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # SGLang's stop_regex: stop once the output text so far has a match (Python `re`); the
    # finish reason's "matched" is the pattern, and the match stays in the text (as SGLang).
    stop_regex: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_new_tokens: int = 0
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    # token id -> added to its logit after penalties (OpenAI's logit_bias, keys made ints);
    # -100 / 100 forbid / force in practice, as OpenAI documents.
    logit_bias: dict[int, float] = field(default_factory=dict)
    # At most one output constraint (serving/executor/constrained.py): a JSON schema, a regex, or a
    # grammar in GBNF or llguidance's Lark dialect.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @property
    def is_greedy(self) -> bool:
        # Temperatures this small overflow the logits; vLLM draws the same line.
        return self.temperature < 1e-5 or self.top_k == 1

    def validate(self, vocab_size: int) -> None:
        def bad(name: str, why: str) -> SamplingError:
            return SamplingError(f"{name}: {why}")

        if self.max_new_tokens < 0:
            raise bad("max_tokens", f"must be >= 0, got {self.max_new_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise bad("top_k", f"must be -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}")
        if self.min_new_tokens < 0 or self.min_new_tokens > max(self.max_new_tokens, 0):
            raise bad("min_tokens", f"must be in [0, max_tokens], got {self.min_new_tokens}")
        for t, bias in self.logit_bias.items():
            if not 0 <= t < vocab_size:
                raise bad("logit_bias", f"token {t} is outside the vocabulary [0, {vocab_size})")
            if not -100.0 <= bias <= 100.0:
                raise bad("logit_bias", f"token {t}: bias must be in [-100, 100], got {bias}")
        for pattern in self.stop_regex:
            try:
                re.compile(pattern)
            except re.error as e:
                raise bad("stop_regex", f"{pattern!r} is not a regular expression: {e}") from None
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise bad("seed", f"must be in [0, 2^63), got {self.seed}")

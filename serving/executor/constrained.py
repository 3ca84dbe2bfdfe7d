"""Grammar-constrained decoding with llguidance: which tokens a sequence may sample next.

A request carries at most one constraint in its SamplingParams (`json_schema`, `regex`, or
`ebnf`: GBNF or llguidance's Lark dialect). The sampler gives each constrained sequence a
SequenceGrammar, masks its logits with `allowed()` before sampling and `advance()`s it with the
sampled token; the scheduler finishes the sequence once `finish_reason()` says so. The front
uses `grammar_of` and `check_grammar` to refuse a bad constraint before it is queued.

No torch here: the front imports this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

from serving.protocol import FinishReason
from serving.sampling_params import SamplingParams

if TYPE_CHECKING:
    import llguidance

CONSTRAINT_FIELDS = ("json_schema", "regex", "ebnf")
# Whitespace between JSON tokens: none, one space, or one newline plus at most 16 spaces of
# indent. That admits compact JSON, json.dumps' ", " and ": " (how GLM writes tool arguments:
# a grammar that forbids that spacing pushes a forced call off the model's own distribution)
# and pretty-printing up to 8 levels of 2-space indent, while every gap stays bounded, so a
# model cannot pad whitespace forever (llguidance's flexible default, [ \t\n\r]+, would let
# it). Lenient: keywords llguidance does not implement (e.g. "format") are ignored, not refused.
JSON_WHITESPACE = "(?:[ ]|\n[ ]{0,16})?"
JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE, "lenient": True}


def _llguidance():
    """Imported on first use: servers that never see a constraint do not need the library."""
    import llguidance

    return llguidance


class GrammarError(ValueError):
    """A constraint that cannot be compiled; the message names the field (an HTTP 400)."""


def has_constraint(params: SamplingParams) -> bool:
    return any(getattr(params, name) is not None for name in CONSTRAINT_FIELDS)


def grammar_of(params: SamplingParams) -> str | None:
    """The llguidance grammar of the request's constraint; None without one."""
    given = [(name, getattr(params, name)) for name in CONSTRAINT_FIELDS]
    given = [(name, text) for name, text in given if text is not None]
    if not given:
        return None
    if len(given) > 1:
        raise GrammarError(f"{given[0][0]}: cannot be combined with {given[1][0]}")
    name, text = given[0]
    try:
        if name == "json_schema":
            return _llguidance().LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        if name == "regex":
            return _llguidance().LLMatcher.grammar_from_regex(text)
        return _llguidance().grammar_from("ebnf", text)
    except ValueError as e:
        raise GrammarError(f"{name}: {e}") from e


@lru_cache(maxsize=4)
def load_tokenizer(
    tokenizer_file: str, eos_token_ids: tuple[int, ...], vocab_size: int | None = None
) -> llguidance.LLTokenizer:
    """The grammar engine's view of tokenizer.json (about a second for a 150k vocabulary)."""
    with open(tokenizer_file, encoding="utf-8") as f:
        return _llguidance().LLTokenizer(
            f.read(), n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )


def check_grammar(grammar: str, tokenizer: llguidance.LLTokenizer, name: str) -> None:
    error = _llguidance().LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise GrammarError(f"{name}: {error}")


class SequenceGrammar:
    """One sequence's matcher. `consumed` counts the output tokens it has seen, so tokens that
    reached the sequence without the sampler (a PD decode worker's first token) are caught up."""

    def __init__(self, matcher: llguidance.LLMatcher | None, error: str | None = None) -> None:
        self._matcher = matcher
        self._error = error
        self.consumed = 0

    @classmethod
    def compile(
        cls, tokenizer: llguidance.LLTokenizer | None, params: SamplingParams
    ) -> SequenceGrammar:
        if tokenizer is None:
            return cls(None, "constrained decoding is not set up in the scheduler (no tokenizer)")
        try:
            grammar = grammar_of(params)
        except GrammarError as e:
            return cls(None, str(e))
        matcher = _llguidance().LLMatcher(tokenizer, grammar, log_level=0)
        return cls(matcher, matcher.get_error() or None)

    def catch_up(self, output_ids: Sequence[int]) -> None:
        for token in output_ids[self.consumed :]:
            self.advance(token)

    def allowed(self) -> bytes | None:
        """The tokens the grammar accepts next, one bit per token id (little-endian within each
        byte); None once the grammar has failed."""
        if self._error is not None or self._matcher.is_error():
            return None
        return self._matcher.compute_bitmask()

    def advance(self, token: int) -> None:
        self.consumed += 1
        if self._matcher is not None:
            self._matcher.consume_token(token)

    def finish_reason(self) -> FinishReason | None:
        """Stop once the grammar is complete; abort (the request failed) if it broke."""
        if self._error is not None:
            return FinishReason.abort(self._error, 400)
        if self._matcher.is_error():
            message = f"grammar: {self._matcher.get_error()}"
            return FinishReason.abort(message, 500)
        if self._matcher.is_stopped():
            return FinishReason.stop()
        return None

"""A sequence's sampling state: its parameters, its tokens so far and, constrained, its
grammar. The scheduler's request object owns it; the sampler reads it and advances the
grammar."""

from __future__ import annotations

from dataclasses import dataclass

from serving.executor.constrained import SequenceGrammar
from serving.protocol import FinishReason
from serving.sampling_params import SamplingParams


@dataclass
class SamplingState:
    """Per-sequence sampling state owned by the scheduler's request object."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]  # tokens generated so far (the scheduler appends after sample())
    eos_token_ids: frozenset[int]
    grammar: SequenceGrammar | None = None  # the sampler's, for a constrained request

    def grammar_finish_reason(self) -> FinishReason | None:
        """Why the output constraint ends the sequence now (None: it does not)."""
        return self.grammar.finish_reason() if self.grammar is not None else None

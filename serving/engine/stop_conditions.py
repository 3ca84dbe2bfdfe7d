"""When a request stops: after each sampled token, in this order, the first that holds.

stop_token_ids, or EOS unless ignore_eos      -> stop (the token)
a stop string in the detokenized tail         -> stop (the string); the front trims it
a stop_regex match anywhere in the output     -> stop (the pattern)
the grammar is complete                       -> stop
max_new_tokens reached, or the context full   -> length
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from serving.engine.request import Req
from serving.protocol import FinishReason

# How many characters of tail past the longest stop string are detokenized: a stop string may
# end inside the newest token's text, and a token is rarely longer than this.
STOP_TAIL_SLACK = 8


@dataclass(frozen=True)
class StopConditions:
    eos_token_ids: frozenset[int]
    context_length: int
    detokenize: Callable[[list[int]], str] | None = None  # None: no stop strings or regexes

    def reason(self, req: Req, tok: int) -> FinishReason | None:
        """Why `req` stops after its newest token `tok` (already appended), or None."""
        p = req.sampling.params
        if tok in p.stop_token_ids or (tok in self.eos_token_ids and not p.ignore_eos):
            return FinishReason.stop(tok)
        if p.stop and self.detokenize is not None:
            window = max(len(s) for s in p.stop) + STOP_TAIL_SLACK
            tail = self.detokenize(req.output_ids[-window:])
            for s in p.stop:
                if s in tail:
                    return FinishReason.stop(s)
        if p.stop_regex and self.detokenize is not None:
            # The whole output: a match may span any number of tokens. `re` caches the patterns.
            text = self.detokenize(req.output_ids)
            for pattern in p.stop_regex:
                if re.search(pattern, text):
                    return FinishReason.stop(pattern)
        if (grammar_reason := req.sampling.grammar_finish_reason()) is not None:
            return grammar_reason
        if self.ends_by_length(req, 0):
            return FinishReason.length()
        return None

    def ends_by_length(self, req: Req, more: int) -> bool:
        """Whether req reaches max_new_tokens or the context with `more` tokens beyond those
        appended (the overlap scheduler: a pending token that will certainly end it)."""
        p = req.sampling.params
        return (
            len(req.output_ids) + more >= p.max_new_tokens
            or len(req.fill_ids) + more >= self.context_length
        )

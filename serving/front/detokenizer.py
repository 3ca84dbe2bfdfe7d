"""Incremental detokenization and stop-string handling for streamed sequences."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from serving.protocol import FinishReason

REPLACEMENT_CHAR = "\ufffd"  # what a character cut off at the end decodes to


class IncrementalDetokenizer:
    """Turns a growing token sequence into text that only ever grows.

    tokenizers' DecodeStream does the work (2.1 -> 0.9 us per token against the window-decode
    this replaced, docs/notebook/2026-11-29_2026-12-03.md, "Incremental detokenization"): it
    returns a token's text once the bytes so far form whole characters, so a multi-byte
    character split across tokens is held back until a later token completes it. `flush`
    releases what is still held (as U+FFFD) when the sequence ends.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._held: list[int] = []  # tokens since the stream last returned text
        self.token_ids: list[int] = []
        self.text = ""

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they completed."""
        start = len(self.text)
        for token_id in token_ids:
            self.token_ids.append(token_id)
            piece = self._stream.step(self._tokenizer, token_id)
            if piece:
                self.text += piece
                self._held.clear()
            else:
                self._held.append(token_id)
        return self.text[start:]

    def flush(self) -> str:
        """The held-back tail, U+FFFD included; call once, when the sequence has finished."""
        tail = self._tokenizer.decode(self._held, self._skip_special_tokens) if self._held else ""
        self.text += tail
        self._held.clear()
        self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
        return tail


def partial_stop_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a prefix of (or equal to) a stop string."""
    longest = 0
    for s in stop:
        for k in range(min(len(s), len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


def trim_at_stop(text: str, matched: str, start: int = 0) -> str:
    """`text` cut before the first `matched` at or after `start`; unchanged if there is none."""
    cut = text.find(matched, start)
    return text if cut == -1 else text[:cut]


class StreamingText:
    """A sequence's visible text: detokenized, stop-trimmed, never showing a partial stop string.

    The scheduler detects stop strings and finishes the sequence with
    `FinishReason.stop(<str>)` (or the stop token id). Until then, any suffix that
    could still grow into a stop string is held back, so text once emitted is never retracted:
    the trimmed final text always extends what was emitted.
    """

    def __init__(
        self,
        detokenizer: IncrementalDetokenizer,
        stop: Sequence[str] = (),
        no_stop_trim: bool = False,
    ) -> None:
        self._detokenizer = detokenizer
        self._stop = [s for s in stop if s]
        self._trim = not no_stop_trim
        self.text = ""

    def push(self, token_ids: Sequence[int], finish_reason: FinishReason | None = None) -> str:
        """Feed new tokens (with the finish reason on the last call); return the new text."""
        if finish_reason is None:
            self._detokenizer.add(token_ids)
            full = self._detokenizer.text
            end = len(full) - (partial_stop_len(full, self._stop) if self._trim else 0)
        else:
            matched = finish_reason.matched
            if self._trim and isinstance(matched, int) and token_ids and token_ids[-1] == matched:
                token_ids = token_ids[:-1]
            self._detokenizer.add(token_ids)
            self._detokenizer.flush()
            full = self._detokenizer.text
            # Only a stop string is trimmed: a stop_regex's "matched" is its pattern.
            if self._trim and isinstance(matched, str) and matched in self._stop:
                full = trim_at_stop(full, matched, len(self.text))
            end = len(full)
        delta = full[len(self.text) : end]
        self.text += delta
        return delta

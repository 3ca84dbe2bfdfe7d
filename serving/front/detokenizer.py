"""Incremental detokenization and stop-string handling for streamed sequences."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

from serving.protocol import FinishReason

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing token sequence into text that only ever grows.

    Each token decodes the window `ids[prefix_offset:]` and compares it with the decoding of
    `ids[prefix_offset:read_offset]`; the difference is new text. A window ending in U+FFFD is
    a multi-byte character split across tokens and is held back until a later token completes
    it (or `flush` at the end). The decoder must be prefix-stable, as byte-level BPE is: a
    window decodes the same whether or not earlier tokens precede it.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they completed."""
        start = len(self.text)
        for token_id in token_ids:
            self.token_ids.append(token_id)
            prefix, window = self._windows()
            if len(window) > len(prefix) and not window.endswith(REPLACEMENT_CHAR):
                self.text += window[len(prefix) :]
                self._prefix_offset = self._read_offset
                self._read_offset = len(self.token_ids)
        return self.text[start:]

    def flush(self) -> str:
        """The held-back tail, U+FFFD included; call once, when the sequence has finished."""
        prefix, window = self._windows()
        tail = window[len(prefix) :]
        self.text += tail
        self._prefix_offset = self._read_offset = len(self.token_ids)
        return tail

    def _windows(self) -> tuple[str, str]:
        ids = self.token_ids
        skip = self._skip_special_tokens
        prefix = self._tokenizer.decode(ids[self._prefix_offset : self._read_offset], skip)
        window = self._tokenizer.decode(ids[self._prefix_offset :], skip)
        return prefix, window


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

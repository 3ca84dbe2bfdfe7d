"""Token logprobs in the OpenAI chat, OpenAI completions and SGLang native shapes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer

from serving.protocol import TokenLogprob


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer: Tokenizer, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {
                **entry(lp.token_id, lp.logprob),
                "top_logprobs": [entry(token_id, logprob) for token_id, logprob in lp.top],
            }
            for lp in logprobs
        ]
    }


def completion_logprobs(
    tokenizer: Tokenizer, logprobs: Sequence[TokenLogprob], text_offset: int
) -> dict[str, Any]:
    """`text_offset`: where the first token's text starts in the choice's text. A prompt's first
    token (echo) has no logprob: null, and a null top_logprobs entry, as OpenAI."""
    tokens, offsets = [], []
    for lp in logprobs:
        tokens.append(token_text(tokenizer, lp.token_id))
        offsets.append(text_offset)
        text_offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        # As OpenAI documents: the chosen token is always there, so up to logprobs + 1 entries
        # (logprobs=0 gives the chosen token alone).
        "top_logprobs": [
            {
                **{token_text(tokenizer, token_id): logprob for token_id, logprob in lp.top},
                token_text(tokenizer, lp.token_id): lp.logprob,
            }
            if lp.logprob is not None
            else None
            for lp in logprobs
        ],
        "text_offset": offsets,
    }


def native_logprobs(
    logprobs: Sequence[TokenLogprob], kind: str = "output", tokenizer: Tokenizer | None = None
) -> dict[str, Any]:
    """SGLang's meta_info fields: `kind` "output", or "input" for the scored prompt, whose
    first token (logprob_start_len 0) has a null logprob and null top list. Each entry is
    [logprob, token id, text]; the text is null unless a tokenizer is given
    (return_text_in_logprobs): each token decoded alone, special tokens kept, as SGLang."""

    def entry(token_id: int, logprob: float | None) -> list[Any]:
        text = token_text(tokenizer, token_id) if tokenizer is not None else None
        return [logprob, token_id, text]

    return {
        f"{kind}_token_logprobs": [entry(lp.token_id, lp.logprob) for lp in logprobs],
        f"{kind}_top_logprobs": [
            [entry(token_id, logprob) for token_id, logprob in lp.top]
            if lp.logprob is not None
            else None
            for lp in logprobs
        ],
    }

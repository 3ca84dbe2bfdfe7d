"""The context-length errors, worded so that clients recognise them.

Clients decide that a 400 means "the context window is full" (and trim, summarise or fall back
to a larger model) by matching the error's text or code, so each message carries the phrases
the common ones look for, with the numbers kept:
- SGLang's own wording (its tests match it): "... is longer than the model's context length"
  and "Requested token count exceeds the model's maximum context length of N tokens";
- OpenAI's and vLLM's "This model's maximum context length is N tokens" (LiteLLM maps it, and
  SGLang's first phrase, to ContextWindowExceededError; many agents match "maximum context
  length");
- OpenAI's "Input tokens exceed the configured limit" in the message, or its error code
  "context_length_exceeded" anywhere in the exception's text (langchain-openai). openai-python
  1.x put the whole body in that text, the version here (3.57) only the message, so the code
  is named in the message too, and is the OpenAI-form error's code (errors.error_body);
- SGLang's newer "max_completion_tokens is too large" when max_tokens alone exceeds the context.
"""

from __future__ import annotations

from serving.front.api.errors import APIError

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's error code


def input_too_long(size: str, context_length: int, param: str) -> APIError:
    """The prompt leaves no room for one output token. `size`: how long the input is, e.g.
    "1300 tokens"."""
    return APIError(
        400,
        f"The input ({size}) is longer than the model's context length allows "
        f"({context_length} tokens, at least one of them for the output). This model's maximum "
        f"context length is {context_length} tokens. Input tokens exceed the configured limit "
        f"of {context_length - 1} tokens; please reduce the length of the input messages "
        f"({CONTEXT_LENGTH_EXCEEDED}).",
        param,
        CONTEXT_LENGTH_EXCEEDED,
    )


def request_too_long(prompt_len: int, max_tokens: int, context_length: int) -> APIError:
    """The prompt fits, but not with max_tokens after it."""
    total = prompt_len + max_tokens
    head = (
        f"max_completion_tokens is too large: {max_tokens}. " if max_tokens > context_length else ""
    )
    return APIError(
        400,
        f"{head}Requested token count exceeds the model's maximum context length of "
        f"{context_length} tokens. You requested a total of {total} tokens: {prompt_len} "
        f"tokens from the input messages and {max_tokens} tokens for the completion "
        f"(max_tokens). This model's maximum context length is {context_length} tokens; please "
        "reduce the number of tokens in the input messages or the completion to fit within "
        f"the limit ({CONTEXT_LENGTH_EXCEEDED}).",
        "max_tokens",
        CONTEXT_LENGTH_EXCEEDED,
    )

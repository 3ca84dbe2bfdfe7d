"""SamplingParams from request fields, and the prompt/context-length checks."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from serving.front.api.context_length import input_too_long, request_too_long
from serving.front.api.errors import APIError
from serving.protocol import SamplingParams

MAX_TOP_LOGPROBS = 20
MAX_N = 128  # OpenAI's bound on choices per request


def make_sampling(defaults: Mapping[str, Any], **values: Any) -> SamplingParams:
    """Request values (None = not given) over the model's defaults over SamplingParams'."""
    stop = values.pop("stop", None)
    stop_regex = values.pop("stop_regex", None)
    given = {k: v for k, v in values.items() if v is not None}
    return SamplingParams(
        **{**defaults, **given}, stop=_listed(stop), stop_regex=_listed(stop_regex)
    )


def _listed(value: str | list[str] | None) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])


def token_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as JSON keys) with int keys; 400 on a key that is not one.
    Ids and values are checked against the vocabulary by SamplingParams.validate."""
    if not logit_bias:
        return None
    out = {}
    for key, bias in logit_bias.items():
        try:
            out[int(key)] = float(bias)
        except ValueError:
            raise APIError(
                400, f"logit_bias: keys must be token ids, got {key!r}", "logit_bias"
            ) from None
    return out


def fit_to_context(
    sampling: SamplingParams,
    max_tokens: int | None,
    prompt_len: int,
    context_length: int,
    vocab_size: int,
    default_max_tokens: int | None = None,
    scoring_prompt: bool = False,
    prompt_param: str = "prompt",
) -> None:
    """Set max_new_tokens (given, else the default, else all the room left) and validate.
    max_tokens 0 is refused unless the request scores its prompt (echo with logprobs,
    logprob_start_len): then it means "the prompt's logprobs, no output", as OpenAI's and
    vLLM's evaluation clients use it.

    Raises APIError or SamplingError (both HTTP 400); a prompt too long names `prompt_param`.
    """
    if prompt_len == 0:
        raise APIError(400, "the prompt is empty", "prompt")
    room = context_length - prompt_len
    if room <= 0:
        raise input_too_long(f"{prompt_len} tokens", context_length, prompt_param)
    if max_tokens is not None and max_tokens < (0 if scoring_prompt else 1):
        raise APIError(400, f"max_tokens: must be >= 1, got {max_tokens}", "max_tokens")
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    sampling.max_new_tokens = max_tokens
    sampling.validate(vocab_size)
    if prompt_len + max_tokens > context_length:
        raise request_too_long(prompt_len, max_tokens, context_length)


def check_top_logprobs(value: int, name: str) -> None:
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise APIError(400, f"{name}: must be in [0, {MAX_TOP_LOGPROBS}], got {value}", name)


def check_n(n: int) -> None:
    if not 1 <= n <= MAX_N:
        raise APIError(400, f"n: must be in [1, {MAX_N}], got {n}", "n")


def for_sequence(sampling: SamplingParams, i: int) -> SamplingParams:
    """The i-th of n sequences: a distinct seed when one was given, so samples differ."""
    if sampling.seed is None or i == 0:
        return dataclasses.replace(sampling)
    return dataclasses.replace(sampling, seed=(sampling.seed + i) % 2**63)


def check_prompt_ids(ids: list[int], vocab_size: int, name: str) -> None:
    for token_id in ids:
        if not 0 <= token_id < vocab_size:
            raise APIError(
                400,
                f"{name}: token id {token_id} is outside the vocabulary [0, {vocab_size})",
                name,
            )

"""SamplingParams from request fields, and the prompt/context-length checks."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from serving.front.api.context_length import input_too_long, request_too_long
from serving.front.api.errors import APIError
from serving.front.api.native_protocol import NativeSamplingParams
from serving.front.api.openai_protocol import SamplingRequest
from serving.protocol import SchedulerReady
from serving.sampling_params import SamplingParams

MAX_TOP_LOGPROBS = 20
MAX_N = 128  # OpenAI's bound on choices per request


def request_sampling(
    defaults: Mapping[str, Any],
    fields: SamplingRequest | NativeSamplingParams,
    ready: SchedulerReady,
    prompt_len: int,
    *,
    max_tokens: int | None,
    default_max_tokens: int | None,
    seed: int | None,
    min_new_tokens: int,
    scoring_prompt: bool = False,
    prompt_param: str = "prompt",
    **constraint: str | None,
) -> SamplingParams:
    """One prompt's SamplingParams, both APIs': the request's values (None = not given) over
    the model's defaults over SamplingParams', max_new_tokens fitted to the context
    (fit_to_context). The fields both APIs name alike are read from `fields`; the output
    length, seed and min_new_tokens come apart, as the APIs name them differently (OpenAI's
    max_tokens and min_tokens, SGLang's max_new_tokens and sampling_seed over seed).
    `constraint`: SGLang's json_schema / regex / ebnf, set before the checks."""
    values = {
        "temperature": fields.temperature,
        "top_p": fields.top_p,
        "top_k": fields.top_k,
        "min_p": fields.min_p,
        "seed": seed,
        "frequency_penalty": fields.frequency_penalty,
        "presence_penalty": fields.presence_penalty,
        "repetition_penalty": fields.repetition_penalty,
        "stop_token_ids": fields.stop_token_ids,
        "ignore_eos": fields.ignore_eos,
        "min_new_tokens": min_new_tokens,
        "skip_special_tokens": fields.skip_special_tokens,
        "no_stop_trim": fields.no_stop_trim,
        "logit_bias": token_bias(fields.logit_bias),
        **constraint,
    }
    given = {k: v for k, v in values.items() if v is not None}
    sampling = SamplingParams(
        **{**defaults, **given},
        stop=_listed(fields.stop),
        stop_regex=_listed(fields.stop_regex),
    )
    fit_to_context(
        sampling,
        max_tokens,
        prompt_len,
        ready.context_length,
        ready.vocab_size,
        default_max_tokens,
        scoring_prompt,
        prompt_param,
    )
    return sampling


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

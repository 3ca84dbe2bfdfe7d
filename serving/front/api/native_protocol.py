"""Request body of SGLang's native /generate."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class NativeBody(BaseModel):
    model_config = ConfigDict(extra="allow")


class NativeSamplingParams(NativeBody):
    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    logit_bias: dict[str, float] | None = None
    n: int = 1
    seed: int | None = None
    sampling_seed: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None


class GenerateBody(NativeBody):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSamplingParams | list[NativeSamplingParams] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # with return_logprob: score the prompt from here (-1: not)
    return_text_in_logprobs: bool = False  # each logprob entry carries its token's text
    require_reasoning: bool = False  # the output starts in reasoning: report reasoning_tokens
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None
    # SGLang's: per prompt, an image (data: or http(s) URL, file:// URL or path, bare base64)
    # or a list of them, for the prompt's <|image|> placeholders in order; a batch: one entry
    # per prompt
    image_data: str | list[str | list[str] | None] | None = None


class AbortBody(NativeBody):
    rid: str = ""
    abort_all: bool = False


class ProfileBody(NativeBody):
    """SGLang's /start_profile body (ProfileReqInput); every field optional."""

    output_dir: str | None = None
    start_step: int | None = None
    num_steps: int | None = None
    activities: list[str] | None = None
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_by_stage: bool = False
    merge_profiles: bool = False
    profile_prefix: str | None = None

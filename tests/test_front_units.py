"""The HTTP front without a scheduler: detokenizer, stop strings, chat rendering, request
validation (only the paths refused before anything reaches the scheduler), /health."""

from __future__ import annotations

import json
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from serving.front.api.errors import describe_validation_errors
from serving.front.chat import (
    ChatTemplate,
    ChatTemplateError,
    load_chat_template,
    read_chat_template,
)
from serving.front.detokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    StreamingText,
    partial_stop_len,
    trim_at_stop,
)
from serving.front.engine_client import EngineClient
from serving.front.http_server import create_app
from serving.front.metrics import WorkerMetrics
from serving.protocol import FinishReason, GenerateRequest, SchedulerReady, SequenceOutput
from serving.server_args import ArgsError, ServerArgs
from serving.tools.tokenizer_build import CHAT_TEMPLATE_PATH

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient`")
    from fastapi.testclient import TestClient

CONTEXT = 64
VOCAB = 1024
READY = SchedulerReady(
    vocab_size=VOCAB,
    context_length=CONTEXT,
    eos_token_ids=[1001],
    max_running_requests=4,
    total_rows=5,
    total_pages=16,
    page_size=16,
    device="cpu",
    dtype="float32",
)
USER_HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return ChatTemplate(CHAT_TEMPLATE_PATH.read_text(encoding="utf-8"))


# ---- incremental detokenizer ----

MULTIBYTE = "Emoji 🚀🙂☕👩‍💻🇯🇵, 中文 and café — “quotes” €"


def test_split_multibyte_characters_never_yield_replacement(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False).ids
    assert any(REPLACEMENT_CHAR in tokenizer.decode([i]) for i in ids), "no character is split"
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([i]) for i in ids]
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == MULTIBYTE
    assert detok.text == MULTIBYTE


def test_held_tail_completes_across_add_calls_of_several_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(ids[i : i + 3]) for i in range(0, len(ids), 3)]
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == MULTIBYTE


def test_flush_releases_an_incomplete_character(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("🚀", add_special_tokens=False).ids
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids[:1]) == ""
    assert REPLACEMENT_CHAR in detok.flush()


def test_skip_special_tokens(tokenizer: Tokenizer) -> None:
    text = "<|user|>hi<think>why</think>ok<|endoftext|>"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    skip, keep = IncrementalDetokenizer(tokenizer), IncrementalDetokenizer(tokenizer, False)
    for i in ids:
        skip.add([i])
        keep.add([i])
    assert skip.text == "hiwhyok"
    assert keep.text == text


# ---- stop strings ----


def test_partial_stop_len() -> None:
    assert partial_stop_len("hello wor", ["world"]) == 3
    assert partial_stop_len("hello", ["world"]) == 0
    assert partial_stop_len("abc", ["c", "bcd"]) == 2
    assert partial_stop_len("xy STOP", ["STOP"]) == 4
    assert partial_stop_len("anything", []) == 0


def test_trim_at_stop() -> None:
    assert trim_at_stop("a STOP b STOP", "STOP") == "a "
    assert trim_at_stop("a STOP b STOP", "STOP", start=3) == "a STOP b "
    assert trim_at_stop("no match", "STOP") == "no match"


def _simulate(
    tokenizer: Tokenizer, text: str, stop: list[str], no_stop_trim: bool = False
) -> tuple[list[str], str]:
    """Feed `text` token by token the way the scheduler streams it: finish on the token whose
    decoded output first contains a stop string. Returns the deltas and the final text."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    stream = StreamingText(IncrementalDetokenizer(tokenizer), stop, no_stop_trim)
    deltas = []
    for n, token_id in enumerate(ids, 1):
        decoded = tokenizer.decode(ids[:n])
        matched = next((s for s in stop if s in decoded), None)
        reason = None if matched is None else FinishReason.stop(matched)
        if reason is None and n == len(ids):
            reason = FinishReason.length()
        deltas.append(stream.push([token_id], reason))
        if reason is not None:
            break
    return deltas, stream.text


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("The answer is 42.\nUser: more text", ["\nUser:"], "The answer is 42."),
        ("Hello world, STOP here", ["STOP", "world, X"], "Hello world, "),
        ("Café 🚀 done", ["🚀"], "Café "),
        ("nothing to stop here", ["zzz"], "nothing to stop here"),
    ],
)
def test_streaming_never_leaks_a_partial_stop_string(
    tokenizer: Tokenizer, text: str, stop: list[str], expected: str
) -> None:
    deltas, final = _simulate(tokenizer, text, stop)
    assert final == expected == "".join(deltas)
    emitted = ""
    for delta in deltas:
        emitted += delta
        assert expected.startswith(emitted)
        assert REPLACEMENT_CHAR not in delta


def test_streaming_holds_back_a_possible_stop_prefix(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ab END", add_special_tokens=False).ids
    stream = StreamingText(IncrementalDetokenizer(tokenizer), ["ENDING"])
    text = "".join(stream.push([i]) for i in ids)
    assert text == "ab "  # "END" may still become "ENDING"
    assert stream.push([], FinishReason.length()) == "END"


def test_no_stop_trim_keeps_the_stop_string(tokenizer: Tokenizer) -> None:
    deltas, final = _simulate(tokenizer, "Hello world, STOP here", ["STOP"], no_stop_trim=True)
    assert final.startswith("Hello world, STOP") and "".join(deltas) == final


def test_non_streaming_trim(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("one two. three", add_special_tokens=False).ids
    stream = StreamingText(IncrementalDetokenizer(tokenizer), ["two"])
    assert stream.push(ids, FinishReason.stop("two")) == "one "


def test_matched_stop_token_is_trimmed(tokenizer: Tokenizer) -> None:
    eos = tokenizer.token_to_id("<|endoftext|>")
    ids = tokenizer.encode("hi", add_special_tokens=False).ids + [eos]
    reason = FinishReason.stop(eos)
    kept = StreamingText(IncrementalDetokenizer(tokenizer, False))
    assert kept.push(ids, reason) == "hi"
    untrimmed = StreamingText(IncrementalDetokenizer(tokenizer, False), no_stop_trim=True)
    assert untrimmed.push(ids, reason) == "hi<|endoftext|>"


# ---- chat template ----


def test_render_string_and_parts_content(template: ChatTemplate) -> None:
    expected = "[gMASK]<sop><|system|>Be brief.<|user|>hi there<|assistant|><think>"
    as_string = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi there"},
    ]
    as_parts = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}],
        },
    ]
    assert template.render(as_string) == expected
    assert template.render(as_parts) == expected


def test_render_image_parts_and_refuse_other_parts(template: ChatTemplate) -> None:
    """An image_url part is GLM's placeholder (the route loaded or refused the image)."""
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    rendered = template.render([{"role": "user", "content": [image]}])
    assert "<|user|><|begin_of_image|><|image|><|end_of_image|><|assistant|>" in rendered
    audio = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
    with pytest.raises(ChatTemplateError, match=r"messages\[0\]\.content\[0\].*input_audio"):
        template.render([{"role": "user", "content": [audio]}])


def test_render_unknown_role_is_a_template_error(template: ChatTemplate) -> None:
    with pytest.raises(ChatTemplateError, match="unsupported message role: robot"):
        template.render([{"role": "robot", "content": "beep"}])


def test_render_tools_and_json_string_arguments(template: ChatTemplate) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    arguments = {"city": "Zürich", "days": 2}

    def conversation(args: Any) -> list[dict[str, Any]]:
        call = {
            "id": "c1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": args},
        }
        return [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ]

    as_dict = template.render(conversation(arguments), tools=tools)
    as_json = template.render(conversation(json.dumps(arguments)), tools=tools)
    assert as_dict == as_json
    assert '{"name": "get_weather", "parameters": {}}' in as_dict
    assert "<arg_key>city</arg_key><arg_value>Zürich</arg_value>" in as_dict
    assert "<arg_key>days</arg_key><arg_value>2</arg_value>" in as_dict
    assert "<|observation|><tool_response>sunny</tool_response>" in as_dict
    with pytest.raises(ChatTemplateError, match=r"tool_calls\[0\]\.function\.arguments"):
        template.render(conversation("{not json"), tools=tools)


def test_enable_thinking_false(template: ChatTemplate) -> None:
    assert template.render(USER_HI).endswith("<|assistant|><think>")
    assert template.render(USER_HI, enable_thinking=False).endswith("<|assistant|></think>")


def test_continue_final_message(template: ChatTemplate) -> None:
    messages = [*USER_HI, {"role": "assistant", "content": "Hello, I am"}]
    prompt = template.render(messages, add_generation_prompt=False, continue_final_message=True)
    assert prompt.endswith("<|assistant|></think>Hello, I am")


def test_template_sources(model_dir: Path, tmp_path: Path) -> None:
    assert read_chat_template(model_dir) == CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")
    override = tmp_path / "t.jinja"
    override.write_text("{{ messages[0].content }}")
    assert load_chat_template(model_dir, override=str(override)).render(USER_HI) == "hi"
    with pytest.raises(ArgsError, match="--chat-template"):
        read_chat_template(model_dir, override=str(tmp_path / "missing.jinja"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "X{{ 1 }}"}))
    assert read_chat_template(tmp_path) == "X{{ 1 }}"
    assert read_chat_template(tmp_path / "nowhere") is None


def test_rendered_prompt_tokenizes_without_added_specials(
    template: ChatTemplate, tokenizer: Tokenizer
) -> None:
    ids = tokenizer.encode(template.render(USER_HI), add_special_tokens=False).ids
    gmask, sop = tokenizer.token_to_id("[gMASK]"), tokenizer.token_to_id("<sop>")
    assert ids[:2] == [gmask, sop] and ids.count(gmask) == 1


# ---- HTTP: requests refused before the scheduler ----


class ReadyClient(EngineClient):
    """Ready, and fails the test if any request reaches the scheduler."""

    def __init__(self) -> None:
        super().__init__("ipc:///unused-send", "ipc:///unused-recv")
        self.mark_ready(READY)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[SequenceOutput]:
        raise AssertionError(f"request {req.rid} reached the scheduler")
        yield  # an async generator, like the real one


@pytest.fixture(scope="module")
def http(model_dir: Path) -> TestClient:
    args = ServerArgs(model_path=str(model_dir), served_model_name="tiny")
    return TestClient(create_app(args, ReadyClient()))


def _error(response: Any, status: int, code: str | None = None) -> dict[str, Any]:
    """The OpenAI-form error of `response`: its code is OpenAI's where given, else the status;
    the flat SGLang/vLLM form always has the status."""
    assert response.status_code == status, response.text
    body = response.json()
    assert body["object"] == "error" and body["code"] == status
    assert body["error"]["code"] == (code or status)
    assert {k: v for k, v in body["error"].items() if k != "code"} == {
        k: body[k] for k in ("message", "type", "param")
    }
    return body["error"]


# What clients match to tell a context-window error (serving/front/api/context_length.py):
# SGLang's tests; LiteLLM's ContextWindowExceededError mapping; OpenAI's and vLLM's wording.
PROMPT_TOO_LONG_PHRASES = (
    "is longer than the model's context length",
    "This model's maximum context length is",
    "Input tokens exceed the configured limit",
)
REQUEST_TOO_LONG_PHRASES = (
    "Requested token count exceeds the model's maximum context length of",
    "This model's maximum context length is",
)


def _context_error(response: Any, phrases: tuple[str, ...], *numbers: int) -> dict[str, Any]:
    error = _error(response, 400, "context_length_exceeded")
    assert all(p in error["message"] for p in (*phrases, "context_length_exceeded")), error
    assert all(str(n) in error["message"] for n in numbers), error["message"]
    return error


def _chat(http: TestClient, **fields: Any) -> Any:
    return http.post("/v1/chat/completions", json={"messages": USER_HI, **fields})


def test_malformed_json(http: TestClient) -> None:
    for route in ("/v1/chat/completions", "/v1/completions", "/generate"):
        response = http.post(
            route, content=b'{"messages": [', headers={"content-type": "application/json"}
        )
        assert _error(response, 400)["message"].startswith("malformed JSON body")


def test_missing_and_mistyped_fields(http: TestClient) -> None:
    error = _error(http.post("/v1/chat/completions", json={"model": "tiny"}), 400)
    assert (error["message"], error["param"]) == ("messages: Field required", "messages")
    assert error["type"] == "BadRequestError"
    error = _error(_chat(http, temperature="hot"), 400)
    assert error["param"] == "temperature" and error["message"].startswith("temperature: ")
    error = _error(
        http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": 5}]}), 400
    )
    assert error["message"].startswith("messages.0.content: ")
    error = _error(_chat(http, stop=7), 400)
    assert error["param"] == "stop"
    error = _error(http.post("/v1/completions", json={"max_tokens": 3}), 400)
    assert error["message"] == "prompt: Field required"
    assert (
        _error(http.post("/v1/chat/completions", json={"messages": []}), 400)["param"] == "messages"
    )


def test_unknown_model_is_404_and_the_path_is_accepted(http: TestClient, model_dir: Path) -> None:
    error = _error(_chat(http, model="gpt-4"), 404)
    assert error["type"] == "NotFoundError" and "gpt-4" in error["message"]
    # The served name and the model path pass the model check and fail later, on temperature.
    for name in ("tiny", str(model_dir)):
        assert _error(_chat(http, model=name, temperature=-1), 400)["param"] == "temperature"


def test_empty_prompts(http: TestClient) -> None:
    assert (
        _error(http.post("/v1/completions", json={"prompt": ""}), 400)["message"]
        == "the prompt is empty"
    )
    assert _error(http.post("/v1/completions", json={"prompt": []}), 400)["param"] == "prompt"
    assert (
        _error(http.post("/generate", json={"text": ""}), 400)["message"] == "the prompt is empty"
    )
    assert _error(http.post("/generate", json={}), 400)["param"] == "text"


def test_prompt_longer_than_the_context(http: TestClient, tokenizer: Tokenizer) -> None:
    long_text = "word " * (2 * CONTEXT)
    n = len(tokenizer.encode(long_text).ids)
    response = http.post("/v1/completions", json={"prompt": long_text})
    assert _context_error(response, PROMPT_TOO_LONG_PHRASES, n, CONTEXT)["param"] == "prompt"
    response = _chat(http, messages=[{"role": "user", "content": long_text}])
    assert _context_error(response, PROMPT_TOO_LONG_PHRASES, CONTEXT)["param"] == "messages"
    # exactly the context length leaves no room for an output token
    response = http.post("/generate", json={"input_ids": list(range(CONTEXT))})
    _context_error(response, PROMPT_TOO_LONG_PHRASES, CONTEXT, CONTEXT - 1)
    # refused on its characters, before it is tokenised
    response = http.post("/generate", json={"text": "x" * (CONTEXT * 1000)})
    error = _context_error(response, PROMPT_TOO_LONG_PHRASES, CONTEXT * 1000, CONTEXT)
    assert "characters" in error["message"] and error["param"] == "text"


def test_prompt_plus_max_tokens_beyond_the_context(http: TestClient) -> None:
    response = _chat(http, max_tokens=CONTEXT - 2)
    error = _context_error(response, REQUEST_TOO_LONG_PHRASES, CONTEXT, CONTEXT - 2)
    assert error["param"] == "max_tokens" and "max_completion_tokens" not in error["message"]
    response = _chat(http, max_completion_tokens=CONTEXT + 1)
    error = _context_error(response, REQUEST_TOO_LONG_PHRASES, CONTEXT, CONTEXT + 1)
    assert f"max_completion_tokens is too large: {CONTEXT + 1}." in error["message"]
    assert error["param"] == "max_tokens"
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": CONTEXT}}
    response = http.post("/generate", json=body)
    error = _context_error(response, REQUEST_TOO_LONG_PHRASES, CONTEXT, CONTEXT + 3)
    assert "3 tokens from the input messages" in error["message"]
    assert error["param"] == "max_tokens"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logit_bias": {"hello": 1}}, "logit_bias"),
        ({"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
        ({"logit_bias": {"3": -101}}, "logit_bias"),
        ({"seed": -1}, "seed"),
        ({"n": 0}, "n"),
        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ],
)
def test_bad_sampling_values(http: TestClient, fields: dict[str, Any], param: str) -> None:
    error = _error(_chat(http, **fields), 400)
    assert error["param"] == param and error["message"].startswith(param)


def test_both_apis_map_their_sampling_fields_alike() -> None:
    """One mapper serves both APIs: the fields they name alike, over the model's defaults;
    what they name differently (max/min tokens, seed) is passed apart."""
    from serving.front.api.native_protocol import NativeSamplingParams
    from serving.front.api.openai_protocol import SamplingRequest
    from serving.front.api.sampling import request_sampling

    alike = {
        "temperature": 0.5,
        "top_p": 0.9,
        "min_p": 0.1,
        "frequency_penalty": 0.2,
        "presence_penalty": -0.3,
        "stop": "x",
        "stop_token_ids": [7],
        "stop_regex": "a+",
        "ignore_eos": True,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "logit_bias": {"3": 2.0},
    }
    defaults = {"top_k": 20, "repetition_penalty": 1.1, "temperature": 1.0}
    openai = request_sampling(
        defaults,
        SamplingRequest(**alike, seed=9, min_tokens=2),
        READY,
        4,
        max_tokens=None,
        default_max_tokens=16,
        seed=9,
        min_new_tokens=2,
    )
    native = request_sampling(
        defaults,
        NativeSamplingParams(**alike, sampling_seed=9, min_new_tokens=2, max_new_tokens=16),
        READY,
        4,
        max_tokens=16,
        default_max_tokens=128,
        seed=9,
        min_new_tokens=2,
    )
    assert openai == native
    assert (openai.temperature, openai.top_k, openai.repetition_penalty) == (0.5, 20, 1.1)
    assert (openai.stop, openai.stop_regex, openai.logit_bias) == (["x"], ["a+"], {3: 2.0})
    assert (openai.max_new_tokens, openai.min_new_tokens, openai.seed) == (16, 2, 9)


def test_native_request_checks(http: TestClient) -> None:
    both = {"text": "hi", "input_ids": [1, 2]}
    assert _error(http.post("/generate", json=both), 400)["param"] == "text"
    error = _error(http.post("/generate", json={"input_ids": [1, VOCAB]}), 400)
    assert "outside the vocabulary" in error["message"]
    body = {"text": "hi", "sampling_params": {"temperature": 101}}
    assert _error(http.post("/generate", json=body), 400)["param"] == "temperature"
    body = {"text": ["a", "b"], "sampling_params": [{}]}
    assert _error(http.post("/generate", json=body), 400)["param"] == "sampling_params"


def test_unknown_route_is_json_404(http: TestClient) -> None:
    error = _error(http.get("/v2/nothing"), 404)
    assert error["message"] == "GET /v2/nothing: no such route"
    assert _error(http.get("/v1/chat/completions"), 405)["code"] == 405


def test_describe_validation_errors() -> None:
    errors = [
        {
            "type": "string_type",
            "loc": ("body", "stop", "str"),
            "msg": "Input should be a valid string",
        },
        {
            "type": "list_type",
            "loc": ("body", "stop", "list[str]"),
            "msg": "Input should be a valid list",
        },
        {"type": "missing", "loc": ("body", "messages"), "msg": "Field required"},
    ]
    message, param = describe_validation_errors(errors)
    assert param == "stop"
    assert message == (
        "stop: Input should be a valid string or Input should be a valid list; "
        "messages: Field required"
    )


# ---- health and information routes ----


def test_health_follows_the_scheduler(model_dir: Path) -> None:
    client = EngineClient("ipc:///unused-send", "ipc:///unused-recv")
    http = TestClient(create_app(ServerArgs(model_path=str(model_dir)), client))
    assert _error(http.get("/health"), 503)["message"] == "scheduler is starting"
    assert _error(_chat(http), 503)["message"] == "scheduler is starting"
    client.mark_ready(READY)
    assert http.get("/health").status_code == 200
    client.begin_shutdown()
    assert _error(http.get("/health"), 503)["message"] == "server is shutting down"
    failed = EngineClient("ipc:///unused-send", "ipc:///unused-recv")
    failed.fail("CUDA out of memory")
    http = TestClient(create_app(ServerArgs(model_path=str(model_dir)), failed))
    assert "CUDA out of memory" in _error(http.get("/health"), 503)["message"]


def test_information_routes(http: TestClient, model_dir: Path) -> None:
    card = http.get("/v1/models").json()["data"][0]
    assert (card["id"], card["root"], card["max_model_len"]) == ("tiny", "tiny", CONTEXT)
    info = http.get("/get_model_info").json()
    assert info["model_type"] == "glm5_next" and info["is_generation"] is True
    assert info["architectures"] == ["Glm5NextForConditionalGeneration"]
    server = http.get("/server_info").json()
    assert server["model_path"] == str(model_dir) and "version" in server
    assert server["internal_states"] == [{}]
    assert server["max_total_num_tokens"] == READY.total_pages * READY.page_size
    assert server["simulation"] is None and server["simulate_rank"] is None  # a real worker
    assert http.get("/metrics").status_code == 404  # as SGLang: no /metrics without the flag


# ---- /metrics (serving/front/metrics.py) ----


def _samples(metrics: WorkerMetrics) -> dict[str, float]:
    """{'name{labels}': value} of a scrape, labels sorted."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(metrics.text().decode()):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def test_metrics_route_and_labels_follow_sglang(model_dir: Path) -> None:
    metrics = WorkerMetrics("tiny", "decode")
    client = EngineClient("ipc:///unused-send", "ipc:///unused-recv", metrics=metrics)
    http = TestClient(create_app(ServerArgs(model_path=str(model_dir)), client))
    text = http.get("/metrics").text
    assert 'sglang:num_running_reqs{engine_type="decode",model_name="tiny",pp_rank="0",' \
        'tp_rank="0"} 0.0' in text  # fmt: skip
    assert 'sglang:time_to_first_token_seconds_count{model_name="tiny"} 0.0' in text
    assert "# TYPE sglang:time_to_first_token_seconds histogram" in text
    assert "# TYPE sglang:num_transfer_failed_reqs_total counter" in text
    assert "pdserve:" not in text


def test_request_metrics_count_what_sglang_counts() -> None:
    """Two requests: one of 4 tokens (one, then three at once, as an EAGLE step commits them)
    and one aborted before its first token."""
    from serving.front.metrics import RequestTimes

    m = WorkerMetrics("tiny")
    a, b = RequestTimes(created=10.0), RequestTimes(created=10.0)
    m.observe_output(a, SequenceOutput("a", [7], queue_time=0.25), 10.5)  # first token
    m.observe_output(a, SequenceOutput("a", [8, 9, 10], finished=True,
                                       finish_reason=FinishReason.length(), prompt_tokens=5,
                                       completion_tokens=4), 10.8)  # fmt: skip
    aborted = FinishReason.abort("gone", 499)
    m.observe_output(b, SequenceOutput("b", [], True, aborted, prompt_tokens=3), 11.0)
    s = _samples(m)
    one = '{model_name="tiny"}'
    assert s[f"sglang:time_to_first_token_seconds_count{one}"] == 1
    assert s[f"sglang:time_to_first_token_seconds_sum{one}"] == pytest.approx(0.5)
    # the 0.3 s gap of three tokens: three observations of 0.1 s, summing to the gap
    assert s[f"sglang:inter_token_latency_seconds_count{one}"] == 3
    assert s[f"sglang:inter_token_latency_seconds_sum{one}"] == pytest.approx(0.3)
    assert s['sglang:inter_token_latency_seconds_bucket{le="0.08",model_name="tiny"}'] == 0
    assert s['sglang:inter_token_latency_seconds_bucket{le="0.2",model_name="tiny"}'] == 3
    assert s[f"sglang:time_per_output_token_seconds_count{one}"] == 1  # b has no 2 tokens
    assert s[f"sglang:time_per_output_token_seconds_sum{one}"] == pytest.approx(0.1)
    assert s[f"sglang:e2e_request_latency_seconds_count{one}"] == 2
    assert s[f"sglang:e2e_request_latency_seconds_sum{one}"] == pytest.approx(0.8 + 1.0)
    assert s[f"sglang:queue_time_seconds_count{one}"] == 1
    assert s[f"sglang:prompt_tokens_total{one}"] == 8
    assert s[f"sglang:generation_tokens_total{one}"] == 4
    assert s[f"sglang:num_requests_total{one}"] == 2
    assert s[f"sglang:num_aborted_requests_total{one}"] == 1


def test_scheduler_rates_are_over_the_last_window() -> None:
    from serving.front.metrics import WINDOW_S
    from serving.protocol import SchedulerStats

    m = WorkerMetrics("tiny")
    now = [100.0]
    m.scheduler.clock = lambda: now[0]
    base = dict(total_pages=10, page_size=16, total_rows=8, spec_num_steps=1)
    # 100 decode tokens, 40 verify steps committing 60 tokens, a retraction, within the window
    m.observe_stats(SchedulerStats(**base, used_pages=5, used_rows=2, running=2,
                                   decode_tokens_total=100, spec_verify_steps=40,
                                   spec_committed_tokens=60, retractions=1), 100.0)  # fmt: skip
    labels = '{engine_type="unified",model_name="tiny",pp_rank="0",tp_rank="0"}'
    s = _samples(m)
    assert s[f"sglang:gen_throughput{labels}"] == pytest.approx(100 / WINDOW_S)
    assert s[f"sglang:spec_accept_length{labels}"] == pytest.approx(1.5)
    assert s[f"sglang:spec_accept_rate{labels}"] == pytest.approx(0.75)  # 1.5 / (1 + 1)
    assert s[f"sglang:num_retracted_reqs{labels}"] == 1
    assert s[f"sglang:num_retracted_requests_total{labels}"] == 1
    assert s[f"sglang:token_usage{labels}"] == 0.5
    assert s[f"sglang:num_used_tokens{labels}"] == 80
    assert s[f"sglang:max_total_num_tokens{labels}"] == 160
    assert s[f"sglang:mamba_usage{labels}"] == 0.25
    assert s[f"sglang:cache_hit_rate{labels}"] == 0  # no prefix cache has fed it
    # idle for a window: throughput and retractions fall to 0, acceptance keeps its last value
    now[0] += WINDOW_S + 1
    s = _samples(m)
    assert s[f"sglang:gen_throughput{labels}"] == 0
    assert s[f"sglang:num_retracted_reqs{labels}"] == 0
    assert s[f"sglang:spec_accept_length{labels}"] == pytest.approx(1.5)
    assert s[f"sglang:num_retracted_requests_total{labels}"] == 1
    # 50 more tokens 1 s later: 50 over the window (not since the start), 2 s of it elapsed
    m.observe_stats(SchedulerStats(**base, decode_tokens_total=150, cache_lookup_tokens_total=10,
                                   cache_hit_tokens_total=4), now[0] + 1)  # fmt: skip
    now[0] += 2
    s = _samples(m)
    assert s[f"sglang:gen_throughput{labels}"] == pytest.approx(50 / WINDOW_S)
    assert s[f"sglang:cache_hit_rate{labels}"] == pytest.approx(0.4)


def test_bootstrap_lists_per_prompt_or_per_sequence(tokenizer: Tokenizer) -> None:
    from serving.front.api.errors import APIError
    from serving.front.api.sequences import make_seqs
    from serving.sampling_params import SamplingParams

    def rooms(prompts: int, n: int, room: Any) -> list[int | None]:
        seqs = make_seqs(tokenizer, "r", [[5]] * prompts, [SamplingParams()] * prompts, n,
                         bootstrap_host=None, bootstrap_room=room)  # fmt: skip
        return [s.request.bootstrap_room for s in seqs]

    # one room per prompt: its samples derive room + i; one per sequence: taken as given
    assert rooms(2, 2, [10, 20]) == [10, 11, 20, 21]
    assert rooms(1, 2, [10, 30]) == [10, 30]
    assert rooms(1, 3, 2**63 - 1) == [2**63 - 1, 0, 1]
    with pytest.raises(APIError, match="bootstrap_room: 3 values for 2 prompts of 2 samples"):
        rooms(2, 2, [1, 2, 3])


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_responses_tool_choice_mode_without_tools(choice):
    """The Responses API sends tool_choice "auto" by default, with or without tools (SGLang's
    TestOpenAIServerv1Responses does): without tools a mode asks for nothing, where a chat
    completion would refuse a tool_choice without tools. A named function still needs one."""
    from serving.front.api.responses_protocol import ResponsesRequest, chat_request

    chat = chat_request(ResponsesRequest(model="m", input="hi", tool_choice=choice))
    assert chat.tool_choice is None and not chat.tools
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    with_tools = chat_request(ResponsesRequest(model="m", input="hi", tools=[tool],
                                               tool_choice=choice))  # fmt: skip
    assert with_tools.tool_choice == choice
    named = ResponsesRequest(model="m", input="hi", tool_choice={"type": "function", "name": "f"})
    assert chat_request(named).tool_choice.function.name == "f"


def test_tool_choice_naming_a_function_not_in_tools(http: TestClient) -> None:
    """A 400, as OpenAI and vLLM answer (SGLang's older 200 with a warning would run the request
    without the forced call the client asked for); the message names the function, in SGLang's
    and vLLM's words, and the tools offered. The Responses API maps onto the same check."""
    lookup = {"name": "lookup", "parameters": {"type": "object", "properties": {}}}
    named = {"type": "function", "function": {"name": "nonexistent_function"}}
    response = _chat(http, tools=[{"type": "function", "function": lookup}], tool_choice=named)
    error = _error(response, 400)
    assert error["param"] == "tool_choice"
    for phrase in ("Tool 'nonexistent_function' not found in tools list",
                   "does not match any of the specified `tools`", "'lookup'"):  # fmt: skip
        assert phrase in error["message"], error["message"]
    body = {"model": "tiny", "input": "hi", "tools": [{"type": "function", **lookup}],
            "tool_choice": {"type": "function", "name": "nonexistent_function"}}  # fmt: skip
    error = _error(http.post("/v1/responses", json=body), 400)
    assert "Tool 'nonexistent_function' not found in tools list" in error["message"]


def test_sequence_output_pickles_every_field():
    """SequenceOutput's compact wire form (field values in order) keeps every field."""
    import pickle

    from serving.protocol import FinishReason, SequenceOutput, TokenLogprob

    out = SequenceOutput(
        "rid-1",
        [5, 6],
        True,
        FinishReason.abort("gone", 503),
        7,
        2,
        3,
        [TokenLogprob(5, -0.5, [(6, -1.0)])],
        [TokenLogprob(1, None)],
        0.25,
        {"queue_time": 0.1, "prefill_forward_time": 0.2},
    )
    assert pickle.loads(pickle.dumps(out, -1)) == out
    assert pickle.loads(pickle.dumps(SequenceOutput("r", [1]))) == SequenceOutput("r", [1])

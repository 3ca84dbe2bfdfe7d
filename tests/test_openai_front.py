"""The OpenAI surface of the real front, with known model output injected at the token level.

ScriptedEngine stands in for the scheduler link: it answers every sequence with the tokens of
`reply` (plus GLM's end-of-turn), one token per output message, honouring max_tokens and stop
strings as the scheduler does. The detokenizer, stop-string holdback, reasoning and tool-call
parsers, SSE framing and usage all run as in the server; the client is the official openai
package. The server's own end-to-end tests are in test_openai_server.py.
"""

from __future__ import annotations

import asyncio
import json
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from tokenizers import Tokenizer

from serving.front.engine_client import EngineClient
from serving.front.http_server import create_app
from serving.protocol import (
    FinishReason,
    GenerateRequest,
    SchedulerReady,
    SequenceOutput,
    TokenLogprob,
)
from serving.server_args import ServerArgs

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient`")
    from fastapi.testclient import TestClient

MODEL = "GLM-5.3-Flash"
CONTEXT = 2048
USER = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Forecast for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "ratio": {"type": "number"},
                    "alerts": {"type": "boolean"},
                    "options": {"type": "object"},
                    "hours": {"type": "array", "items": {"type": "integer"}},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
        },
    },
]
CALLS = (
    '<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris "centre"</arg_value>'
    "<arg_key>days</arg_key><arg_value>3</arg_value>"
    "<arg_key>ratio</arg_key><arg_value>0.5</arg_value>"
    "<arg_key>alerts</arg_key><arg_value>true</arg_value>"
    '<arg_key>options</arg_key><arg_value>{"unit": "C", "detail": [1, 2]}</arg_value>'
    "<arg_key>hours</arg_key><arg_value>[9, 12]</arg_value></tool_call>"
    "<tool_call>get_time<arg_key>tz</arg_key><arg_value>Europe/Paris</arg_value></tool_call>"
)
ARGUMENTS = [
    {
        "city": 'Paris "centre"',
        "days": 3,
        "ratio": 0.5,
        "alerts": True,
        "options": {"unit": "C", "detail": [1, 2]},
        "hours": [9, 12],
    },
    {"tz": "Europe/Paris"},
]
REPLY = "Two lookups needed.</think>Checking." + CALLS


class ScriptedEngine(EngineClient):
    """Every sequence answers `reply`; the requests it got are kept in `requests`."""

    def __init__(self, tokenizer: Tokenizer, ready: SchedulerReady) -> None:
        super().__init__("ipc:///unused-send", "ipc:///unused-recv")
        self.mark_ready(ready)
        self.tokenizer = tokenizer
        self.eos = tokenizer.token_to_id("<|observation|>")
        self.reply = REPLY
        self.refusal: str | None = None  # abort with this 400 message after the first token
        self.requests: list[GenerateRequest] = []

    def reply_ids(self) -> list[int]:
        return self.tokenizer.encode(self.reply, add_special_tokens=False).ids + [self.eos]

    async def generate(self, req: GenerateRequest) -> AsyncIterator[SequenceOutput]:
        self.requests.append(req)
        ids = self.reply_ids()[: req.sampling.max_new_tokens]
        for i, token in enumerate(ids):
            text = self.tokenizer.decode(ids[: i + 1], skip_special_tokens=False)
            stop = next((s for s in req.sampling.stop if s in text), None)
            reason = None
            if self.refusal is not None:
                reason = FinishReason.abort(self.refusal, 400)
            elif token == self.eos:
                reason = FinishReason.stop(token)
            elif stop is not None:
                reason = FinishReason.stop(stop)
            elif i == len(ids) - 1:
                reason = FinishReason.length()
            logprobs = None
            if req.return_logprob:
                top = [(token, -0.25), (token + 1, -2.0)][: req.top_logprobs_num]
                logprobs = [TokenLogprob(token, -0.25, top)]
            yield SequenceOutput(
                req.rid,
                [token],
                finished=reason is not None,
                finish_reason=reason,
                prompt_tokens=len(req.input_ids),
                completion_tokens=i + 1,
                logprobs=logprobs,
            )
            if reason is not None:
                return
            await asyncio.sleep(0)


@pytest.fixture(scope="module")
def engine(tokenizer: Tokenizer) -> ScriptedEngine:
    eos = [tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]
    ready = SchedulerReady(
        vocab_size=tokenizer.get_vocab_size(),
        context_length=CONTEXT,
        eos_token_ids=eos,
        max_running_requests=8,
        total_rows=9,
        total_pages=64,
        page_size=16,
        device="cpu",
        dtype="float32",
    )
    return ScriptedEngine(tokenizer, ready)


@pytest.fixture(scope="module")
def client(model_dir: Path, engine: ScriptedEngine) -> openai.OpenAI:
    args = ServerArgs(
        model_path=str(model_dir),
        served_model_name=MODEL,
        reasoning_parser="glm45",
        tool_call_parser="glm47",
    )
    http = TestClient(create_app(args, engine))
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0
    )


@pytest.fixture(autouse=True)
def default_reply(engine: ScriptedEngine) -> None:
    engine.reply = REPLY
    engine.refusal = None


def chat(client: openai.OpenAI, **fields: Any) -> Any:
    return client.chat.completions.create(
        **{"model": MODEL, "messages": USER, "max_tokens": 400, **fields}
    )


def collect_stream(stream: Any) -> dict[int, dict[str, Any]]:
    """Per choice: reasoning, content, tool-call deltas, finish reasons seen; plus "usage"."""
    out: dict[Any, Any] = {}
    for chunk in stream:
        if not chunk.choices:
            out["usage"] = chunk.usage
        for choice in chunk.choices:
            seen = out.setdefault(
                choice.index,
                {"reasoning": "", "content": "", "deltas": [], "finish": [], "logprobs": []},
            )
            seen["reasoning"] += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            seen["content"] += choice.delta.content or ""
            seen["deltas"] += choice.delta.tool_calls or []
            seen["finish"].append(choice.finish_reason)
            if choice.logprobs is not None:
                seen["logprobs"] += choice.logprobs.content
    return out


def merged_calls(deltas: list[Any]) -> list[dict[str, Any]]:
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
        call["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)]


def test_tool_calls_are_typed_by_the_tool_schema(
    client: openai.OpenAI, engine: ScriptedEngine, tokenizer: Tokenizer
) -> None:
    response = chat(client, tools=TOOLS)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"] == "Two lookups needed."
    assert choice.message.content == "Checking."
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c.function.arguments) for c in calls] == ARGUMENTS
    assert len({c.id for c in calls}) == 2 and all(c.type == "function" for c in calls)
    ids = engine.reply_ids()
    assert response.usage.completion_tokens == len(ids)
    assert response.usage.prompt_tokens == len(engine.requests[-1].input_ids)
    think_end = tokenizer.token_to_id("</think>")
    assert response.usage.completion_tokens_details.reasoning_tokens == ids.index(think_end)
    assert not engine.requests[-1].sampling.skip_special_tokens


def test_streamed_tool_calls_send_the_name_then_argument_fragments(
    client: openai.OpenAI,
) -> None:
    whole = chat(client, tools=TOOLS).choices[0].message
    seen = collect_stream(
        chat(client, tools=TOOLS, stream=True, stream_options={"include_usage": True})
    )
    choice = seen[0]
    assert choice["reasoning"] == whole.model_extra["reasoning_content"]
    assert choice["content"] == whole.content
    calls = merged_calls(choice["deltas"])
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.tool_calls
    ]
    first = [d for d in choice["deltas"] if d.index == 0]
    assert first[0].id and first[0].function.name == "get_weather" and first[0].type
    assert all(d.id is None and d.function.name is None for d in first[1:])
    assert len(first) > 5  # the string value and each argument arrive as they are written
    assert choice["finish"][-1] == "tool_calls" and set(choice["finish"][:-1]) == {None}
    assert seen["usage"].completion_tokens > 0


def test_string_values_stream_as_they_are_written(client: openai.OpenAI, engine) -> None:
    engine.reply = (
        "</think><tool_call>get_time<arg_key>tz</arg_key><arg_value>"
        + "Pacific/Port_Moresby, a long time zone name"
        + "</arg_value></tool_call>"
    )
    seen = collect_stream(chat(client, tools=TOOLS, stream=True))
    fragments = [d.function.arguments for d in seen[0]["deltas"]]
    assert "".join(fragments) == '{"tz": "Pacific/Port_Moresby, a long time zone name"}'
    assert len(fragments) > 8


@pytest.mark.parametrize(
    "markup",
    [
        "<tool_call>no_such_tool<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
        "<tool_call>get_time<arg_key>tz</arg_key>stray<arg_value>UTC</arg_value></tool_call>",
        "<tool_call>get_time<arg_value>UTC</arg_value></tool_call>",
        "<tool_call>get_time<arg_key></arg_key><arg_value>UTC</arg_value></tool_call>",
        "</arg_value>loose tags<arg_key>",
    ],
)
def test_malformed_tool_markup_is_returned_as_text(
    client: openai.OpenAI, engine: ScriptedEngine, markup: str
) -> None:
    engine.reply = "</think>" + markup
    message = chat(client, tools=TOOLS).choices[0].message
    assert message.tool_calls is None
    assert message.content == markup
    seen = collect_stream(chat(client, tools=TOOLS, stream=True))  # no error, whatever it sends
    assert seen[0]["finish"][-1] in ("stop", "tool_calls")


def test_a_call_cut_off_by_max_tokens_is_text(
    client: openai.OpenAI, engine: ScriptedEngine, tokenizer: Tokenizer
) -> None:
    engine.reply = "</think>" + CALLS
    cut = engine.reply_ids()[:20]
    choice = chat(client, tools=TOOLS, max_tokens=len(cut)).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls is None
    assert choice.message.content == tokenizer.decode(cut[1:], skip_special_tokens=False)


def test_reasoning_split_when_the_template_opens_think(client: openai.OpenAI, engine) -> None:
    engine.reply = "Plan: answer briefly.</think>Sunny."
    message = chat(client).choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (
        "Plan: answer briefly.",
        "Sunny.",
    )
    seen = collect_stream(chat(client, stream=True))[0]
    assert (seen["reasoning"], seen["content"]) == ("Plan: answer briefly.", "Sunny.")
    held = collect_stream(chat(client, stream=True, extra_body={"stream_reasoning": False}))[0]
    assert (held["reasoning"], held["content"]) == ("Plan: answer briefly.", "Sunny.")
    joined = chat(client, extra_body={"separate_reasoning": False}).choices[0].message
    assert joined.model_extra.get("reasoning_content") is None
    assert joined.content == "Plan: answer briefly.</think>Sunny."


def test_thinking_off_and_a_think_block_the_model_opens(
    client: openai.OpenAI, engine: ScriptedEngine, tokenizer: Tokenizer
) -> None:
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    engine.reply = "Sunny."
    message = chat(client, extra_body=off).choices[0].message
    assert message.content == "Sunny." and message.model_extra.get("reasoning_content") is None
    prompt = tokenizer.decode(engine.requests[-1].input_ids, skip_special_tokens=False)
    assert prompt.endswith("<|assistant|></think>")
    engine.reply = "<think>Quick check.</think>Sunny."
    message = chat(client, extra_body=off).choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == ("Quick check.", "Sunny.")


def test_a_reply_that_never_leaves_the_reasoning(client: openai.OpenAI, engine) -> None:
    engine.reply = "Still thinking about it"
    response = chat(client, max_tokens=3)
    message = response.choices[0].message
    assert message.content == "" and message.model_extra["reasoning_content"]
    assert response.usage.completion_tokens_details.reasoning_tokens == 3


def test_tool_choice_none_renders_no_tools_and_parses_no_calls(
    client: openai.OpenAI, engine: ScriptedEngine, tokenizer: Tokenizer
) -> None:
    message = chat(client, tools=TOOLS, tool_choice="none").choices[0].message
    assert message.tool_calls is None and message.content == "Checking." + CALLS
    prompt = tokenizer.decode(engine.requests[-1].input_ids, skip_special_tokens=False)
    assert "<tools>" not in prompt


def test_named_tool_choice_renders_that_tool_and_forces_its_markup(
    client: openai.OpenAI, engine: ScriptedEngine, tokenizer: Tokenizer
) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    chat(client, tools=TOOLS, tool_choice=named)
    request = engine.requests[-1]
    prompt = tokenizer.decode(request.input_ids, skip_special_tokens=False)
    assert '"get_time"' in prompt and '"get_weather"' not in prompt
    grammar = request.sampling.ebnf
    assert '"get_time"' in grammar and "get_weather" not in grammar
    assert grammar.startswith("start: REASONING")  # the template opened <think>
    chat(client, tools=TOOLS, tool_choice="required")
    assert '"get_weather"' in engine.requests[-1].sampling.ebnf


def test_tool_results_are_rendered(
    client: openai.OpenAI, engine: ScriptedEngine, tokenizer: Tokenizer
) -> None:
    call = chat(client, tools=TOOLS).choices[0].message.tool_calls[1]
    history = [
        *USER,
        {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "14:05 CEST"},
    ]
    engine.reply = "It is 14:05.</think>It is 14:05 in Paris."
    message = chat(client, tools=TOOLS, messages=history).choices[0].message
    assert message.content == "It is 14:05 in Paris." and message.tool_calls is None
    prompt = tokenizer.decode(engine.requests[-1].input_ids, skip_special_tokens=False)
    assert "<tool_call>get_time<arg_key>tz</arg_key><arg_value>Europe/Paris</arg_value>" in prompt
    assert "<|observation|><tool_response>14:05 CEST</tool_response><|assistant|>" in prompt


def test_stop_strings_trim_and_never_leak_while_streaming(
    client: openai.OpenAI, engine: ScriptedEngine
) -> None:
    engine.reply = "</think>The forecast is sunny with light wind."
    whole = chat(client, stop="light").choices[0]
    assert whole.message.content == "The forecast is sunny with "
    assert whole.finish_reason == "stop" and whole.model_extra["matched_stop"] == "light"
    contents = []
    for chunk in chat(client, stop=["light", "xyz"], stream=True):
        contents += [c.delta.content for c in chunk.choices if c.delta.content]
    assert "".join(contents) == whole.message.content
    assert not any(c.endswith(("l", "li", "lig", "ligh")) for c in contents)


def test_n_choices_logprobs_and_usage(client: openai.OpenAI, engine: ScriptedEngine) -> None:
    engine.reply = "Ok.</think>Sunny."
    n_ids = len(engine.reply_ids())
    response = chat(client, n=2, logprobs=True, top_logprobs=2, seed=7, user="u-1", temperature=1)
    assert [c.index for c in response.choices] == [0, 1]
    for choice in response.choices:
        content = choice.logprobs.content
        assert len(content) == n_ids
        assert all(len(entry.top_logprobs) == 2 for entry in content)
        assert all(entry.bytes == list(entry.token.encode()) for entry in content)
    assert response.usage.completion_tokens == 2 * n_ids
    assert response.usage.total_tokens == response.usage.prompt_tokens + 2 * n_ids
    assert [r.sampling.seed for r in engine.requests[-2:]] == [7, 8]
    seen = collect_stream(
        chat(client, n=2, logprobs=True, stream=True, stream_options={"include_usage": True})
    )
    assert {0, 1} <= set(seen) and all(len(seen[i]["logprobs"]) == n_ids for i in (0, 1))
    assert seen["usage"].completion_tokens == 2 * n_ids


def test_max_completion_tokens(client: openai.OpenAI, engine: ScriptedEngine) -> None:
    response = chat(client, max_completion_tokens=4, max_tokens=None)
    assert response.usage.completion_tokens == 4
    assert response.choices[0].finish_reason == "length"


def test_completions_logprobs_echo_and_usage(
    client: openai.OpenAI, engine: ScriptedEngine, tokenizer: Tokenizer
) -> None:
    engine.reply = "Sunny and warm."
    ids = engine.reply_ids()
    response = client.completions.create(
        model=MODEL, prompt="Weather:", max_tokens=50, logprobs=2, n=2
    )
    assert len(response.choices) == 2
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(ids)
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0
    assert response.usage.completion_tokens == 2 * len(ids)
    assert response.usage.prompt_tokens == len(tokenizer.encode("Weather:").ids)
    echo = client.completions.create(model=MODEL, prompt="Weather:", max_tokens=50, echo=True)
    assert echo.choices[0].text == "Weather:" + response.choices[0].text
    streamed = client.completions.create(
        model=MODEL,
        prompt="Weather:",
        max_tokens=50,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    assert "".join(c.text for ch in chunks for c in ch.choices) == response.choices[0].text
    assert chunks[-1].usage.completion_tokens == len(ids)


def test_response_format_becomes_a_constraint(
    client: openai.OpenAI, engine: ScriptedEngine
) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    chat(client, response_format={"type": "json_object"}, extra_body=off)
    assert json.loads(engine.requests[-1].sampling.json_schema) == {"type": "object"}
    response_format = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    chat(client, response_format=response_format, extra_body=off)
    assert json.loads(engine.requests[-1].sampling.json_schema) == schema
    chat(client, response_format=response_format)  # thinking on: after </think>
    grammar = engine.requests[-1].sampling.ebnf
    assert grammar.startswith("start: REASONING") and "%json" in grammar
    client.completions.create(
        model=MODEL, prompt="x", max_tokens=5, extra_body={"regex": "(yes|no)"}
    )
    assert engine.requests[-1].sampling.regex == "(yes|no)"


def test_models_list_and_retrieve(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


BAD_CHAT = [
    {"temperature": -1},
    {"n": 0},
    {"logprobs": True, "top_logprobs": 30},
    {"top_logprobs": 2},
    {"stop": 5},
    {"max_tokens": CONTEXT * 2},
    {"messages": []},
    {"logit_bias": {"42": 500}},
    {"logit_bias": {"forty-two": 5}},
    {"stream_options": {"include_usage": True}},
    {"tool_choice": "required"},
    {"tools": TOOLS, "tool_choice": "sometimes"},
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    {"tools": [{"type": "function", "function": {"description": "no name"}}]},
    {"response_format": {"type": "xml"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 1}}},
    {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}},
    {"response_format": {"type": "json_object"}, "extra_body": {"regex": "a+"}},
    {"extra_body": {"regex": "(unclosed"}},
    {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
    {"messages": [{"role": "wizard", "content": "hi"}]},
]


@pytest.mark.parametrize("fields", BAD_CHAT, ids=lambda f: ",".join(f))
def test_invalid_chat_parameters_raise_bad_request(
    client: openai.OpenAI, fields: dict[str, Any]
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        chat(client, **fields)
    assert raised.value.status_code == 400 and raised.value.message


@pytest.mark.parametrize(
    "fields",
    [
        {"logprobs": 30},
        {"extra_body": {"stop_regex": "(unclosed"}},
        {"extra_body": {"logit_bias": {"100000": 1}}},
        {"suffix": "tail"},
        {"best_of": 3},
        {"prompt": ""},
        {"extra_body": {"json_schema": "{not json"}},
    ],
    ids=lambda f: ",".join(f),
)
def test_invalid_completion_parameters_raise_bad_request(
    client: openai.OpenAI, fields: dict[str, Any]
) -> None:
    with pytest.raises(openai.BadRequestError):
        client.completions.create(**{"model": MODEL, "prompt": "hi", "max_tokens": 3, **fields})


def test_unknown_model_raises_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        chat(client, model="gpt-4o")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="hi")


def test_a_constraint_the_scheduler_refuses_is_an_error(
    client: openai.OpenAI, engine: ScriptedEngine
) -> None:
    engine.refusal = "constrained decoding is not set up in the scheduler (no tokenizer)"
    with pytest.raises(openai.BadRequestError, match="not set up"):
        chat(client, response_format={"type": "json_object"})
    # a stream that fails before its first token is an HTTP error too (its head is held)
    with pytest.raises(openai.BadRequestError, match="not set up"):
        list(chat(client, response_format={"type": "json_object"}, stream=True))

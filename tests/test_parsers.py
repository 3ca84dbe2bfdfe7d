"""GLM reasoning and tool-call parsing, output-constraint grammars, constrained sampling.

Parsers: known model output, split at every point, must give what the whole text gives.
Grammars: llguidance matchers over the tiny tokenizer accept exactly the markup they force.
Sampling: the Sampler with a grammar turns random logits into output the grammar accepts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import llguidance
import pytest
import torch
from tokenizers import Tokenizer

from serving.executor.constrained import GrammarError, grammar_of, load_tokenizer
from serving.executor.sampler import Sampler, SamplingState
from serving.front.api.chat_output import ChatOutputParser, parse_reply
from serving.front.api.errors import APIError
from serving.front.api.reasoning import prompt_opens_reasoning
from serving.front.api.structured_output import (
    Constraint,
    GlmTokens,
    after_reasoning,
    forced_tool_calls,
    requested_constraint,
)
from serving.front.api.tool_calls import merge_tool_call_deltas
from serving.front.api.tool_schema import typed_value
from serving.front.chat import ChatTemplate
from serving.protocol import FinishReason
from serving.sampling_params import SamplingParams
from serving.tools.tokenizer_build import CHAT_TEMPLATE_PATH, write_tokenizer_files

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "unit": {"type": ["string", "null"]},
                    "alerts": {"type": "boolean"},
                },
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "ping"}},
]
REPLIES = [
    "Need the weather.</think>Let me check.<tool_call>get_weather<arg_key>city</arg_key>"
    '<arg_value>Zürich "old town"\n</arg_value><arg_key>days</arg_key><arg_value>2</arg_value>'
    "</tool_call><tool_call>ping</tool_call> Done.",
    "</think><tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
    "<arg_key>alerts</arg_key>\n<arg_value>False</arg_value>\n</tool_call>",
    "Hmm</think>a < b and <tool_ca not a call; <tool_call>nope</tool_call> also not",
    "x</think><tool_call>get_weather<arg_key>city</arg_key>junk<arg_value>Oslo</arg_value>",
    "x</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Os",
    "<think>twice</think>answer",
]


def _stream(parser: ChatOutputParser, text: str, piece: int) -> tuple[str, str, list[Any]]:
    reasoning, content, deltas = "", "", []
    for i in range(0, max(len(text), 1), piece):
        delta = parser.feed(text[i : i + piece], final=i + piece >= len(text))
        reasoning, content = reasoning + delta.reasoning, content + delta.content
        deltas += delta.tool_calls
    return reasoning, content, deltas


@pytest.mark.parametrize("reply", REPLIES)
def test_any_split_of_the_stream_gives_the_same_result(reply: str) -> None:
    results = set()
    for piece in (1, 2, 3, 5, 8, len(reply)):
        reasoning, content, deltas = _stream(ChatOutputParser(True, True, TOOLS), reply, piece)
        calls = [
            (c["function"]["name"], c["function"]["arguments"])
            for c in merge_tool_call_deltas(deltas)
        ]
        results.add((reasoning, content, tuple(calls)))
    assert len(results) == 1


def test_whole_reply_parsing() -> None:
    reply = parse_reply(REPLIES[0], True, True, TOOLS)
    assert (reply.reasoning, reply.content) == ("Need the weather.", "Let me check. Done.")
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.tool_calls
    ] == [
        ("get_weather", {"city": 'Zürich "old town"\n', "days": 2}),
        ("ping", {}),
    ]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in reply.tool_calls)
    newlines = parse_reply(REPLIES[1], True, True, TOOLS)  # GLM-4.5 style whitespace
    assert json.loads(newlines.tool_calls[0]["function"]["arguments"]) == {
        "city": "Oslo",
        "alerts": False,
    }
    assert newlines.content == ""


def test_streamed_deltas_concatenate_to_the_whole_arguments() -> None:
    _, _, deltas = _stream(ChatOutputParser(True, True, TOOLS), REPLIES[0], 1)
    whole = parse_reply(REPLIES[0], True, True, TOOLS).tool_calls
    merged = merge_tool_call_deltas(deltas)
    assert [c["function"] for c in merged] == [c["function"] for c in whole]
    heads = [d for d in deltas if "id" in d]
    assert [d["function"]["name"] for d in heads] == ["get_weather", "ping"]
    assert heads[0]["function"]["arguments"] == ""  # the name goes out before the arguments


def test_markup_that_is_not_a_call_stays_text() -> None:
    reply = parse_reply(REPLIES[2], True, True, TOOLS)
    assert reply.tool_calls == []
    assert reply.content == "a < b and <tool_ca not a call; <tool_call>nope</tool_call> also not"
    for text in REPLIES[3:5]:  # broken, then cut off
        whole = parse_reply(text, True, True, TOOLS)
        assert whole.tool_calls == [] and whole.content == text.split("</think>", 1)[1]


def test_a_streamed_call_that_breaks_keeps_what_was_sent() -> None:
    _, content, deltas = _stream(ChatOutputParser(True, True, TOOLS), REPLIES[3], 4)
    assert [c["function"] for c in merge_tool_call_deltas(deltas)] == [
        {"name": "get_weather", "arguments": ""}
    ]
    assert content == "<arg_key>city</arg_key>junk<arg_value>Oslo</arg_value>"
    _, content, deltas = _stream(ChatOutputParser(True, True, TOOLS), REPLIES[4], 3)
    assert merge_tool_call_deltas(deltas)[0]["function"]["arguments"] == '{"city": "Os'


def test_without_parsers_the_text_passes_through() -> None:
    parser = ChatOutputParser(reasoning=False, starts_in_reasoning=True, tools=None)
    assert parser.feed(REPLIES[0], final=True).content == REPLIES[0]


def test_reasoning_markers() -> None:
    assert parse_reply(REPLIES[5], True, True, None).reasoning == "twice"  # repeated <think>
    opened = parse_reply("\n<think>plan</think>go", True, False, None)
    assert (opened.reasoning, opened.content, opened.reasoned) == ("plan", "go", True)
    plain = parse_reply("no thinking <think>here</think>", True, False, None)
    assert (plain.reasoning, plain.content, plain.reasoned) == (
        "",
        "no thinking <think>here</think>",
        False,
    )
    unfinished = parse_reply("still going", True, True, None)
    assert (unfinished.reasoning, unfinished.content) == ("still going", "")
    held = ChatOutputParser(True, False, None).feed("<thi")
    assert (held.reasoning, held.content) == ("", "")


def test_prompt_opens_reasoning() -> None:
    template = ChatTemplate(CHAT_TEMPLATE_PATH.read_text(encoding="utf-8"))
    user = [{"role": "user", "content": "hi"}]
    assert prompt_opens_reasoning(template.render(user))
    assert not prompt_opens_reasoning(template.render(user, enable_thinking=False))


@pytest.mark.parametrize(
    ("raw", "schema", "value"),
    [
        ("42", {"type": "string"}, "42"),
        (" 42 ", {"type": "integer"}, 42),
        ("4.0", {"type": "integer"}, 4),
        ("4.5", {"type": "number"}, 4.5),
        ("1e3", {"type": "number"}, 1000.0),
        ("True", {"type": "boolean"}, True),
        ("false", {"type": "boolean"}, False),
        ('{"a": [1, null]}', {"type": "object"}, {"a": [1, None]}),
        ("{'a': True}", {"type": "object"}, {"a": True}),
        ("[1, 'x']", {"type": "array"}, [1, "x"]),
        ("null", {"type": ["string", "null"]}, None),
        ("7", {"type": ["string", "null"]}, "7"),
        ("7", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 7),
        ("seven", {"type": "integer"}, "seven"),
        ("[1, 2", {"type": "array"}, "[1, 2"),
        ("42", None, 42),
        ("Paris", None, "Paris"),
        ('"quoted"', {}, "quoted"),
        ("7", {"enum": ["7", "8"]}, "7"),
        ("7", {"enum": [7, "8"]}, 7),
        ("null", {"const": "null"}, "null"),
    ],
)
def test_argument_values_are_typed_by_the_schema(raw: str, schema: Any, value: Any) -> None:
    assert typed_value(raw, schema) == value
    assert type(typed_value(raw, schema)) is type(value)


# ---- constraint grammars ----


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer_files(out)
    return out / "tokenizer.json"


@pytest.fixture(scope="module")
def tokenizer(tokenizer_file: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_file))


@pytest.fixture(scope="module")
def eos(tokenizer: Tokenizer) -> tuple[int, ...]:
    return tuple(tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>"))


def _accepts(grammar: str, tokenizer_file: Path, eos: tuple[int, ...], text: str) -> bool:
    """The grammar takes the text's tokens and is then complete."""
    ll_tokenizer = load_tokenizer(str(tokenizer_file), eos)
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
    tokens = ll_tokenizer.tokenize_str(text, parse_special=True)
    return all(matcher.consume_token(t) for t in tokens) and matcher.is_accepting()


def test_forced_tool_calls_grammar(
    tokenizer: Tokenizer, tokenizer_file: Path, eos: tuple[int, ...]
) -> None:
    tokens = GlmTokens.find(tokenizer)
    named = forced_tool_calls(TOOLS, "get_weather", True, tokens, after_think=True)
    grammar = grammar_of(SamplingParams(ebnf=named.text))
    call = (
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
    )
    assert _accepts(grammar, tokenizer_file, eos, "Let me see.</think>" + call)
    assert not _accepts(grammar, tokenizer_file, eos, call)  # the reasoning must close first
    assert not _accepts(grammar, tokenizer_file, eos, "</think>" + call.replace(">3<", ">x<"))
    assert not _accepts(grammar, tokenizer_file, eos, "</think>" + call + call)  # exactly one
    without_city = "</think><tool_call>get_weather</tool_call>"
    assert not _accepts(grammar, tokenizer_file, eos, without_city)
    required = forced_tool_calls(TOOLS, None, True, tokens, after_think=False)
    grammar = grammar_of(SamplingParams(ebnf=required.text))
    anything = "<tool_call>ping<arg_key>k</arg_key><arg_value>free text</arg_value></tool_call>"
    assert _accepts(grammar, tokenizer_file, eos, call + anything)
    assert not _accepts(grammar, tokenizer_file, eos, "plain text")
    single = forced_tool_calls(TOOLS, None, False, tokens, after_think=False)
    assert not _accepts(
        grammar_of(SamplingParams(ebnf=single.text)), tokenizer_file, eos, call + call
    )


def test_forced_tool_call_string_keywords(
    tokenizer: Tokenizer, tokenizer_file: Path, eos: tuple[int, ...]
) -> None:
    properties = {
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "mode": {"const": "fast"},
        "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "note": {"type": "string", "pattern": "ok"},
        "tag": {"type": "string", "minLength": 2, "maxLength": 3},
        "free": {"type": "string"},
    }
    parameters = {"type": "object", "properties": properties, "required": list(properties)}
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    grammar = grammar_of(
        SamplingParams(
            ebnf=forced_tool_calls(tools, "f", False, GlmTokens.find(tokenizer), False).text
        )
    )
    good = dict(unit="celsius", mode="fast", code="OSL", note="is ok here", tag="ab", free="<x>")

    def call(**values: str) -> str:
        args = "".join(
            f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>"
            for k, v in {**good, **values}.items()
        )
        return f"<tool_call>f{args}</tool_call>"

    assert _accepts(grammar, tokenizer_file, eos, call())
    assert _accepts(grammar, tokenizer_file, eos, call(unit="fahrenheit", tag="abc"))
    for bad in (
        {"unit": "kelvin"},
        {"unit": "celsiusx"},
        {"mode": "slow"},
        {"code": "OSLO"},
        {"code": "os"},
        {"note": "fine"},
        {"tag": "a"},
        {"tag": "abcd"},
    ):
        assert not _accepts(grammar, tokenizer_file, eos, call(**bad)), bad


def test_constraints_after_reasoning(
    tokenizer: Tokenizer, tokenizer_file: Path, eos: tuple[int, ...]
) -> None:
    tokens = GlmTokens.find(tokenizer)
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}})
    json_after = after_reasoning(Constraint("json_schema", schema), tokens)
    grammar = grammar_of(SamplingParams(ebnf=json_after.text))
    assert _accepts(grammar, tokenizer_file, eos, 'I think.</think>{"n":3}')
    assert not _accepts(grammar, tokenizer_file, eos, '{"n":3}')
    regex_after = after_reasoning(Constraint("regex", "(yes|no)/maybe"), tokens)
    grammar = grammar_of(SamplingParams(ebnf=regex_after.text))
    assert _accepts(grammar, tokenizer_file, eos, "hm</think>no/maybe")
    gbnf_after = after_reasoning(Constraint("ebnf", 'root ::= "{" ("a" | "b") "}"'), tokens)
    grammar = grammar_of(SamplingParams(ebnf=gbnf_after.text))
    assert _accepts(grammar, tokenizer_file, eos, "hm</think>{b}")


def test_requested_constraint() -> None:
    class Format:
        type = "json_object"
        json_schema = None

    assert requested_constraint(Format(), None, None, None) == Constraint(
        "json_schema", '{"type": "object"}'
    )
    assert requested_constraint(None, "a+", None, None) == Constraint("regex", "a+")
    assert requested_constraint(None, None, None, None) is None
    with pytest.raises(APIError):
        requested_constraint(Format(), "a+", None, None)
    with pytest.raises(GrammarError):
        grammar_of(SamplingParams(regex="a", ebnf="root ::= x"))


# ---- constrained sampling ----


def _decode_constrained(
    params: SamplingParams, tokenizer_file: Path, eos: tuple[int, ...], steps: int = 60
) -> tuple[list[int], dict[str, Any] | None]:
    sampler = Sampler(1024, "cpu", seed=0, tokenizer_file=str(tokenizer_file))
    state = SamplingState(params, [1, 2, 3], [], frozenset(eos))
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        logits = torch.randn(1, 1024, generator=gen) * 3
        token = sampler.sample(logits, [state])[0][0]
        state.output_ids.append(token)
        if (reason := state.grammar_finish_reason()) is not None or token in eos:
            return state.output_ids, reason
    return state.output_ids, None


def test_sampler_follows_a_json_schema(
    tokenizer: Tokenizer, tokenizer_file: Path, eos: tuple[int, ...]
) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, json_schema=json.dumps(schema))
        ids, reason = _decode_constrained(params, tokenizer_file, eos)
        assert reason == FinishReason.stop()
        value = json.loads(tokenizer.decode(ids))
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool)


def test_sampler_forces_tool_call_markup(
    tokenizer: Tokenizer, tokenizer_file: Path, eos: tuple[int, ...]
) -> None:
    properties = {
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "alerts": {"type": "boolean"},
    }
    parameters = {"type": "object", "properties": properties, "required": ["days", "alerts"]}
    tools = [{"type": "function", "function": {"name": "plan", "parameters": parameters}}]
    forced = forced_tool_calls(tools, "plan", False, GlmTokens.find(tokenizer), False)
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, ebnf=forced.text)
        ids, reason = _decode_constrained(params, tokenizer_file, eos)
        assert reason == FinishReason.stop()
        reply = parse_reply(tokenizer.decode(ids, skip_special_tokens=False), False, False, tools)
        (call,) = reply.tool_calls
        arguments = json.loads(call["function"]["arguments"])
        assert 1 <= arguments["days"] <= 9 and isinstance(arguments["alerts"], bool)


def test_grammar_catches_up_with_tokens_it_did_not_sample(
    tokenizer: Tokenizer, tokenizer_file: Path, eos: tuple[int, ...]
) -> None:
    sampler = Sampler(1024, "cpu", tokenizer_file=str(tokenizer_file))
    params = SamplingParams(temperature=0.0, regex="abc")
    state = SamplingState(params, [1], tokenizer.encode("a").ids, frozenset(eos))
    token = sampler.sample(torch.zeros(1, 1024), [state])[0][0]
    assert tokenizer.decode([token]) in ("b", "bc")


def test_sampler_without_a_tokenizer_aborts_constrained_requests(eos: tuple[int, ...]) -> None:
    state = SamplingState(SamplingParams(regex="a"), [1], [], frozenset(eos))
    Sampler(1024, "cpu").sample(torch.zeros(1, 1024), [state])
    reason = state.grammar_finish_reason()
    assert reason.kind == "abort" and "tokenizer" in reason.message

"""The OpenAI surface end to end: the real server, the official openai package as the client.

The server runs the scripted checkpoint (tests/scripted_checkpoint.py): greedy decoding
reasons "Hm", then calls `lookup` with ids [7, 8], so reasoning, tool calls, forced tool
choice and structured output are exercised through the real scheduler, sampler and front,
with the seed's `--reasoning-parser glm45 --tool-call-parser glm47`. The scenarios take a Peer
and run unchanged against a router + PD pair in test_openai_pd.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from serving.front.chat import ChatTemplate, load_chat_template
from tests.scripted_checkpoint import script_ids
from tests.server_proc import Server, eagle_flags

MODEL = "GLM-5.3-Flash"
CONTEXT = 1024
WORKER_FLAGS = (
    "--served-model-name",
    MODEL,
    "--reasoning-parser",
    "glm45",
    "--tool-call-parser",
    "glm47",
    "--context-length",
    str(CONTEXT),
)
USER = [{"role": "user", "content": "Look up items 7 and 8."}]
THINKING_OFF = {"chat_template_kwargs": {"enable_thinking": False}}
COMPLETION_PROMPT = "[gMASK]<sop><|user|>hi<|assistant|><think>"
CALL_MARKUP = "<tool_call>lookup<arg_key>ids</arg_key><arg_value>[7, 8]</arg_value></tool_call>"


def lookup_tool(ids_type: str) -> dict[str, Any]:
    properties = {"ids": {"type": ids_type}}
    if ids_type == "array":
        properties["ids"]["items"] = {"type": "integer"}
    return {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Fetch items by id",
            "parameters": {"type": "object", "properties": properties, "required": ["ids"]},
        },
    }


SET_FLAG = {
    "type": "function",
    "function": {
        "name": "set_flag",
        "parameters": {
            "type": "object",
            "properties": {"on": {"type": "boolean"}},
            "required": ["on"],
        },
    },
}


@dataclass
class Peer:
    """A client of a serving stack and what the tests need to predict its answers."""

    client: openai.OpenAI
    tokenizer: Tokenizer
    template: ChatTemplate

    def chat(self, **fields: Any) -> Any:
        body = {"model": MODEL, "messages": USER, "max_tokens": 64, "temperature": 0, **fields}
        return self.client.chat.completions.create(**body)

    def prompt_tokens(self, messages: list[dict[str, Any]], tools: Any = None, **kw: Any) -> int:
        prompt = self.template.render(messages, tools=tools, **kw)
        return len(self.tokenizer.encode(prompt, add_special_tokens=False).ids)

    @property
    def url(self) -> str:
        """The server's root (for SGLang's native routes)."""
        return str(self.client.base_url).rstrip("/").removesuffix("/v1")

    def reply_tokens(self, thinking: bool = True) -> int:
        """Output tokens of the script after the prompt's `<think>` (or `</think>`), eos too."""
        chain = script_ids(self.tokenizer)
        start = self.tokenizer.token_to_id("<think>" if thinking else "</think>")
        return len(chain) - 1 - chain.index(start)


def make_peer(url: str, checkpoint: Path) -> Peer:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    return Peer(client, tokenizer, load_chat_template(checkpoint))


def stream_choices(stream: Any) -> dict[Any, dict[str, Any]]:
    """Per choice index: reasoning, content, tool-call deltas, finish reasons; and "usage"."""
    out: dict[Any, Any] = {}
    for chunk in stream:
        if not chunk.choices and chunk.usage is not None:
            out["usage"] = chunk.usage
        for choice in chunk.choices:
            seen = out.setdefault(
                choice.index, {"reasoning": "", "content": "", "deltas": [], "finish": []}
            )
            seen["reasoning"] += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            seen["content"] += choice.delta.content or ""
            seen["deltas"] += choice.delta.tool_calls or []
            seen["finish"].append(choice.finish_reason)
    return out


# ---- scenarios ----


def scenario_models(peer: Peer) -> None:
    assert [m.id for m in peer.client.models.list().data] == [MODEL]
    card = peer.client.models.retrieve(MODEL)
    assert (card.id, card.model_extra["root"], card.model_extra["max_model_len"]) == (
        MODEL,
        MODEL,
        CONTEXT,
    )
    with pytest.raises(openai.NotFoundError):
        peer.client.models.retrieve("gpt-4o")
    info = httpx.get(peer.url + "/get_server_info", timeout=10).json()
    ready = info["scheduler"]
    assert info["max_total_num_tokens"] == ready["total_pages"] * ready["page_size"] > 0


def scenario_tool_call_round_trip(peer: Peer) -> None:
    tools = [lookup_tool("array")]
    first = peer.chat(tools=tools)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"] == "Hm"
    assert choice.message.content == ""
    (call,) = choice.message.tool_calls
    assert call.function.name == "lookup" and call.id
    assert json.loads(call.function.arguments) == {"ids": [7, 8]}  # typed by the schema
    assert first.usage.prompt_tokens == peer.prompt_tokens(USER, tools)
    assert first.usage.completion_tokens == peer.reply_tokens()
    assert first.usage.completion_tokens_details.reasoning_tokens == 2
    history = [
        *USER,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"7": "seven", "8": "eight"}'},
    ]
    second = peer.chat(tools=tools, messages=history)
    assert second.usage.prompt_tokens == peer.prompt_tokens(history, tools)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert second.choices[0].message.tool_calls[0].function.name == "lookup"


def scenario_streamed_tool_call(peer: Peer) -> None:
    stream = peer.chat(
        tools=[lookup_tool("string")], stream=True, stream_options={"include_usage": True}
    )
    seen = stream_choices(stream)
    choice = seen[0]
    assert choice["reasoning"] == "Hm" and choice["content"] == ""
    first, *rest = choice["deltas"]
    assert (first.index, first.type, first.function.name) == (0, "function", "lookup")
    assert first.id and all(d.id is None and d.function.name is None for d in rest)
    fragments = [d.function.arguments for d in choice["deltas"]]
    assert "".join(fragments) == '{"ids": "[7, 8]"}'  # a string parameter stays a string
    assert len([f for f in fragments if f]) >= 3
    assert choice["finish"][-1] == "tool_calls" and set(choice["finish"][:-1]) == {None}
    assert seen["usage"].completion_tokens == peer.reply_tokens()


def scenario_reasoning_split(peer: Peer) -> None:
    on = peer.chat()
    assert on.choices[0].message.model_extra["reasoning_content"] == "Hm"
    assert on.choices[0].message.content == CALL_MARKUP  # no tools: the markup is text
    assert on.usage.completion_tokens_details.reasoning_tokens == 2
    off = peer.chat(extra_body=THINKING_OFF)
    assert off.choices[0].message.model_extra.get("reasoning_content") is None
    assert off.choices[0].message.content == CALL_MARKUP
    assert off.usage.prompt_tokens == peer.prompt_tokens(USER, enable_thinking=False)
    assert off.usage.completion_tokens == peer.reply_tokens(thinking=False)
    streamed = stream_choices(peer.chat(stream=True))[0]
    assert (streamed["reasoning"], streamed["content"]) == ("Hm", CALL_MARKUP)
    joined = peer.chat(extra_body={"separate_reasoning": False}).choices[0].message
    assert joined.content == "Hm</think>" + CALL_MARKUP


def scenario_tool_choice(peer: Peer) -> None:
    tools = [lookup_tool("array"), SET_FLAG]
    named = {"type": "function", "function": {"name": "set_flag"}}
    forced = peer.chat(tools=tools, tool_choice=named).choices[0]
    (call,) = forced.message.tool_calls  # the model wanted `lookup`; the grammar says set_flag
    assert call.function.name == "set_flag"
    # `[7, 8]` cannot be a boolean: the runner-up `true` (tests/scripted_checkpoint.py) wins
    assert json.loads(call.function.arguments) == {"on": True}
    assert forced.message.model_extra["reasoning_content"] == "Hm"
    assert forced.finish_reason == "tool_calls"
    required = peer.chat(tools=tools, tool_choice="required", extra_body=THINKING_OFF).choices[0]
    (call,) = required.message.tool_calls  # json.dumps spacing `[7, 8]` passes the grammar
    assert (call.function.name, json.loads(call.function.arguments)) == ("lookup", {"ids": [7, 8]})
    assert required.finish_reason == "tool_calls"
    none = peer.chat(tools=tools, tool_choice="none").choices[0].message
    assert none.tool_calls is None and none.content == CALL_MARKUP


def scenario_forced_string_enum(peer: Peer) -> None:
    # Unforced, the script writes ids "[7, 8]"; forced, the string enum holds.
    tool = lookup_tool("string")
    tool["function"]["parameters"]["properties"]["ids"]["enum"] = ["seven", "eight"]
    named = {"type": "function", "function": {"name": "lookup"}}
    free = peer.chat(tools=[tool], extra_body=THINKING_OFF).choices[0].message.tool_calls[0]
    assert json.loads(free.function.arguments) == {"ids": "[7, 8]"}
    forced = peer.chat(tools=[tool], tool_choice=named, extra_body=THINKING_OFF).choices[0]
    (call,) = forced.message.tool_calls
    assert json.loads(call.function.arguments)["ids"] in ("seven", "eight")
    assert forced.finish_reason == "tool_calls"


def scenario_response_format(peer: Peer) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    choice = peer.chat(response_format=response_format).choices[0]
    assert choice.message.model_extra["reasoning_content"] == "Hm"  # free until </think>
    assert set(json.loads(choice.message.content)) == {"ok"}
    assert choice.finish_reason == "stop"
    plain = peer.chat(response_format={"type": "json_object"}, extra_body=THINKING_OFF)
    assert plain.choices[0].message.content.startswith("{")


def scenario_n_and_logprobs(peer: Peer) -> None:
    tools = [lookup_tool("array")]
    response = peer.chat(
        tools=tools, n=2, temperature=1.0, seed=3, logprobs=True, top_logprobs=3, user="tester"
    )
    assert [c.index for c in response.choices] == [0, 1]
    for choice in response.choices:
        assert choice.message.tool_calls[0].function.name == "lookup"
        content = choice.logprobs.content
        assert len(content) == peer.reply_tokens()
        assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token for e in content)
        assert all(-0.01 < e.logprob <= 0 for e in content)
    assert response.usage.completion_tokens == 2 * peer.reply_tokens()
    assert response.usage.prompt_tokens == peer.prompt_tokens(USER, tools)
    seen = stream_choices(peer.chat(tools=tools, n=2, stream=True))
    assert [seen[i]["finish"][-1] for i in (0, 1)] == ["tool_calls", "tool_calls"]


def scenario_stop(peer: Peer) -> None:
    cut = peer.chat(stop=["ids"]).choices[0]
    assert cut.finish_reason == "stop" and cut.model_extra["matched_stop"] == "ids"
    assert cut.message.content == "<tool_call>lookup<arg_key>"
    streamed = stream_choices(peer.chat(stop="ids", stream=True))[0]
    assert streamed["content"] == cut.message.content
    short = peer.chat(max_completion_tokens=3)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"


def scenario_completions(peer: Peer) -> None:
    prompt = "[gMASK]<sop><|user|>hi<|assistant|><think>"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0}
    raw = {"skip_special_tokens": False}
    response = peer.client.completions.create(**body, logprobs=2, n=2, extra_body=raw)
    expected = "Hm</think>" + CALL_MARKUP
    assert [c.text for c in response.choices] == [expected, expected]
    assert response.choices[0].finish_reason == "stop"
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.top_logprobs) == peer.reply_tokens()
    assert "".join(logprobs.tokens[:-1]) == expected  # the last is the end-of-turn token
    assert logprobs.text_offset[:2] == [0, len(logprobs.tokens[0])]
    assert response.usage.completion_tokens == 2 * peer.reply_tokens()
    assert response.usage.prompt_tokens == len(peer.tokenizer.encode(prompt).ids)
    echo = peer.client.completions.create(**body, echo=True)
    assert echo.choices[0].text.startswith(prompt)
    chunks = list(
        peer.client.completions.create(
            **body, stream=True, stream_options={"include_usage": True}, extra_body=raw
        )
    )
    assert "".join(c.text for chunk in chunks for c in chunk.choices) == expected
    assert chunks[-1].usage.completion_tokens == peer.reply_tokens()
    ids = peer.tokenizer.encode(prompt).ids
    by_ids = peer.client.completions.create(**{**body, "prompt": ids}, extra_body=raw)
    assert by_ids.choices[0].text == expected


def scenario_completion_batch_echo(peer: Peer) -> None:
    # SGLang's test_completion (batch x parallel samples, echo, logprobs) and vLLM's echo
    # logprob tests, with the script's exact replies.
    raw = {"skip_special_tokens": False}
    prompts = [COMPLETION_PROMPT, "[gMASK]<sop><|user|>bye<|assistant|></think>"]
    replies = ["Hm</think>" + CALL_MARKUP, CALL_MARKUP]
    body = {"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 40, "temperature": 0,
            "echo": True, "logprobs": 1, "extra_body": raw}  # fmt: skip
    response = peer.client.completions.create(**body)
    choices = sorted(response.choices, key=lambda c: c.index)
    assert [c.index for c in choices] == [0, 1, 2, 3]
    ids = [peer.tokenizer.encode(p).ids for p in prompts]
    for choice in choices:
        p = choice.index // 2
        assert choice.text == prompts[p] + replies[p]
        lp = choice.logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert "".join(lp.tokens[: len(ids[p])]) == prompts[p]
        assert "".join(lp.tokens[len(ids[p]) : -1]) == replies[p]  # then the end-of-turn token
        assert lp.text_offset[len(ids[p])] == len(prompts[p])
        assert all(x <= 0 for x in lp.token_logprobs[1:])
    reply_tokens = [len(choices[2 * p].logprobs.tokens) - len(ids[p]) for p in (0, 1)]
    assert reply_tokens[0] == peer.reply_tokens()
    assert response.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    assert response.usage.completion_tokens == 2 * sum(reply_tokens)
    streamed = ["", "", "", ""]
    for chunk in peer.client.completions.create(**body, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == [c.text for c in choices]
    with pytest.raises(openai.BadRequestError):
        peer.client.completions.create(**{**body, "logprobs": 21}, stream=True)


def scenario_logit_bias(peer: Peer) -> None:
    # After the prompt's <think> the script's "H" wins by 25 logits; "z" is nowhere in it.
    h = script_ids(peer.tokenizer)[1]
    z = peer.tokenizer.token_to_id("z")
    body = {"model": MODEL, "prompt": COMPLETION_PROMPT, "max_tokens": 4, "temperature": 0}
    assert peer.client.completions.create(**body).choices[0].text.startswith("Hm")
    forced = peer.client.completions.create(**body, logit_bias={str(z): 100})
    assert forced.choices[0].text == "zzzz"
    sampled = peer.client.completions.create(
        **{**body, "temperature": 1.0}, seed=5, logit_bias={str(z): 100}
    )
    assert sampled.choices[0].text == "zzzz"
    forbidden = peer.client.completions.create(**body, logprobs=0, logit_bias={str(h): -100})
    assert forbidden.choices[0].logprobs.tokens[0] != "H"
    chat = peer.chat(max_tokens=3, logit_bias={str(z): 100}, extra_body=THINKING_OFF)
    assert chat.choices[0].message.content == "zzz"
    native = {
        "text": COMPLETION_PROMPT,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0, "logit_bias": {str(z): 100}},
    }
    r = httpx.post(peer.url + "/generate", json=native, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == [z, z, z]
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        peer.client.completions.create(**body, logit_bias={str(len(peer.tokenizer.get_vocab())): 1})


def scenario_stop_regex(peer: Peer) -> None:
    raw = {"skip_special_tokens": False}
    body = {"model": MODEL, "prompt": COMPLETION_PROMPT, "max_tokens": 40, "temperature": 0}
    pattern = r"\[\d+,"  # spans the script's "[", "7", "," tokens
    cut = peer.client.completions.create(**body, extra_body={**raw, "stop_regex": pattern})
    choice = cut.choices[0]
    assert (choice.finish_reason, choice.model_extra["matched_stop"]) == ("stop", pattern)
    assert choice.text.endswith("<arg_value>[7,")  # the match stays, as SGLang
    chunks = peer.client.completions.create(
        **body, stream=True, extra_body={**raw, "stop_regex": [r"x{3}", pattern]}
    )
    assert "".join(c.text for chunk in chunks for c in chunk.choices) == choice.text
    chat = peer.chat(extra_body={**THINKING_OFF, "stop_regex": "lo+k"}).choices[0]
    assert chat.message.content == "<tool_call>look"
    assert chat.model_extra["matched_stop"] == "lo+k"
    sampling = {"max_new_tokens": 40, "temperature": 0, "stop_regex": "H.$"}
    native = {"text": COMPLETION_PROMPT, "sampling_params": sampling}
    result = httpx.post(peer.url + "/generate", json=native, timeout=60).json()
    assert result["meta_info"]["finish_reason"] == {"type": "stop", "matched": "H.$"}
    assert result["text"] == "Hm"
    with pytest.raises(openai.BadRequestError, match="stop_regex"):
        peer.client.completions.create(**body, extra_body={"stop_regex": "(unclosed"})


def scenario_stream_usage_and_logprobs(peer: Peer) -> None:
    raw = {"skip_special_tokens": False}
    body = {"model": MODEL, "prompt": COMPLETION_PROMPT, "max_tokens": 40, "temperature": 0}
    whole = peer.client.completions.create(**body, logprobs=0, extra_body=raw)
    logprobs = whole.choices[0].logprobs
    # logprobs=0: the chosen token's logprob, and it alone in the top list (OpenAI: n + 1 at most)
    assert [dict(t) for t in logprobs.top_logprobs] == [
        {token: lp} for token, lp in zip(logprobs.tokens, logprobs.token_logprobs)
    ]
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        peer.client.completions.create(
            **body, logprobs=0, stream=True, stream_options=options, extra_body=raw
        )
    )
    with_choices = [c for c in chunks if c.choices]
    assert all(c.choices[0].logprobs is not None for c in with_choices)
    tokens = [t for c in with_choices for t in c.choices[0].logprobs.tokens]
    assert tokens == logprobs.tokens
    last = with_choices[-1].choices[0]
    assert last.finish_reason == "stop" and last.logprobs.tokens == logprobs.tokens[-1:]
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == peer.reply_tokens()
    assert {c.usage.prompt_tokens for c in with_choices} == {whole.usage.prompt_tokens}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == counts[-1]
    plain = peer.client.completions.create(
        **body, stream=True, stream_options={"include_usage": True}
    )
    assert all(c.usage is None for c in plain if c.choices)
    chat = list(peer.chat(stream=True, stream_options=options))
    assert all(c.usage is not None for c in chat)
    assert chat[-2].usage.completion_tokens == peer.reply_tokens()


def scenario_responses(peer: Peer) -> None:
    chat_tools = [lookup_tool("array")]
    tools = [{"type": "function", **chat_tools[0]["function"]}]  # the Responses API's shape
    body = {"model": MODEL, "tools": tools, "max_output_tokens": 64, "temperature": 0}
    first = peer.client.responses.create(input=USER[0]["content"], **body)
    assert first.status == "completed" and first.id.startswith("resp_")
    assert [item.type for item in first.output] == ["reasoning", "function_call"]
    assert first.output[0].content[0].text == "Hm"
    call = first.output[1]
    assert call.name == "lookup" and json.loads(call.arguments) == {"ids": [7, 8]}
    assert first.usage.input_tokens == peer.prompt_tokens(USER, chat_tools)
    assert first.usage.output_tokens == peer.reply_tokens()
    assert first.usage.output_tokens_details.reasoning_tokens == 2
    # the round trip renders exactly the chat history it stands for
    result = '{"7": "seven", "8": "eight"}'
    output = {"type": "function_call_output", "call_id": call.call_id, "output": result}
    items = [{"role": "user", "content": USER[0]["content"]},
             *[item.model_dump(exclude_none=True) for item in first.output], output]  # fmt: skip
    second = peer.client.responses.create(input=items, **body)
    chat_call = {"id": call.call_id, "type": "function",
                 "function": {"name": "lookup", "arguments": call.arguments}}  # fmt: skip
    history = [*USER,
               {"role": "assistant", "content": "", "reasoning_content": "Hm",
                "tool_calls": [chat_call]},
               {"role": "tool", "tool_call_id": call.call_id, "content": result}]  # fmt: skip
    assert second.usage.input_tokens == peer.prompt_tokens(history, chat_tools)
    plain = peer.client.responses.create(
        model=MODEL, input=USER[0]["content"], instructions="Be brief.", temperature=0,
        extra_body=THINKING_OFF,
    )  # fmt: skip
    assert [item.type for item in plain.output] == ["message"]
    assert plain.output_text == CALL_MARKUP
    system = [{"role": "system", "content": "Be brief."}, *USER]
    assert plain.usage.input_tokens == peer.prompt_tokens(system, enable_thinking=False)
    cut = peer.client.responses.create(**{**body, "max_output_tokens": 3}, input="hi")
    assert (cut.status, cut.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    events = list(peer.client.responses.create(input=USER[0]["content"], stream=True, **body))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert (events[0].type, events[1].type, events[-1].type) == (
        "response.created",
        "response.in_progress",
        "response.completed",
    )
    by_type: dict[str, list[Any]] = {}
    for event in events:
        by_type.setdefault(event.type, []).append(event)
    assert "".join(e.delta for e in by_type["response.reasoning_text.delta"]) == "Hm"
    arguments = "".join(e.delta for e in by_type["response.function_call_arguments.delta"])
    assert arguments == by_type["response.function_call_arguments.done"][0].arguments
    assert json.loads(arguments) == {"ids": [7, 8]}
    done = [e.item.type for e in by_type["response.output_item.done"]]
    assert done == ["reasoning", "function_call"]
    final = events[-1].response
    assert [i.type for i in final.output] == done
    assert final.usage.output_tokens == peer.reply_tokens()
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        peer.client.responses.create(model=MODEL, input="hi", previous_response_id="resp_1")
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]
    with pytest.raises(openai.BadRequestError, match="input_image"):
        peer.client.responses.create(model=MODEL, input=image)


def scenario_errors(peer: Peer) -> None:
    bad = [
        {"temperature": -1},
        {"n": 0},
        {"logprobs": True, "top_logprobs": 21},
        {"tool_choice": "required"},
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
        {"max_tokens": CONTEXT},
    ]
    for fields in bad:
        with pytest.raises(openai.BadRequestError):
            peer.chat(**fields)
    with pytest.raises(openai.NotFoundError):
        peer.chat(model="gpt-4o")
    with pytest.raises(openai.NotFoundError):
        peer.client.completions.create(model="gpt-4o", prompt="hi")
    with pytest.raises(openai.BadRequestError):
        peer.client.completions.create(model=MODEL, prompt="hi", logprobs=21)


SCENARIOS: list[Callable[[Peer], None]] = [
    scenario_models,
    scenario_tool_call_round_trip,
    scenario_streamed_tool_call,
    scenario_reasoning_split,
    scenario_tool_choice,
    scenario_forced_string_enum,
    scenario_response_format,
    scenario_n_and_logprobs,
    scenario_stop,
    scenario_completions,
    scenario_completion_batch_echo,
    scenario_logit_bias,
    scenario_stop_regex,
    scenario_stream_usage_and_logprobs,
    scenario_responses,
    scenario_errors,
]


def scenario_id(scenario: Callable[[Peer], None]) -> str:
    return scenario.__name__.removeprefix("scenario_")


@pytest.fixture(scope="module")
def server(scripted_ckpt: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = Server(scripted_ckpt, *WORKER_FLAGS, log_dir=tmp_path_factory.mktemp("logs"))
    yield srv
    assert srv.stop() == 0


@pytest.mark.parametrize("scenario", SCENARIOS, ids=scenario_id)
def test_single_worker(server: Server, scripted_ckpt: Path, scenario) -> None:
    scenario(make_peer(server.url, scripted_ckpt))
    server.idle_pool()


def test_protocol_under_eagle(server: Server, scripted_ckpt: Path, tmp_path: Path) -> None:
    """EAGLE's verify samples with the request's bias: the forced and forbidden outputs are the
    plain worker's, token for token, although the draft proposes the unbiased script. Stop
    regexes, per-chunk usage and logprobs hold when a step commits several tokens."""
    eagle = Server(scripted_ckpt, *WORKER_FLAGS, *eagle_flags(2), log_dir=tmp_path)
    try:
        peer = make_peer(eagle.url, scripted_ckpt)
        scenario_logit_bias(peer)
        scenario_stop_regex(peer)
        scenario_stream_usage_and_logprobs(peer)
        scenario_completions(peer)
        h = script_ids(peer.tokenizer)[1]
        body = {"model": MODEL, "prompt": COMPLETION_PROMPT, "max_tokens": 24, "temperature": 0,
                "ignore_eos": True, "logit_bias": {str(h): -100}}  # fmt: skip
        want = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        got = httpx.post(eagle.url + "/v1/completions", json=body, timeout=60).json()
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert got["usage"]["completion_tokens"] == 24
        assert eagle.stats()["spec_verify_steps"] > 0
        eagle.idle_pool()
    finally:
        assert eagle.stop() == 0

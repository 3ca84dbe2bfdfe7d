from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jinja2
import pytest
from tokenizers import Tokenizer

from serving.front.chat import _raise_exception, _tojson
from serving.tools.tokenizer_build import (
    CHAT_TEMPLATE_PATH,
    SPECIAL_TOKENS,
    build_tokenizer,
    write_tokenizer_files,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
VOCAB_SIZE = 1024
FIRST_SPECIAL_ID = VOCAB_SIZE - len(SPECIAL_TOKENS)

TEXTS = [
    "Hello, world! The server returned 503 Service Unavailable.",
    "  leading spaces, trailing spaces  \n\ttabs\r\nand CRLF\n\n",
    'curl -d \'{"model": "tiny", "stream": true}\' http://localhost:8000/v1/chat/completions',
    "def f(x: int) -> int:\n    return x ** 2  # squares\n",
    "Café, naïve, résumé, Zürich, São Paulo, Kraków, jalapeño, crème brûlée.",
    "你好，世界！模型推理分为预填充和解码两个阶段。",
    "東京 Привет Καλημέρα שלום مرحبا",
    "Emoji: 🚀🙂☕🌧️👩‍💻🇯🇵 and symbols: €£¥ °C ≤ ≥ — … “quotes”",
    "\x00\x01 control bytes \x7f and a lone \u00ad soft hyphen",
    "",
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]

TOOL_CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich and 北京?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I need the tool.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": {"city": "Zürich", "days": 2, "opts": {"unit": "C"}},
                },
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "北京"}},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "sunny"}]},
    {
        "role": "assistant",
        "content": "<think>Both known.</think>\nCold in Zürich 🥶, sunny in 北京.",
    },
    {"role": "user", "content": "Thanks!"},
]

TOOL_CONVERSATION_TURNS = (
    "<|system|>Be brief."
    "<|user|>Weather in Zürich and 北京?"
    "<|assistant|><think>I need the tool.</think>"
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Zürich</arg_value>"
    '<arg_key>days</arg_key><arg_value>2</arg_value><arg_key>opts</arg_key><arg_value>{"unit": "C"}'
    "</arg_value></tool_call>"
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>北京</arg_value></tool_call>"
    '<|observation|><tool_response>{"temp": 3}</tool_response><tool_response>sunny</tool_response>'
    "<|assistant|><think>Both known.</think>Cold in Zürich 🥶, sunny in 北京."
    "<|user|>Thanks!"
    "<|assistant|><think>"
)

SYSTEM_USER = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]


def _template(fromjson: bool = False, **options: Any) -> jinja2.Template:
    env = jinja2.Environment(**options)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    if fromjson:
        env.filters["fromjson"] = json.loads
    return env.from_string(CHAT_TEMPLATE_PATH.read_text(encoding="utf-8"))


def render(messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return _template(trim_blocks=True, lstrip_blocks=True).render(messages=messages, **kwargs)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return build_tokenizer(VOCAB_SIZE)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    out = tmp_path_factory.mktemp("tokenizer")
    return out, write_tokenizer_files(out, VOCAB_SIZE)


def test_vocab_size_is_exact(tokenizer: Tokenizer) -> None:
    assert tokenizer.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    assert tokenizer.get_vocab_size(with_added_tokens=False) == FIRST_SPECIAL_ID
    assert sorted(tokenizer.get_vocab().values()) == list(range(VOCAB_SIZE))
    assert build_tokenizer(2048).get_vocab_size() == 2048


def test_build_is_deterministic(tokenizer: Tokenizer) -> None:
    assert build_tokenizer(VOCAB_SIZE).to_str() == tokenizer.to_str()
    # A fresh single-threaded process gets new hash seeds and another split of the training work.
    script = (
        "import sys; from serving.tools.tokenizer_build import build_tokenizer; "
        f"sys.stdout.write(build_tokenizer({VOCAB_SIZE}).to_str())"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "RAYON_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, check=True
    )
    assert result.stdout.decode("utf-8") == tokenizer.to_str()


def test_special_tokens_are_single_ids_at_the_end(tokenizer: Tokenizer) -> None:
    expected = list(range(FIRST_SPECIAL_ID, VOCAB_SIZE))
    assert [tokenizer.token_to_id(token) for token in SPECIAL_TOKENS] == expected
    for token, token_id in zip(SPECIAL_TOKENS, expected, strict=True):
        assert tokenizer.encode(token).ids == [token_id]
        assert tokenizer.id_to_token(token_id) == token
    embedded = tokenizer.encode("x[gMASK]<sop>y</think>z/nothink").tokens
    assert embedded[1:3] == ["[gMASK]", "<sop>"]
    assert "</think>" in embedded and "/nothink" in embedded


def test_no_automatic_bos_or_eos(tokenizer: Tokenizer) -> None:
    assert tokenizer.post_processor is None
    assert all(i < FIRST_SPECIAL_ID for i in tokenizer.encode("hi").ids)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_is_lossless(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_decode_skips_special_tokens(tokenizer: Tokenizer) -> None:
    text = "[gMASK]<sop><|user|>Hallo, 世界 🙂<|assistant|><think>hm</think>Done<|endoftext|>"
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Hallo, 世界 🙂hmDone"


def test_written_files_are_consistent(written: tuple[Path, dict[str, int]]) -> None:
    out, special_ids = written
    assert special_ids == {t: FIRST_SPECIAL_ID + i for i, t in enumerate(SPECIAL_TOKENS)}
    assert (out / "chat_template.jinja").read_bytes() == CHAT_TEMPLATE_PATH.read_bytes()

    tokenizer_json = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    added = {entry["id"]: entry for entry in tokenizer_json["added_tokens"]}
    config = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    decoder = {int(k): v for k, v in config["added_tokens_decoder"].items()}
    assert decoder.keys() == added.keys() == set(special_ids.values())
    for token_id, entry in decoder.items():
        assert entry == {k: added[token_id][k] for k in entry}
        assert entry["special"] and not entry["normalized"]
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["eos_token"] == config["pad_token"] == "<|endoftext|>"
    assert config["clean_up_tokenization_spaces"] is False

    special_map = json.loads((out / "special_tokens_map.json").read_text(encoding="utf-8"))
    assert special_map["eos_token"] == "<|endoftext|>"
    assert set(special_map["additional_special_tokens"]) == set(SPECIAL_TOKENS) - {"<|endoftext|>"}


def test_chat_system_user() -> None:
    assert render(SYSTEM_USER) == "[gMASK]<sop><|system|>S<|user|>hi"
    thinking = render(SYSTEM_USER, add_generation_prompt=True)
    assert thinking == "[gMASK]<sop><|system|>S<|user|>hi<|assistant|><think>"
    assert render(SYSTEM_USER, add_generation_prompt=True, enable_thinking=True) == thinking
    no_thinking = render(SYSTEM_USER, add_generation_prompt=True, enable_thinking=False)
    assert no_thinking == "[gMASK]<sop><|system|>S<|user|>hi<|assistant|></think>"


def test_chat_tools_calls_and_results() -> None:
    rendered = render(TOOL_CONVERSATION, tools=TOOLS, add_generation_prompt=True)
    function_json = json.dumps(TOOLS[0]["function"], ensure_ascii=False)
    assert rendered.startswith("[gMASK]<sop><|system|>\n# Tools\n")
    assert f"<tools>\n{function_json}\n</tools>\n" in rendered
    assert (
        "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}"
        "</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>..."
        "</tool_call>"
    ) in rendered
    tools_block, turns = rendered.split("...</tool_call>", 1)
    assert "<|user|>" not in tools_block
    assert turns == TOOL_CONVERSATION_TURNS


def test_chat_thinking_history() -> None:
    history = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": " b ", "reasoning_content": "r"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    assert render(history) == (
        "[gMASK]<sop><|user|>a<|assistant|><think>r</think>b<|user|>c<|assistant|></think>d"
    )
    cleared = render(history, clear_thinking=True)
    assert cleared == "[gMASK]<sop><|user|>a<|assistant|></think>b<|user|>c<|assistant|></think>d"
    # Only turns before the last user message lose their reasoning.
    tail = render(TOOL_CONVERSATION[:-1], clear_thinking=True)
    assert "<think>I need the tool.</think>" in tail and "<think>Both known.</think>" in tail


def test_chat_json_string_arguments() -> None:
    calls = [
        {
            "function": {
                "name": tc["function"]["name"],
                "arguments": json.dumps(tc["function"]["arguments"]),
            }
        }
        for tc in TOOL_CONVERSATION[2]["tool_calls"]
    ]
    as_string = [*TOOL_CONVERSATION[:2], {**TOOL_CONVERSATION[2], "tool_calls": calls}]
    as_string += TOOL_CONVERSATION[3:]
    expected = render(TOOL_CONVERSATION, tools=TOOLS)
    decoding = _template(fromjson=True, trim_blocks=True, lstrip_blocks=True)
    assert decoding.render(messages=as_string, tools=TOOLS) == expected
    with pytest.raises(jinja2.TemplateError, match="must be a mapping"):
        render(as_string, tools=TOOLS)


def test_chat_rejects_unknown_roles() -> None:
    with pytest.raises(jinja2.TemplateError, match="unsupported message role"):
        render([{"role": "developer", "content": "x"}])


@pytest.mark.parametrize("options", [{}, {"trim_blocks": True}, {"lstrip_blocks": True}], ids=str)
def test_chat_ignores_whitespace_options(options: dict[str, bool]) -> None:
    kwargs = {"tools": TOOLS, "add_generation_prompt": True}
    expected = render(TOOL_CONVERSATION, **kwargs)
    assert _template(**options).render(messages=TOOL_CONVERSATION, **kwargs) == expected


def test_rendered_chat_tokenizes_specials_atomically(tokenizer: Tokenizer) -> None:
    rendered = render(TOOL_CONVERSATION, tools=TOOLS, add_generation_prompt=True)
    ids = tokenizer.encode(rendered).ids
    assert ids[:3] == [tokenizer.token_to_id(t) for t in ("[gMASK]", "<sop>", "<|system|>")]
    assert ids[-2:] == [tokenizer.token_to_id(t) for t in ("<|assistant|>", "<think>")]
    assert tokenizer.decode(ids, skip_special_tokens=False) == rendered


@pytest.mark.parametrize(
    ("messages", "kwargs"),
    [
        (SYSTEM_USER, {"add_generation_prompt": True}),
        (SYSTEM_USER, {"add_generation_prompt": True, "enable_thinking": False}),
        (TOOL_CONVERSATION, {"tools": TOOLS, "add_generation_prompt": True}),
        (TOOL_CONVERSATION, {"tools": TOOLS, "clear_thinking": True}),
    ],
)
def test_transformers_renders_like_jinja2(
    tokenizer: Tokenizer,
    written: tuple[Path, dict[str, int]],
    messages: list[dict[str, Any]],
    kwargs: dict[str, Any],
) -> None:
    transformers = pytest.importorskip("transformers")
    out, special_ids = written
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(out / "tokenizer.json"),
        chat_template=(out / "chat_template.jinja").read_text(encoding="utf-8"),
        eos_token="<|endoftext|>",
    )
    rendered = hf.apply_chat_template(messages, tokenize=False, **kwargs)
    assert rendered == render(messages, **kwargs)
    assert hf.encode(rendered, add_special_tokens=True) == tokenizer.encode(rendered).ids

    loaded = transformers.AutoTokenizer.from_pretrained(out)
    assert loaded.apply_chat_template(messages, tokenize=False, **kwargs) == rendered
    assert loaded.eos_token_id == loaded.pad_token_id == special_ids["<|endoftext|>"]
    assert len(loaded) == VOCAB_SIZE

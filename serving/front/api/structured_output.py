"""Output constraints of a request, as SamplingParams' json_schema / regex / ebnf.

`response_format` (json_object, json_schema) and SGLang's `regex` / `ebnf` / `json_schema`
constrain the reply; tool_choice "required" or a named function forces GLM tool-call markup
(SGLang forces its tool parser's format the same way). When the reply starts inside `<think>`
and its reasoning is split off, the constraint applies after `</think>` (SGLang's
reasoning-aware grammars do the same); such a constraint is written as one Lark grammar.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark
from tokenizers import Tokenizer

from serving.executor.constrained import JSON_OPTIONS
from serving.front.api.errors import APIError
from serving.front.api.tool_schema import function_schemas, schema_types

# The reasoning before </think>: any text (special tokens never match a regex).
_REASONING = "REASONING: /(?s:.*)/"


@dataclass(frozen=True)
class GlmTokens:
    """Token ids of GLM's markup, written into grammars as `<[id]>`."""

    think_end: int
    call_start: int
    call_end: int
    key_start: int
    key_end: int
    value_start: int
    value_end: int

    @classmethod
    def find(cls, tokenizer: Tokenizer) -> GlmTokens | None:
        names = ("</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>")
        names += ("<arg_value>", "</arg_value>")
        ids = [tokenizer.token_to_id(name) for name in names]
        return None if None in ids else cls(*ids)


@dataclass(frozen=True)
class Constraint:
    field: str  # "json_schema" | "regex" | "ebnf"
    text: str


def requested_constraint(
    response_format: Any, regex: str | None, ebnf: str | None, json_schema: str | None
) -> Constraint | None:
    """The one constraint the request's fields ask for (APIError 400 for several)."""
    asked: list[tuple[str, Constraint]] = []
    kind = response_format.type if response_format is not None else "text"
    if kind == "json_object":
        asked.append(("response_format", Constraint("json_schema", '{"type": "object"}')))
    elif kind == "json_schema":
        spec = response_format.json_schema
        if spec is None or spec.schema_ is None:
            raise APIError(
                400, "response_format: json_schema needs json_schema.schema", "response_format"
            )
        asked.append(("response_format", Constraint("json_schema", json.dumps(spec.schema_))))
    for name, text in (("regex", regex), ("ebnf", ebnf), ("json_schema", json_schema)):
        if text is not None:
            asked.append((name, Constraint(name, text)))
    if len(asked) > 1:
        raise APIError(400, f"{asked[0][0]}: cannot be combined with {asked[1][0]}", asked[1][0])
    return asked[0][1] if asked else None


def after_reasoning(constraint: Constraint, tokens: GlmTokens) -> Constraint:
    """The same constraint, applied only after the reasoning's `</think>`."""
    if constraint.field == "json_schema":
        answer = f"%json {json.dumps(_json_schema(constraint.text))}"
    elif constraint.field == "regex":
        answer = f"/{llguidance.regex_to_lark(constraint.text)}/"
    else:
        try:
            answer = "%lark {\n" + any_to_lark(constraint.text) + "\n}"
        except Exception as e:  # the converter raises its own error types
            raise APIError(400, f"ebnf: {e}", "ebnf") from e
    grammar = f"start: REASONING <[{tokens.think_end}]> answer\n{_REASONING}\nanswer: {answer}\n"
    return Constraint("ebnf", grammar)


def forced_tool_calls(
    tools: Sequence[Mapping[str, Any]],
    name: str | None,
    parallel: bool,
    tokens: GlmTokens,
    after_think: bool,
) -> Constraint:
    """A grammar whose only replies are tool calls: of function `name` (exactly one), or of any
    tool (one or more; one when not `parallel`). Arguments follow the schema's property order,
    required ones always there; string values are raw text held to the schema's string keywords
    (_text_value), others JSON of their schema."""
    functions = function_schemas(tools)
    chosen = [name] if name is not None else list(functions)
    calls = "call" if name is not None or not parallel else "call+"
    reasoning = f"REASONING <[{tokens.think_end}]> " if after_think else ""
    rules = [f"start: {reasoning}{calls}"]
    rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(chosen))))
    for i, function in enumerate(chosen):
        args = _argument_rules(f"call_{i}", functions[function], tokens)
        rules.append(
            f"call_{i}: <[{tokens.call_start}]> {_lark_string(function)} {args[0]}"
            f" <[{tokens.call_end}]>"
        )
        rules += args[1:]
    rules += [_REASONING, "TEXT: /(?s:.*)/", "KEY: /[^<>]+/"]
    return Constraint("ebnf", "\n".join(rules) + "\n")


def _argument_rules(call: str, parameters: Mapping[str, Any], tokens: GlmTokens) -> list[str]:
    """[the arguments' expansion in the call rule, then one rule per argument]."""
    properties = parameters.get("properties")
    if not isinstance(properties, Mapping):  # no declared parameters: any key, any text
        any_arg = _argument(tokens, "KEY", "TEXT")
        return [f"{call}_any*", f"{call}_any: {any_arg}"]
    required = set(parameters.get("required") or ())
    expansion, rules = [], []
    for j, (key, schema) in enumerate(properties.items()):
        rule = f"{call}_{j}"
        expansion.append(rule if key in required else f"{rule}?")
        value = (
            _text_value(schema)
            if _is_text(schema)
            else f"%json {json.dumps(_json_schema(schema, parameters))}"
        )
        rules.append(f"{rule}: {_argument(tokens, _lark_string(key), value)}")
    return [" ".join(expansion), *rules]


def _argument(tokens: GlmTokens, key: str, value: str) -> str:
    return (
        f"<[{tokens.key_start}]> {key} <[{tokens.key_end}]> "
        f"<[{tokens.value_start}]> {value} <[{tokens.value_end}]>"
    )


def _text_value(schema: Any) -> str:
    """A raw-text value (GLM writes strings unquoted) held to the schema's string keywords:
    a string const or an enum of strings is one of those literals; else `pattern` (JSON
    Schema's: a search, unless anchored at both ends), else minLength / maxLength; else any
    text. `pattern` with a length bound keeps the pattern only (a lexeme is one regex here)."""
    if not isinstance(schema, Mapping):
        return "TEXT"
    if isinstance(schema.get("const"), str):
        return _literals([schema["const"]])
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return _literals(enum)
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        return f"/{_search_regex(pattern)}/"
    low, high = schema.get("minLength"), schema.get("maxLength")
    if isinstance(low, int) or isinstance(high, int):
        bounds = f"{low if isinstance(low, int) else 0},{high if isinstance(high, int) else ''}"
        return f"/(?s:.{{{bounds}}})/"
    return "TEXT"


def _literals(values: Sequence[str]) -> str:
    """One of the strings; an empty one makes the choice optional (Lark has no empty literal)."""
    words = [v for v in dict.fromkeys(values) if v]
    if not words:
        return ""  # only "" allowed: no value text at all
    choice = "(" + " | ".join(_lark_string(v) for v in words) + ")"
    return choice + "?" if "" in values else choice


def _search_regex(pattern: str) -> str:
    """JSON Schema's `pattern` (it matches anywhere in the value) as a whole-value regex."""
    start = pattern.startswith("^")
    end = pattern.endswith("$") and not pattern.endswith("\\$")
    body = pattern[1 if start else 0 : len(pattern) - 1 if end else len(pattern)]
    anything = "(?s:.*)"
    regex = ("" if start else anything) + f"(?:{body})" + ("" if end else anything)
    return llguidance.regex_to_lark(regex)


def _is_text(schema: Any) -> bool:
    """A value written as raw text: a string, or anything the schema does not pin to JSON."""
    types = schema_types(schema) if isinstance(schema, Mapping) else set()
    return not types or "string" in types


def _json_schema(schema: str | Mapping[str, Any], root: Mapping[str, Any] | None = None) -> Any:
    """A schema for `%json`, with the root's definitions and our JSON options."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise APIError(400, f"json_schema: not valid JSON ({e})", "json_schema") from e
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    for defs in ("$defs", "definitions"):
        if root is not None and defs in root and defs not in out:
            out[defs] = root[defs]
    out["x-guidance"] = {**JSON_OPTIONS, **(schema.get("x-guidance") or {})}
    return out


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)

"""A tool's parameters as its JSON schema types them: the tools' schemas by function name,
the JSON types a schema admits, and a raw tool-call argument value typed by them (GLM's
tool-call markup carries every value as text)."""

from __future__ import annotations

import ast
import json
from collections.abc import Iterable, Mapping
from typing import Any


def function_schemas(tools: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> parameters schema of each tool ({"type": "function", "function": {...}})."""
    out = {}
    for tool in tools:
        function = tool.get("function") or tool
        out[function.get("name")] = function.get("parameters") or {}
    return out


def schema_types(schema: Mapping[str, Any] | None) -> set[str]:
    """The JSON types a schema admits ("type", or its anyOf / oneOf members); empty = any."""
    if not schema:
        return set()
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    types: set[str] = set()
    for member in [*(schema.get("anyOf") or []), *(schema.get("oneOf") or [])]:
        if isinstance(member, Mapping):
            types |= schema_types(member)
    return types


def _string_choices(schema: Mapping[str, Any] | None) -> list[str]:
    """The strings a schema's const / enum allow."""
    if not schema:
        return []
    values = [schema["const"]] if "const" in schema else schema.get("enum") or []
    return [v for v in values if isinstance(v, str)] if isinstance(values, list) else []


def typed_value(raw: str, schema: Mapping[str, Any] | None) -> Any:
    """A raw argument value as the parameter's schema types it; the raw text when it does not
    parse as one of them."""
    types = schema_types(schema)
    if types == {"string"} or raw in _string_choices(schema):
        return raw  # an untyped enum of strings ["7", "8"] keeps "7" a string
    text = raw.strip()
    try:
        value = json.loads(text)
        if isinstance(value, float) and value.is_integer() and types == {"integer"}:
            value = int(value)  # 4.0 for an integer parameter
        if not types or _json_types(value) & types:
            return value
    except json.JSONDecodeError:
        pass
    if types & {"object", "array"}:
        try:  # Python literals: {'a': 1}, [True, None]
            value = ast.literal_eval(text)
            if isinstance(value, (dict, list)):
                return value
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            pass
    lowered = text.lower()
    if "boolean" in types and lowered in ("true", "false"):
        return lowered == "true"
    if "null" in types and lowered in ("null", "none"):
        return None
    if types & {"integer", "number"}:
        try:
            number = float(text)
            if number.is_integer() and "integer" in types:
                return int(number)
            if "number" in types:
                return number
        except ValueError:
            pass
    return raw


def _json_types(value: Any) -> set[str]:
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number", "integer"} if value.is_integer() else {"number"}
    if isinstance(value, str):
        return {"string"}
    if isinstance(value, list):
        return {"array"}
    if isinstance(value, dict):
        return {"object"}
    return {"null"}

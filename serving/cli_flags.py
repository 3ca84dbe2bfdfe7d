"""An argparse parser built from a dataclass's fields: one --dashed-flag per field, its
default, and the `help` and `choices` of the field's metadata. A bool field is a store_true
switch; an optional string's "none" or "null" on the command line means unset."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any


def dataclass_parser(cls: type, prog: str, description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=description)
    for f in dataclasses.fields(cls):
        flag = "--" + dash(f.name)
        meta = dict(f.metadata)
        kwargs: dict[str, Any] = {"help": meta.get("help")}
        if "choices" in meta:
            kwargs["choices"] = meta["choices"]
        default = None if f.default is dataclasses.MISSING else f.default
        if f.type in ("bool", bool):
            ap.add_argument(flag, action="store_true", help=kwargs["help"])
            continue
        kwargs["type"] = _parse_type(f.type)
        if default is dataclasses.MISSING or f.default is dataclasses.MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = default
        ap.add_argument(flag, **kwargs)
    return ap


def dash(name: str) -> str:
    return name.replace("_", "-")


def _parse_type(annotation: Any):
    text = str(annotation)
    if "int" in text and "str" not in text:
        return int
    if "float" in text:
        return float
    if "None" in text:  # optional strings: "none"/"null" on the command line mean unset
        return lambda s: None if s.lower() in ("none", "null") else s
    return str

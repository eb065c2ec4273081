"""Parsing an untrusted JSON request body without letting it reach a 500.

`parse_json_object(raw)` is json.loads with the checks that keep hostile bodies out of the
parser's and the tokenizer's failure modes, each a 400 (InvalidRequestError) naming the problem:
- not UTF-8 (JSON must be, RFC 8259; json.loads would also guess UTF-16/32);
- nested deeper than MAX_JSON_DEPTH, counted on the raw bytes before parsing (the C parser
  and every recursive validator after it would otherwise hit RecursionError);
- NaN / Infinity literals (not JSON);
- not an object;
- a lone surrogate (a `\\ud800` escape with no partner), which no tokenizer can encode: the
  error names the field where it was found.
"""
from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from tessellm.errors import InvalidRequestError

MAX_JSON_DEPTH = 128
# a JSON string, unrolled so that the engine does not backtrack per character
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_OPEN, _CLOSE = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in `raw` (brackets inside strings ignored)."""
    skeleton = np.frombuffer(_STRING.sub(b'""', raw), np.uint8)
    steps = np.isin(skeleton, _OPEN).astype(np.int32) - np.isin(skeleton, _CLOSE)
    return int(np.cumsum(steps).max(initial=0))


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def _find_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string (or key) holding a lone surrogate, else None."""
    if isinstance(value, str):
        return path if _LONE_SURROGATE.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if _LONE_SURROGATE.search(key):
                return where
            found = _find_surrogate(item, where)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, (str, dict, list)):
                found = _find_surrogate(item, f"{path}.{i}")
                if found is not None:
                    return found
    return None


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a dict; InvalidRequestError (a 400) for every problem of the docstring."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequestError(f"the request body is not valid UTF-8: {e}") from None
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise InvalidRequestError(f"the request body nests arrays and objects {depth} deep; "
                                  f"at most {MAX_JSON_DEPTH} levels are accepted")
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except ValueError as e:
        raise InvalidRequestError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise InvalidRequestError(
            f"the request body must be a JSON object, not {type(data).__name__}")
    if _SURROGATE_ESCAPE.search(raw):   # only escapes can make one; a decoded body has none
        where = _find_surrogate(data, "")
        if where is not None:
            raise InvalidRequestError(f"{where} contains a lone UTF-16 surrogate, which is not "
                                      "text", where)
    return data

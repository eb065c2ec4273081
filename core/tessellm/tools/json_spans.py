"""Spans of JSON values in a text that may still be growing (a model's output mid-stream).

`value_end(text, i)` is the index just past the JSON value that starts at `i` (whitespace
skipped first), or None while it is not complete; a value that cannot be JSON raises
JSONSpanError. A number or literal at the very end of the text is incomplete (more digits may
come). `object_members(text, i)` walks the members of the object whose `{` is at `i`:
(key, value start, value end or None); it stops at the first incomplete member. Neither decodes
values (json.loads does, on a complete span), and neither recurses: nesting is counted.
"""
from __future__ import annotations

from collections.abc import Iterator

WHITESPACE = " \t\n\r"
_LITERAL_CHARS = frozenset("0123456789+-.eEtrufalsn")


class JSONSpanError(ValueError):
    """The text at this position is not JSON."""


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """Past the closing quote of the string whose opening quote is at i; None if open."""
    j = i + 1
    while True:
        k = text.find('"', j)
        if k < 0:
            return None
        backslashes = 0
        while text[k - 1 - backslashes] == "\\":
            backslashes += 1
        if backslashes % 2 == 0:
            return k + 1
        j = k + 1


def value_end(text: str, i: int) -> int | None:
    i = skip_ws(text, i)
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    if c in _LITERAL_CHARS:
        j = i
        while j < len(text) and text[j] in _LITERAL_CHARS:
            j += 1
        return j if j < len(text) else None
    raise JSONSpanError(f"not JSON at {i}: {text[i:i + 20]!r}")


def object_members(text: str, i: int) -> Iterator[tuple[str, int, int | None]]:
    """(key, value start, value end or None) for each member of the object at `i` (a `{`),
    up to the first one not complete; raises JSONSpanError on a malformed object."""
    import json
    if text[i] != "{":
        raise JSONSpanError(f"not an object at {i}")
    j = skip_ws(text, i + 1)
    if j < len(text) and text[j] == "}":
        return
    while j < len(text):
        if text[j] != '"':
            raise JSONSpanError(f"expected a key at {j}: {text[j:j + 20]!r}")
        key_end = _string_end(text, j)
        if key_end is None:
            return
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text):
            return
        if text[j] != ":":
            raise JSONSpanError(f"expected ':' at {j}")
        start = skip_ws(text, j + 1)
        if start >= len(text):
            return
        end = value_end(text, start)
        yield key, start, end
        if end is None:
            return
        j = skip_ws(text, end)
        if j >= len(text):
            return
        if text[j] == "}":
            return
        if text[j] != ",":
            raise JSONSpanError(f"expected ',' or '}}' at {j}")
        j = skip_ws(text, j + 1)

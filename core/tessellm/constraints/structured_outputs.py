"""StructuredOutputs: what a request asks its output to be, as vLLM's `structured_outputs`.

Exactly one kind is set:
- `json`: a JSON schema (a dict, or its text); `json_object`: any JSON object;
- `regex`: a regular expression the whole output must match (Rust regex syntax);
- `choice`: the output is exactly one of these strings;
- `grammar`: a context-free grammar, Lark (llguidance's dialect) or GBNF (llama.cpp's; told
  apart by its `::=` rules).
Between JSON tokens a gap holds at most one line break and MAX_JSON_INDENT spaces or tabs
(JSON_WHITESPACE: compact and pretty-printed JSON both fit, but a model cannot run away into
endless newlines, the classic failure of JSON modes), or nothing with `disable_any_whitespace`
(vLLM's option): `{"a":1}`.
`key()` is the canonical text the compiler caches under; `to_grammar()` the llguidance grammar
(unvalidated: GrammarCompiler validates).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from tessellm.errors import InvalidRequestError

MAX_CHOICES = 1024
MAX_TEXT_CHARS = 256 * 1024   # a schema, regex or grammar
MAX_JSON_INDENT = 20
JSON_WHITESPACE = rf"(?:\x0D?\x0A)?[\x20\x09]{{0,{MAX_JSON_INDENT}}}"
KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _json_options(compact: bool) -> dict[str, Any]:
    if compact:
        return {"whitespace_flexible": False}
    return {"whitespace_pattern": JSON_WHITESPACE}


@dataclass(slots=True, frozen=True)
class StructuredOutputs:
    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    _key: str = field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                f"structured outputs need exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(given) or 'none'}", "structured_outputs")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}",
                                              "structured_outputs.json") from None
            if not isinstance(value, (dict, bool)):
                raise InvalidRequestError("a JSON schema must be an object (or true/false)",
                                          "structured_outputs.json")
        elif kind == "json_object":
            if value is not True:
                raise InvalidRequestError("json_object must be true", "structured_outputs")
        elif kind == "choice":
            if not isinstance(value, (list, tuple)) or not value or \
                    not all(isinstance(c, str) and c for c in value):
                raise InvalidRequestError("choice must be a non-empty list of non-empty strings",
                                          "structured_outputs.choice")
            if len(value) > MAX_CHOICES:
                raise InvalidRequestError(f"at most {MAX_CHOICES} choices, got {len(value)}",
                                          "structured_outputs.choice")
            value = list(value)
        elif not isinstance(value, str) or not value:
            raise InvalidRequestError(f"{kind} must be a non-empty string",
                                      f"structured_outputs.{kind}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise InvalidRequestError("disable_any_whitespace must be a boolean",
                                      "structured_outputs.disable_any_whitespace")
        text = json.dumps(value, sort_keys=True, ensure_ascii=False)
        if len(text) > MAX_TEXT_CHARS:
            raise InvalidRequestError(f"the {kind} constraint is {len(text)} characters; at most "
                                      f"{MAX_TEXT_CHARS}", f"structured_outputs.{kind}")
        object.__setattr__(self, kind, value)
        object.__setattr__(self, "_key", json.dumps(
            [kind, value, self.disable_any_whitespace], sort_keys=True, ensure_ascii=False))

    @classmethod
    def from_value(cls, value: StructuredOutputs | dict[str, Any] | None
                   ) -> StructuredOutputs | None:
        """A StructuredOutputs from itself or its field dict (how it crosses to the core)."""
        if value is None or isinstance(value, StructuredOutputs):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError(f"structured_outputs must be an object, got "
                                      f"{type(value).__name__}", "structured_outputs")
        unknown = set(value) - set(KINDS) - {"disable_any_whitespace", "_key"}
        if unknown:
            raise InvalidRequestError(f"unknown structured_outputs fields: {sorted(unknown)}",
                                      "structured_outputs")
        return cls(**{k: v for k, v in value.items() if k != "_key"})

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        return self._key

    def to_wire(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "_key" and v not in (None, False)}

    def to_grammar(self) -> str:
        """The llguidance grammar (not yet validated)."""
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import any_to_lark
        kind, value = self.kind, getattr(self, self.kind)
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else value
            return LLMatcher.grammar_from_json_schema(
                schema, defaults=_json_options(self.disable_any_whitespace))
        if kind == "regex":
            return LLMatcher.grammar_from_regex(value)
        if kind == "choice":
            return LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))
        try:
            lark = any_to_lark(value)   # GBNF (rules with ::=) to Lark; Lark passes through
        except Exception as e:   # the converter raises plain Exceptions
            raise InvalidRequestError(f"the grammar is not valid GBNF: {e}",
                                      "structured_outputs.grammar") from None
        return LLMatcher.grammar_from_lark(lark)

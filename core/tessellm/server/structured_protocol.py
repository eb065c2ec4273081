"""Request schemas of structured outputs: OpenAI's `response_format`, vLLM's
`structured_outputs` and its older `guided_*` fields (server.structured turns them into one
tessellm.constraints.StructuredOutputs)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False,
                              populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool = Field({"type": "object"}, alias="schema")
    strict: bool | None = None   # the schema is always enforced here, strict or not


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_when_asked(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"json_schema is only for response_format type json_schema, not "
                             f"{self.type!r}")
        return self


class StructuredOutputsRequest(_Strict):
    """vLLM's `structured_outputs`: exactly one of json, json_object, regex, choice, grammar."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False


class GuidedFields(_Strict):
    """vLLM's older names, accepted too (each one constraint, like structured_outputs)."""

    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

"""Request schemas of tool calling (OpenAI's chat API): `tools`, `tool_choice`, assistant
turns with `tool_calls`, and what a tool's parameters may be."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

NAME_PATTERN = r"^[A-Za-z0-9_.\-]{1,64}$"


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class FunctionDefinition(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None   # arguments are always held to the schema when forced

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type", "object") != "object":
            raise ValueError(f"a function's parameters must be a JSON schema of type object, "
                             f"got type {v.get('type')!r}")
        return v

    @property
    def parameters_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else \
            {"type": "object", "properties": {}}


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCallMessage(_Strict):
    """An assistant turn's call, as the client sends the history back."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

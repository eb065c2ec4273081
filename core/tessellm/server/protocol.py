"""Request schemas of the OpenAI-compatible endpoints (pydantic, strict).

Strict validation: JSON types must match (`"n": "2"` or `"n": true` is a 400, never coerced);
unknown fields are a 400 naming the field, as OpenAI answers "Unrecognized request argument".
Every number is range-checked here: floats must be finite (1e999 parses as infinity: a 400),
integers that reach the engine must fit in 64 bits.
Fields OpenAI has but this server does not implement are declared so that their default is
accepted and any other value is a clear 400 (`suffix`, `best_of`).
Responses are built as plain dicts by the handlers (completions.py, chat.py): they are
written once per token per stream, and a pydantic round trip there buys nothing.

Extensions beyond OpenAI (as vLLM names them): top_k, min_p, repetition_penalty, ignore_eos,
stop_token_ids, priority, structured_outputs and the older guided_json / guided_regex /
guided_choice / guided_grammar (structured_protocol.py); tools: tool_protocol.py.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tessellm.sampling_params import MAX_LOGPROBS, MAX_LOGIT_BIAS, MAX_STOP_STRINGS
from tessellm.speculative.config import MAX_SPECULATIVE_TOKENS
from tessellm.server.structured_protocol import (GuidedFields, ResponseFormat,
                                                 StructuredOutputsRequest)
from tessellm.server.tool_protocol import Tool, ToolCallMessage, ToolChoice

_INT64 = 2 ** 63
Int64 = Annotated[int, Field(ge=-_INT64, lt=_INT64)]
# content part types of OpenAI's chat API that a text-only model cannot take
UNSUPPORTED_PARTS = {"image_url": "image", "input_image": "image", "image": "image",
                     "input_audio": "audio", "audio": "audio", "file": "file",
                     "input_file": "file", "video_url": "video"}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(GuidedFields, _Strict):
    """The fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: Int64 | None = None
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-_INT64, lt=_INT64)
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = Field(None, max_length=1024)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    ignore_eos: bool = False
    priority: Int64 = 0
    user: str | None = None  # OpenAI's end-user id; accepted, not used
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | \
        None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # speculative decoding on a server that speculates: this request's cap on drafts per step
    # (0: none); more than the server's k is a 400
    num_speculative_tokens: int | None = Field(None, ge=0, le=MAX_SPECULATIVE_TOKENS)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(items)}")
        if any(not s for s in items):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not key.isdigit() or len(key) > 19:
                raise ValueError(f"logit_bias keys must be token ids (digits), got {key!r}")
        return v

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `prompt`: a string, a list of token ids, or a list of either."""

    prompt: Any
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        def is_ids(x: Any) -> bool:
            return isinstance(x, list) and all(type(t) is int for t in x)

        if isinstance(v, str) or is_ids(v):  # empty ones are refused by the handler, by name
            return v
        if isinstance(v, list) and v and all(isinstance(p, str) or is_ids(p) for p in v):
            return v
        raise ValueError("prompt must be a string, a list of token ids, or a non-empty list of "
                         "strings or token-id lists")

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported by this server")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list (a single prompt becomes a list of one)."""
        p = self.prompt
        if isinstance(p, str) or not p or type(p[0]) is int:
            return [p]
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None   # assistant turns
    tool_call_id: str | None = None                   # tool turns

    @model_validator(mode="after")
    def _tool_fields_by_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only tool messages carry tool_call_id")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        """A part this server cannot take is named (not pydantic's union error)."""
        if isinstance(v, list):
            for part in v:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in UNSUPPORTED_PARTS:
                    raise ValueError(f"{UNSUPPORTED_PARTS[kind]} input ({kind!r} content "
                                     "parts) is not supported: this server serves a "
                                     "text-only model")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions. max_tokens (or max_completion_tokens) defaults to the
    context left after the prompt."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=256)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        out = []
        for m in self.messages:
            d: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.name is not None:
                d["name"] = m.name
            if m.tool_calls is not None:
                d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            out.append(d)
        return out

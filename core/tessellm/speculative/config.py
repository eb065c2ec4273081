"""SpeculativeConfig: how an engine speculates (vLLM's `speculative_config` shape)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_SPECULATIVE_TOKENS = 16


class SpeculativeConfig(BaseModel):
    """`method`: "ngram" (prompt lookup), "draft_model", or a proposer a plugin registers
    (tessellm_speculative_proposers); an unknown name is refused when the engine is built.
    `num_speculative_tokens` (k): most draft tokens a request gets per step."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str = Field(min_length=1, max_length=64)
    num_speculative_tokens: int = Field(ge=1, le=MAX_SPECULATIVE_TOKENS)
    # ngram: the longest and shortest suffix of the request's tokens looked up
    prompt_lookup_max: int = Field(4, ge=1, le=64)
    prompt_lookup_min: int = Field(1, ge=1, le=64)
    # draft_model: the draft's model (a path, .gguf file or repo id) and its options
    model: str | None = None
    quantization: str | None = None
    # never slower: speculate only while the measured goodput says it pays (False: always
    # propose, for measurements of the mechanism itself)
    adaptive: bool = True

    @model_validator(mode="after")
    def _consistent(self) -> "SpeculativeConfig":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative method 'draft_model' needs `model` (the draft)")
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f"`model` is for method 'draft_model', not {self.method!r}")
        return self

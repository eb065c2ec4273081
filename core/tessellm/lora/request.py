"""LoRARequest: which adapter a request runs with (vLLM's shape).

`lora_int_id` identifies the adapter's weights: two requests with the same id share slots and
prefix-cache blocks, so a caller gives a new id to new weights (the server numbers the
adapters it loads). Id 0 is the base model and never names an adapter.
"""
from __future__ import annotations

from dataclasses import dataclass

from tessellm.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidRequestError("lora_name must be a non-empty string", "lora_request")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise InvalidRequestError(f"lora_int_id must be an integer >= 1, got "
                                      f"{self.lora_int_id!r}", "lora_request")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise InvalidRequestError(f"adapter {self.lora_name!r}: lora_path must be a "
                                      "non-empty string (a directory or a hub repo id)",
                                      "lora_request")

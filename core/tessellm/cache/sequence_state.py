"""What the KV cache's managers read from a request (SequenceState), and their error."""
from __future__ import annotations

from typing import Protocol

from tessellm.errors import TessellmError


class KVCacheError(TessellmError, RuntimeError):
    """The KV manager was asked for something outside a request's blocks."""


class SequenceState(Protocol):
    """What the KV manager reads from a request."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def cache_salt(self) -> str | None: ...

    @property
    def lora_int_id(self) -> int: ...   # 0: the base model; an adapter's KV is its own

    def token_ids_slice(self, start: int, stop: int) -> list[int]: ...

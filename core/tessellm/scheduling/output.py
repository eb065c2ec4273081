"""What one scheduler step hands to the model runner, and the scheduler's error type.

Contract with the model runner (unchanged by priorities): `scheduled` lists one-token entries
(decodes) first, then the others, each group in the order the batch scheduler granted them;
`num_batched_tokens` is the sum of their token counts; `preempted` are the requests that lost
their KV in this step (none of them is in `scheduled`).
"""
from __future__ import annotations

from dataclasses import dataclass

from tessellm.errors import TessellmError
from tessellm.request import Request


class SchedulerError(TessellmError, RuntimeError):
    """The scheduler cannot make progress, or was fed an output that does not match its state."""


@dataclass(slots=True)
class ScheduledRequest:
    """`num_tokens` tokens of `request`, at positions num_computed_tokens.. (as of schedule())."""

    request: Request
    num_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]   # one-token entries first
    preempted: list[Request]
    num_batched_tokens: int

    @property
    def num_decodes(self) -> int:
        """Entries with one query token; they form the head of `scheduled`."""
        n = 0
        for s in self.scheduled:
            if s.num_tokens != 1:
                break
            n += 1
        return n

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

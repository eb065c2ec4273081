"""What one scheduler step hands to the model runner, and the scheduler's error type.

Contract with the model runner (unchanged by priorities): `scheduled` lists one-token entries
(decodes) first, then the others, each group in the order the batch scheduler granted them;
`num_batched_tokens` is the sum of their token counts; `preempted` are the requests that lost
their KV in this step (none of them is in `scheduled`).

Block copies the runner performs before the step's compute, in this order (see
tessellm.engine.kv_swap): `swap_out` (device block, host block) pairs first (the device blocks
were freed and may be handed out again in this very step), then fresh-block zeroing, then
`block_copies` (copy-on-write: source device block, destination device block) and `swap_in`
(host block, device block), waited on before compute. `forks` maps a request whose prompt
completes in this step to the sibling requests (n > 1) that sample their first token from its
logits row and then share its blocks (see tessellm.scheduler).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tessellm.errors import TessellmError
from tessellm.request import Request


class SchedulerError(TessellmError, RuntimeError):
    """The scheduler cannot make progress, or was fed an output that does not match its state."""


@dataclass(slots=True)
class ScheduledRequest:
    """`num_tokens` tokens of `request`, at positions num_computed_tokens.. (as of schedule()).
    With `draft_token_ids` (speculation) the entry is the request's last token followed by
    those drafts: num_tokens = 1 + len(draft_token_ids), all of which the step computes and
    samples after; how many drafts were right is known only once the step completes."""

    request: Request
    num_tokens: int
    start: int = -1   # num_computed_tokens when the step was committed (Scheduler.commit)
    draft_token_ids: tuple[int, ...] = ()

    @property
    def num_real_tokens(self) -> int:
        """Tokens of the request's own sequence among num_tokens (the drafts excluded)."""
        return self.num_tokens - len(self.draft_token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]   # one-token entries first
    preempted: list[Request]
    num_batched_tokens: int
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    forks: dict[str, list[Request]] = field(default_factory=dict)
    sampling: list[str] = field(default_factory=list)   # set by commit: who samples a token

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
    def has_drafts(self) -> bool:
        return any(s.draft_token_ids for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def has_block_ops(self) -> bool:
        """Whether the runner has block copies to do (even when nothing is scheduled)."""
        return bool(self.swap_out or self.swap_in or self.block_copies)

"""A request as the engine sees it: tokens computed so far and tokens still to compute.

There is no prefill phase: a request is `num_computed_tokens` out of `num_tokens` (prompt plus
generated). Each step the scheduler grants it some of the missing tokens; when the computed count
reaches `num_tokens`, that step also samples one new token.

Pending tokens (async scheduling, tessellm.engine.llm_engine): a token sampled on the device
but not read back yet counts in `num_tokens` (so the next step can already compute it: its
input id is taken from the device) but is not in `output_token_ids`; `append_output` resolves
the oldest pending token. Everything that reads ids (stop checks, deltas, penalties, prefix
hashes) therefore only ever sees real tokens.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

from tessellm.sampling_params import SamplingParams


# what a pending token's id reads as on the host; the runner feeds the real id on the device
PENDING_TOKEN_ID = 0


def sample_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's `n` samples: the id itself when n == 1, else "<id>-<i>"."""
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


def max_kv_tokens(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> int:
    """Most tokens whose KV a request will ever hold: it stops once it has max_tokens outputs
    or max_model_len tokens, and its last sampled token is never computed."""
    return min(num_prompt_tokens + max_tokens, max_model_len) - 1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class OutputConstraint(Protocol):
    """What a request's output must be, token by token (tessellm.constraints): it has seen
    every output token; `accept` says whether the next one is allowed (False sets `error`)."""

    error: str | None

    def accept(self, token_id: int) -> bool: ...

    @property
    def is_terminated(self) -> bool: ...   # only EOS may follow: the output is complete

    def fork(self) -> OutputConstraint: ...


@dataclass(slots=True, eq=False)
class Request:
    """Invariant: 0 <= num_computed_tokens <= num_tokens; output ids only grow (recompute
    preemption resets num_computed_tokens to 0 but keeps the generated ids); num_pending
    tokens follow the output ids (positions num_known_tokens .. num_tokens - 1)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[Any] = field(default_factory=list)  # per output token, when requested
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    cache_salt: str | None = None  # prefix-cache namespace: only equal salts share KV blocks
    priority: int = 0  # scheduling class: lower runs first (0 most urgent); see tessellm.scheduler
    num_pending: int = 0  # sampled on the device, not read back yet (async scheduling)
    constraint: OutputConstraint | None = None  # structured output: its matcher (see above)
    prompt_logprobs: list[Any] = field(default_factory=list)  # prompt tokens 1.., when asked
    error: str | None = None  # why it finished with ERROR, when not a failed step
    # speculation (tessellm.speculative): drafts proposed for the next step (set before each
    # schedule(), taken by it) and the proposer's and policy's state for this request
    draft_token_ids: list[int] = field(default_factory=list)
    speculation: Any = None
    # multi-LoRA (tessellm.lora): the request's adapter (a LoRAAdapter, None: the base model)
    # and its slot in the device table for the step being built (set by LoRAManager.assign)
    adapter: Any = None
    lora_slot: int = -1

    @property
    def lora_int_id(self) -> int:
        """The adapter's id (0: the base model): prefix-cache blocks are shared per id."""
        return 0 if self.adapter is None else self.adapter.int_id

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        """Prompt plus output tokens whose ids the host has (num_tokens minus pending)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def finishes_by_length_when_resolved(self, max_model_len: int) -> bool:
        """Whether the pending tokens already reach max_tokens or max_model_len, so the
        request is finished (LENGTH) once they are read back, whatever their ids."""
        return self.num_pending > 0 and (
            len(self.output_token_ids) + self.num_pending >= self.params.max_tokens
            or self.num_tokens >= max_model_len)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def wants_prompt_logits(self) -> bool:
        """Prompt logprobs asked and not all collected (entry i is for prompt token i + 1:
        the logits at position i); such a request computes its prompt without cache hits."""
        return (self.params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        """Token ids in [start, stop) of prompt + output, without building the whole list;
        a pending token (not read back yet) reads as PENDING_TOKEN_ID."""
        known = self.num_known_tokens
        if stop > known:
            head = self.token_ids_slice(start, known) if start < known else []
            return head + [PENDING_TOKEN_ID] * (stop - max(start, known))
        n_prompt = len(self.prompt_token_ids)
        if stop <= n_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:stop - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - n_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output(self, token_id: int) -> None:
        """Append a sampled token (resolving the oldest pending one, if any) and decide
        whether the request is finished. With a constraint: a token it refuses finishes the
        request with ERROR (the token mask makes that a bug), and a complete constrained
        output finishes it with STOP at once (no step is spent on the EOS it would force)."""
        if self.num_pending:
            self.num_pending -= 1
        self.output_token_ids.append(token_id)
        constraint = self.constraint
        if constraint is not None and not constraint.accept(token_id):
            self.error = constraint.error
            self.finish(FinishReason.ERROR)
            return
        p = self.params
        if token_id in p.stop_token_ids or (
            not p.ignore_eos and token_id in self.eos_token_ids
        ) or (constraint is not None and constraint.is_terminated):
            self.finish(FinishReason.STOP)
        elif len(self.output_token_ids) >= p.max_tokens:
            self.finish(FinishReason.LENGTH)

    def finish(self, reason: FinishReason) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason

"""Per-request output state of the front end: incremental detokenization, stop strings.

The engine core describes what each request produced in a step as a TokenDelta (token ids,
logprobs, finish state); `process` turns it into the StreamDelta sent to the client: text held
back while a multi-byte character or a possible stop string is incomplete, and a stop string
finishes the request at once (its text trimmed, as OpenAI does; the caller then asks the engine
to stop it). Invariant: the concatenated `text` of a request's deltas equals its detokenized
output truncated before the first stop string. After a request's final delta its state is gone
and later TokenDeltas for it are ignored.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessellm.engine.core_messages import TokenDelta
from tessellm.engine.detokenizer import IncrementalDetokenizer
from tessellm.engine.stop_strings import StopStringMatcher


@dataclass(slots=True)
class StreamDelta:
    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[Any]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    prompt_logprobs: list[Any] | None = None


@dataclass(slots=True)
class OutputState:
    """One request's output state in the front end (see OutputProcessor.prepare)."""

    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher | None


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.tracked: dict[str, OutputState] = {}

    def prepare(self, prompt_token_ids: list[int], stop: list[str] | None) -> OutputState:
        """A request's output state, not yet tracked (raises InvalidRequestError for bad stop
        strings; nothing is registered, so admission can fail after this and leave no trace)."""
        return OutputState(IncrementalDetokenizer(self.tokenizer, prompt_token_ids),
                           StopStringMatcher(stop) if stop else None)

    def track(self, request_id: str, prompt_token_ids: list[int], stop: list[str] | None) -> None:
        self.tracked[request_id] = self.prepare(prompt_token_ids, stop)

    def process(self, raw: TokenDelta) -> tuple[StreamDelta | None, bool]:
        """The client delta for `raw` (None if the request already finished) and whether a
        stop string asks the engine to finish the request now."""
        t = self.tracked.get(raw.request_id)
        if t is None:
            return None, False
        token_ids, logprobs, num_output = raw.token_ids, raw.logprobs, raw.num_output_tokens
        stopped = False
        if t.stops is None:
            text = t.detokenizer.step(token_ids) if token_ids else ""
        else:   # token by token: a stop string ends the delta at the token completing it
            text = ""
            for i, token in enumerate(token_ids):
                piece, stopped = t.stops.feed(t.detokenizer.step([token]))
                text += piece
                if stopped:
                    cut = len(token_ids) - (i + 1)   # tokens a multi-token step gave after it
                    token_ids, logprobs = token_ids[:i + 1], logprobs[:i + 1]
                    num_output -= cut
                    break
        if raw.finished and not stopped:
            tail = t.detokenizer.finish()
            if t.stops is not None:
                tail, stopped = t.stops.feed(tail)
                if not stopped:
                    tail += t.stops.flush()
            text += tail
        finished = raw.finished or stopped
        reason = "stop" if stopped else raw.finish_reason
        if finished:
            del self.tracked[raw.request_id]
        return StreamDelta(raw.request_id, token_ids, text, logprobs, finished,
                           reason if finished else None, raw.error, raw.num_prompt_tokens,
                           num_output, raw.prompt_logprobs or None), \
            stopped and not raw.finished

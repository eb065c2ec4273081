"""Per-request output state on the engine thread: incremental detokenization and stop strings.

For every request the async engine owns, `collect` turns the tokens generated since the last
call into one StreamDelta: new token ids, their text (held back while a multi-byte character or
a possible stop string is incomplete), and the finish state. A stop string finishes the request
at once (its text is trimmed, as OpenAI does). Invariant: the concatenated `text` of a
request's deltas equals the detokenized output truncated before the first stop string.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tessellm.engine.detokenizer import IncrementalDetokenizer
from tessellm.engine.stop_strings import StopStringMatcher
from tessellm.request import FinishReason, Request


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


@dataclass(slots=True)
class TrackedRequest:
    request: Request
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher | None
    sent: int = 0
    stopped_by_string: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.tracked: dict[str, TrackedRequest] = {}

    def track(self, request: Request, stop: list[str] | None) -> None:
        self.tracked[request.request_id] = TrackedRequest(
            request, IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids),
            StopStringMatcher(stop) if stop else None)

    def collect(self, request_id: str) -> tuple[StreamDelta | None, bool]:
        """The delta of one tracked request (None if nothing new) and whether a stop string
        asks the engine to finish it now."""
        t = self.tracked[request_id]
        r = t.request
        new_ids = r.output_token_ids[t.sent:]
        if not new_ids and not r.is_finished:
            return None, False
        logprobs = list(r.output_logprobs[t.sent:]) if r.output_logprobs else []
        t.sent = len(r.output_token_ids)
        text = t.detokenizer.step(new_ids) if new_ids else ""
        finish_now = False
        if r.is_finished:
            text += t.detokenizer.finish()
        if t.stops is not None:
            text, stopped = t.stops.feed(text)
            if stopped:
                t.stopped_by_string, finish_now = True, not r.is_finished
            elif r.is_finished:
                text += t.stops.flush()
        finished = r.is_finished or finish_now
        reason = "stop" if t.stopped_by_string else (
            r.finish_reason.value if r.finish_reason else None)
        delta = StreamDelta(r.request_id, new_ids, text, logprobs, finished,
                            reason if finished else None,
                            "engine step failed" if r.finish_reason is FinishReason.ERROR else None,
                            r.num_prompt_tokens, len(r.output_token_ids))
        if finished:
            del self.tracked[request_id]
        return delta, finish_now

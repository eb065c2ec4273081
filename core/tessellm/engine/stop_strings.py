"""Stop strings on a streamed text, with OpenAI's semantics.

Generation stops as soon as a stop string has appeared in the text; the output ends right
before it (the stop string itself is not returned). If several occurrences are complete at the
same character, the one starting first wins. Text that may still be the start of a stop string
is held back until the next deltas decide.

Invariant, for any text and any split of it into deltas fed in order:

    "".join(emitted) (+ flush() if nothing matched) == text[:start]

where `start` is where the earliest-ending occurrence of any stop string in `text` begins
(the longest of those ending together), or len(text) if none occurs.

Each stop string runs a Knuth-Morris-Pratt automaton whose state is the length of the longest
prefix of the stop string that ends the text seen so far; the held-back text is the longest
such prefix. Cost: O(len(delta) * number of stops) per feed, amortized. At most MAX_STOP_STRINGS (16, the
one limit the server's schema and SamplingParams share) distinct stop strings.
"""
from __future__ import annotations

from collections.abc import Sequence

from tessellm.errors import InvalidRequestError
from tessellm.sampling_params import MAX_STOP_STRINGS


def _failure(pattern: str) -> list[int]:
    """fail[i]: length of the longest proper prefix of pattern[:i + 1] that is also its suffix."""
    fail = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    return fail


class StopStringMatcher:
    """Finds the first stop string in a text that arrives in deltas; see the module docstring."""

    __slots__ = ("_done", "_fail", "_held", "_state", "matched", "stops")

    def __init__(self, stops: Sequence[str], max_stops: int | None = MAX_STOP_STRINGS) -> None:
        if isinstance(stops, str):
            stops = [stops]
        for stop in stops:
            if not isinstance(stop, str):
                raise InvalidRequestError(f"stop strings must be strings, got {stop!r}")
            if not stop:
                raise InvalidRequestError("stop strings must not be empty")
        unique = list(dict.fromkeys(stops))
        if max_stops is not None and len(unique) > max_stops:
            raise InvalidRequestError(
                f"at most {max_stops} stop strings are allowed, got {len(unique)}")
        self.stops: tuple[str, ...] = tuple(unique)
        self.matched: str | None = None  # the stop string that ended the text, once one did
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)
        self._held = ""
        self._done = False

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def feed(self, delta: str) -> tuple[str, bool]:
        """Take the next piece of text; return (text safe to emit now, whether it stopped).

        Once stopped, the stop string and everything after it are dropped for good."""
        if self._done:
            return "", self.stopped
        text = self._held + delta
        offset = len(self._held)
        for i in range(offset, len(text)):
            ch = text[i]
            hit = -1
            for j, stop in enumerate(self.stops):
                k, fail = self._state[j], self._fail[j]
                while k and stop[k] != ch:
                    k = fail[k - 1]
                if stop[k] == ch:
                    k += 1
                if k == len(stop) and (hit < 0 or len(stop) > len(self.stops[hit])):
                    hit = j
                self._state[j] = k
            if hit >= 0:
                self.matched, self._done, self._held = self.stops[hit], True, ""
                return text[:i + 1 - len(self.matched)], True
        keep = max(self._state, default=0)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """At the end of the text: the held-back text (never part of a stop string)."""
        held, self._held, self._done = self._held, "", True
        return held

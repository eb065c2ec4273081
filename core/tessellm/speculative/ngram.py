"""Prompt lookup (n-gram) proposals: the tokens that followed the latest earlier occurrence of
the request's last n tokens, for n from `max_n` down to `min_n`.

    tokens   a b c d a b c ?        max_n = 3, k = 2
    suffix   (a b c) ends at 7; its latest earlier occurrence ends at 3, followed by d a
    propose  d a

NgramIndex is one request's index, updated incrementally as its tokens grow: for each n, a
dict from an n-gram to the end of its latest occurrence that some token follows. So a step
costs O(max_n - min_n + 1) dict operations per new token and per proposal, whatever the
length; memory is about (max_n - min_n + 1) entries per token of the request.
Invariant: `num_indexed` tokens are indexed; an entry ends before num_indexed, so the token
after it is known (a suffix is looked up before it is indexed: it never matches itself).
"""
from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    __slots__ = ("min_n", "max_n", "tokens", "_ends")

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n - min_n + 1)]

    @property
    def num_indexed(self) -> int:
        return len(self.tokens)

    def extend(self, new_tokens: Sequence[int]) -> None:
        """Append tokens; each n-gram that now has a follower is indexed."""
        tokens, ends, lo = self.tokens, self._ends, self.min_n
        for t in new_tokens:
            end = len(tokens)   # n-grams ending here are followed by t
            for i, table in enumerate(ends):
                n = lo + i
                if end >= n:
                    table[tuple(tokens[end - n:end])] = end
            tokens.append(t)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix
        (max_n .. min_n tokens) seen before; [] when none occurred."""
        tokens = self.tokens
        size = len(tokens)
        for n in range(min(self.max_n, size), self.min_n - 1, -1):
            end = self._ends[n - self.min_n].get(tuple(tokens[size - n:]))
            if end is not None:
                return tokens[end:min(end + k, size)]
        return []

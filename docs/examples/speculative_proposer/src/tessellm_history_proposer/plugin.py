"""Drafts from earlier requests (the tessellm_speculative_proposers hook).

Prompt lookup (`ngram`) drafts from a request's own tokens. Agents and batch jobs also repeat
what *other* requests wrote: the same JSON keys, tool calls, boilerplate. This proposer keeps,
for every n-gram of every finished request, the tokens that followed it, and drafts them when
a running request ends with that n-gram (`"method": "history"`, n = prompt_lookup_max).
Whatever it drafts, the output is the target model's: the engine verifies every draft.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from tessellm.plugin_api import SpeculativeConfig, hookimpl

TESSELLM_API_VERSION = "1.8"
MAX_ENTRIES = 1 << 16   # n-grams remembered (least recently written dropped first)


class HistoryProposer:
    method = "history"

    def __init__(self, config: SpeculativeConfig, engine_parts: Any) -> None:
        self.n = config.prompt_lookup_max
        self.k = config.num_speculative_tokens
        self.table: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()

    def propose(self, requests: Sequence[Any], max_drafts: Sequence[int]) -> list[list[int]]:
        out = []
        for request, k in zip(requests, max_drafts):
            tail = (list(request.prompt_token_ids[-self.n:]) +
                    list(request.output_token_ids[-self.n:]))[-self.n:]
            out.append(list(self.table.get(tuple(tail), ()))[:k])
        return out

    def release(self, request: Any) -> None:
        """A finished request: remember what followed each of its n-grams."""
        tokens = list(request.prompt_token_ids) + list(request.output_token_ids)
        for end in range(self.n, len(tokens)):
            key = tuple(tokens[end - self.n:end])
            self.table[key] = tuple(tokens[end:end + self.k])
            self.table.move_to_end(key)
        while len(self.table) > MAX_ENTRIES:
            self.table.popitem(last=False)


@hookimpl
def tessellm_speculative_proposers() -> dict[str, Any]:
    return {"history": HistoryProposer}

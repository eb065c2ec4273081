"""PrefixIndex: which prompt prefixes one replica's prefix cache holds, as the front end knows.

Two sources. `published`: the block hashes the replica's core reports cached (StepOutputs'
stored/removed changes; the first report after a start carries the whole set), an exact
mirror of its cache as of its latest report. `routed`: the hash chains of prompts the front
end sent there in the last `routed_ttl_s` seconds, whose blocks the replica is computing or
will compute: without them a burst of requests sharing a prefix would spread over every
replica before any of them published the prefix. A chain's hashes are those of
cache.prefix_cache (`prompt_hashes`: the same seed, salt and LoRA root as the KV manager's),
so a match here is a match there. Invariant: `published` holds only hashes the replica
reported cached and not since reported evicted; `routed` only entries younger than the TTL
(pruned as they are read).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from tessellm.cache.prefix_cache import BlockHash, extend_block_hashes

ROUTED_TTL_S = 10.0


def prompt_hashes(prompt_token_ids: list[int], block_size: int, cache_salt: str | None = None,
                  lora_int_id: int = 0) -> list[BlockHash]:
    """The chained hashes of the prompt's full blocks, exactly as the KV manager names them."""
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, len(prompt_token_ids) // block_size, block_size, cache_salt,
                        lambda a, b: prompt_token_ids[a:b], lora_int_id)
    return hashes


class PrefixIndex:
    def __init__(self, routed_ttl_s: float = ROUTED_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.published: set[BlockHash] = set()
        self._routed: OrderedDict[BlockHash, float] = OrderedDict()   # hash -> expiry, by age
        self._ttl, self._clock = routed_ttl_s, clock

    def apply(self, stored: list[bytes], removed: list[bytes]) -> None:
        """A report's changes (removed ones first: a change list names a hash once)."""
        self.published.difference_update(removed)
        self.published.update(stored)

    def clear(self) -> None:
        """The replica restarted: its cache is empty."""
        self.published.clear()
        self._routed.clear()

    def note_routed(self, hashes: list[BlockHash]) -> None:
        expiry = self._clock() + self._ttl
        for h in hashes:
            self._routed[h] = expiry
            self._routed.move_to_end(h)

    def _prune(self) -> None:
        now = self._clock()
        while self._routed:
            h, expiry = next(iter(self._routed.items()))
            if expiry > now:
                return
            del self._routed[h]

    def match(self, hashes: list[BlockHash]) -> int:
        """How many leading blocks of the chain the replica holds or is computing."""
        self._prune()
        n = 0
        for h in hashes:
            if h not in self.published and h not in self._routed:
                break
            n += 1
        return n

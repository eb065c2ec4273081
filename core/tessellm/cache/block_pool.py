"""The pool of fixed-size KV-cache blocks: reference counts, a free queue in LRU order, and the
prefix cache's hash <-> block map.

A block holds the KV of `block_size` consecutive tokens of one sequence (the KV manager decides
which). The pool only knows block ids 0..num_blocks-1, who still references them, and which
of them hold a cached full block (named by its chained hash, see tessellm.cache.prefix_cache).

Invariants (every public method keeps them; tests check them after random operation sequences):
  * a block is in the free queue iff its reference count is 0;
  * num_free_blocks + (number of blocks with a reference count > 0) == num_blocks;
  * no block id is twice in the free queue (the queue is an OrderedDict's keys);
  * a cached block keeps its hash while it is held and while it sits in the free queue; it
    loses it exactly when `allocate` takes it from the queue (eviction): it is then fresh.

Free-queue order is eviction order: `allocate` takes from the head (the least recently freed
block), `free` appends at the tail in the order it is given. Callers free a request's blocks in
reverse, so that its last block (the one least likely to be shared by a later prompt) is evicted
first. A cached block with reference count 0 is still a prefix-cache hit until evicted:
`incref` takes it out of the queue, wherever it is, and it is held again.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Iterable

from tessellm.cache.prefix_cache import BlockHash, CachedBlockMap
from tessellm.errors import ConfigError, TessellmError


class BlockPoolError(TessellmError, RuntimeError):
    """A block pool was used wrongly: unknown block id, or a block freed more often than held."""


class NoFreeBlocksError(BlockPoolError):
    """More blocks were asked for than the free queue holds; nothing was allocated."""


class BlockPool:
    __slots__ = ("_num_blocks", "_ref_counts", "_free", "_cached", "_num_evictions")

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ConfigError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        self._num_blocks = num_blocks
        self._ref_counts: list[int] = [0] * num_blocks
        # Keys in eviction order, head first; values unused. O(1) append, popleft and remove.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached = CachedBlockMap()
        self._num_evictions = 0

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next to be allocated) first. A copy, for inspection."""
        return list(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a cached full block (held or free)."""
        return len(self._cached)

    @property
    def num_evictions(self) -> int:
        """Cached blocks taken by `allocate` (and so dropped from the cache) so far."""
        return self._num_evictions

    def cached_block(self, block_hash: BlockHash) -> int | None:
        """The block holding the full block named `block_hash`, or None."""
        return self._cached.get(block_hash)

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The hash of the cached full block `block_id` holds, or None when it is uncached."""
        self._check_id(block_id)
        return self._cached.hash_of(block_id)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Enter a held block, whose KV is now complete, into the prefix cache under its hash.

        False (nothing changes) when another block is cached under that hash already (the
        first copy stays the cached one) or this block is cached already. Raises
        BlockPoolError for a free block: only a holder knows that its KV is complete.
        """
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise BlockPoolError(f"block {block_id} is free and cannot be cached")
        return self._cached.insert(block_hash, block_id)

    @property
    def cached_blocks(self) -> CachedBlockMap:
        """The prefix cache's hash <-> block map (its change log: CachedBlockMap)."""
        return self._cached

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the head of the free queue; each leaves with reference count 1
        and out of the prefix cache (an evicted cached block's hash is dropped).

        Raises NoFreeBlocksError (and allocates nothing) when fewer than `n` blocks are free.
        """
        if not isinstance(n, int) or n < 0:
            raise BlockPoolError(f"cannot allocate {n!r} blocks")
        if n > len(self._free):
            raise NoFreeBlocksError(
                f"asked for {n} blocks but only {len(self._free)} of {self._num_blocks} are free")
        ids: list[int] = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            self._ref_counts[block_id] = 1
            self._num_evictions += self._cached.evict(block_id)
            ids.append(block_id)
        return ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (sharing). A free block leaves the free queue:
        that is how a prefix-cache hit revives a freed block before it is evicted."""
        ids = list(block_ids)
        for block_id in ids:
            self._check_id(block_id)
        for block_id in ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 go to the tail of the free queue
        in the given order. Raises BlockPoolError (and changes nothing) on an unknown id or on a
        block released more often than it is referenced."""
        ids = list(block_ids)
        for block_id, times in Counter(ids).items():
            self._check_id(block_id)
            if self._ref_counts[block_id] < times:
                raise BlockPoolError(
                    f"block {block_id} freed {times} time(s) but has reference count "
                    f"{self._ref_counts[block_id]}")
        for block_id in ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None

    def _check_id(self, block_id: int) -> None:
        if not isinstance(block_id, int) or not 0 <= block_id < self._num_blocks:
            raise BlockPoolError(
                f"block id {block_id!r} is not in 0..{self._num_blocks - 1}")

    def __repr__(self) -> str:
        return (f"BlockPool(num_blocks={self._num_blocks}, free={len(self._free)}, "
                f"cached={len(self._cached)})")

"""The pool of fixed-size KV-cache blocks: reference counts and a free queue in LRU order.

A block holds the KV of `block_size` consecutive tokens of one sequence (the KV manager decides
which). The pool only knows block ids 0..num_blocks-1 and who still references them.

Invariants (every public method keeps them; tests check them after random operation sequences):
  * a block is in the free queue iff its reference count is 0;
  * num_free_blocks + (number of blocks with a reference count > 0) == num_blocks;
  * no block id is twice in the free queue (the queue is an OrderedDict's keys).

Free-queue order is eviction order: `allocate` takes from the head (the least recently freed
block), `free` appends at the tail in the order it is given. Callers free a request's blocks in
reverse, so that its last block (the one least likely to be shared by a later prompt) is evicted
first. Nothing is cached yet; the order and `incref` (which also revives a block from the free
queue) are what a prefix cache needs.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Iterable

from tessellm.errors import ConfigError, TessellmError


class BlockPoolError(TessellmError, RuntimeError):
    """A block pool was used wrongly: unknown block id, or a block freed more often than held."""


class NoFreeBlocksError(BlockPoolError):
    """More blocks were asked for than the free queue holds; nothing was allocated."""


class BlockPool:
    __slots__ = ("_num_blocks", "_ref_counts", "_free")

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ConfigError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        self._num_blocks = num_blocks
        self._ref_counts: list[int] = [0] * num_blocks
        # Keys in eviction order, head first; values unused. O(1) append, popleft and remove.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

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

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the head of the free queue; each leaves with reference count 1.

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
        return f"BlockPool(num_blocks={self._num_blocks}, free={len(self._free)})"

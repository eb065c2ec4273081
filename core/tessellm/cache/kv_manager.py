"""Block tables of the requests in flight, over one BlockPool.

A request's block table lists, in token order, the blocks holding its KV: the token at
position p lives in row p % block_size of block table[p // block_size], which is slot
table[p // block_size] * block_size + p % block_size of the flat cache.

    block_size = 4; the request has 6 computed tokens and is granted 3 more (9 must fit)

    positions   0  1  2  3 | 4  5  6  7 | 8  .  .  .
    table       [   17     |     3      |    42    ]
                computed: 0..5    new: 6..8    '.': room for later tokens
    allocate_slots(request, 3) adds block 42; 17 and 3 were held already.

Invariants: a block is in at most one table (no sharing without a prefix cache); a table only
grows, by exactly the blocks needed to cover num_computed_tokens + num_new_tokens, until
`free` returns it whole; allocation is all-or-nothing.

Block 0 is the null block: reserved for life, never in a table, so block-table padding can
point at it. The physical cache therefore has num_blocks + 1 blocks (`num_physical_blocks`).
Blocks handed out since the last `take_fresh_blocks()` are reported by it, so the model runner
can zero them before first use: together with a zeroed null block, every slot an attention
kernel can read through a (padded) table holds finite values, whatever the pool held before.

The manager needs only a request's id and computed-token count, so it takes anything shaped
like that (tessellm.request.Request is) and imports nothing from the layers above.
"""
from __future__ import annotations

from typing import Protocol

from tessellm.cache.block_pool import BlockPool
from tessellm.errors import ConfigError, TessellmError


class KVCacheError(TessellmError, RuntimeError):
    """The KV manager was asked for something outside a request's blocks."""


class SequenceState(Protocol):
    """What the KV manager reads from a request."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_computed_tokens(self) -> int: ...


class KVCacheManager:
    __slots__ = ("_pool", "_block_size", "_tables", "_fresh")

    NULL_BLOCK = 0

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(f"block_size must be an integer >= 1, got {block_size!r}")
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ConfigError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        self._pool = BlockPool(num_blocks + 1)
        if self._pool.allocate(1) != [self.NULL_BLOCK]:
            raise KVCacheError("the block pool did not hand out block 0 first")
        self._block_size = block_size
        self._tables: dict[str, list[int]] = {}
        self._fresh: list[int] = []

    @property
    def num_blocks(self) -> int:
        """Usable blocks (the null block excluded)."""
        return self._pool.num_blocks - 1

    @property
    def num_physical_blocks(self) -> int:
        """Blocks the KV cache tensors must hold: the usable ones plus the null block."""
        return self._pool.num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool's blocks in use, in [0, 1]."""
        return 1.0 - self._pool.num_free_blocks / self.num_blocks

    @property
    def pool(self) -> BlockPool:
        return self._pool

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self._block_size)

    def allocate_slots(self, request: SequenceState, num_new_tokens: int) -> bool:
        """Grow the request's table to cover num_computed_tokens + num_new_tokens tokens.

        Returns False, allocating nothing, when the free queue is too short; the scheduler
        then preempts or waits.
        """
        if num_new_tokens < 0:
            raise KVCacheError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        table = self._tables.get(request.request_id)
        held = len(table) if table is not None else 0
        missing = self.num_blocks_needed(request.num_computed_tokens + num_new_tokens) - held
        if missing <= 0:
            return True
        if missing > self._pool.num_free_blocks:
            return False
        new_blocks = self._pool.allocate(missing)
        self._fresh.extend(new_blocks)
        if table is None:
            self._tables[request.request_id] = new_blocks
        else:
            table.extend(new_blocks)
        return True

    def take_fresh_blocks(self) -> list[int]:
        """Blocks allocated since the previous call (each once), for zeroing before use."""
        fresh, self._fresh = self._fresh, []
        return fresh

    def free(self, request: SequenceState) -> None:
        """Return all the request's blocks, last block first, and forget its table.
        A request without blocks (never allocated, or freed already) is a no-op."""
        table = self._tables.pop(request.request_id, None)
        if table:
            self._pool.free(reversed(table))

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table ([] when it holds no blocks)."""
        return list(self._tables.get(request_id, ()))

    def slot_mapping(self, request: SequenceState, start: int, stop: int) -> list[int]:
        """Flat cache slots of token positions start..stop-1 of the request."""
        table = self._tables.get(request.request_id, [])
        bs = self._block_size
        if not 0 <= start <= stop <= len(table) * bs:
            raise KVCacheError(
                f"positions {start}..{stop - 1} of request {request.request_id!r} are outside "
                f"its {len(table)} block(s) of {bs} tokens")
        return [table[p // bs] * bs + p % bs for p in range(start, stop)]

    def __repr__(self) -> str:
        return (f"KVCacheManager(num_blocks={self.num_blocks}, block_size={self._block_size}, "
                f"free={self.num_free_blocks}, requests={len(self._tables)})")

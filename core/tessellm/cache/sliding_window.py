"""The block arithmetic of a sliding window: which blocks of a table no query reads any more,
and how many blocks a windowed sequence can hold at most.

A window W > 0 means a query at position p reads only the keys at positions > p - W. A table
stays positional (entry i covers positions i*bs .. i*bs + bs - 1), but the blocks no query
from num_computed_tokens c on will read, the first num_dead_blocks(c) = max(c - W + 1, 0) //
bs, are released (the normal free path: a cached one stays a prefix-cache hit until evicted)
and their entries become the null block; KVCacheManager.allocate_slots does it before it
grows a table, so a chunk starting at c keeps the W - 1 keys before c. With prefix caching
on, a block is released only once it has been offered to the cache (`cache_full_blocks`), so
a step in flight under async scheduling delays it by one step. A new table (prefix hits, a
swapped-out request resuming at its kept count) starts with null entries where its dead
blocks would be: dead hits are not held at all; its hits and swapped-in full blocks count as
offered. Kernels may read a null entry's zeros but mask those positions out (every attention
kernel masks or skips keys outside the window).

    bs = 4, W = 6, c = 13 (next query at 13 reads keys 8..13)
    table    [ 0 (null) | 0 (null) | 42 | 7 ]     positions 0..7 released

Blocks held by a windowed sequence computing n tokens from c: those overlapping positions
c - W + 1 .. c + n - 1, at most ceil((W + n - 2) / bs) + 1 (a decode: ceil((W - 1) / bs) +
1); with the step in flight's T tokens not yet offered, ceil((max(W - 1, T) + n - 1) / bs) +
1 (`max_held_blocks`, with n = T = the step token budget: what a lone sequence can need, the
bound request admission checks).
"""
from __future__ import annotations

from collections.abc import Sequence


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


def num_dead_blocks(window: int, block_size: int, num_computed: int) -> int:
    """Leading blocks of a sequence that no query at a position >= num_computed reads: those
    wholly before num_computed - window + 1 (0 without a window)."""
    if not window:
        return 0
    return max(num_computed - window + 1, 0) // block_size


def new_table_split(window: int, block_size: int, start: int, num_new_tokens: int,
                    hits: Sequence[int]) -> tuple[int, list[int], int]:
    """(null entries, held hits, fresh blocks) of a new table whose first `start` tokens are
    computed (by the `hits` or kept from a swap) and that grows by `num_new_tokens`: hits
    wholly out of the window are not held."""
    lead = num_dead_blocks(window, block_size, start)
    needed = num_blocks_for(start + num_new_tokens, block_size)
    return lead, list(hits[lead:]), needed - max(lead, len(hits))


def max_held_blocks(window: int, block_size: int, num_tokens: int, step_tokens: int) -> int:
    """The most blocks one sequence of `num_tokens` tokens holds at once when a step computes
    at most `step_tokens` of them (the module docstring's bound; the whole context without a
    window)."""
    whole = num_blocks_for(num_tokens, block_size)
    if not window:
        return whole
    steps = max(step_tokens, 1)
    return min(whole, num_blocks_for(max(window - 1, steps) + steps - 1, block_size) + 1)


def kv_blocks_bound(windows: Sequence[int], block_size: int, num_tokens: int,
                    step_tokens: int) -> int:
    """Blocks a lone sequence of `num_tokens` tokens can need at once from a pool shared by
    block-table groups of these windows (0: full attention): what request validation checks
    against the pool."""
    return sum(max_held_blocks(w, block_size, num_tokens, step_tokens) for w in windows)

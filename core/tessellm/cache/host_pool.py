"""Swap space: a pool of host KV blocks, and which swapped-out request holds which of them.

Swap preemption (preemption_mode="swap") copies a victim's computed KV blocks to host blocks
and frees its device blocks; the victim keeps num_computed_tokens and, on resume, gets new
device blocks into which the host blocks are copied back. This module is the bookkeeping only;
the copies themselves are the model runner's (tessellm.engine.kv_swap), which receives each
step's pairs through the SchedulerOutput:

    swap_out: (device block, host block)   enqueued first in the step (before any reuse)
    swap_in:  (host block, device block)   enqueued after fresh-block zeroing

Host-side ordering rule: host blocks released by a resume (`swap_in`) go back to the pool only
at `end_step()`, after every swap-out of that step has been given its host blocks, so no host
block is both the source of a swap-in and the destination of a swap-out in one step. Across
steps the runner's single swap stream orders the copies (FIFO), and it waits on each swap-in
before the step's compute.

Invariants (tests check them after random operation sequences):
  * a host block is either free or in exactly one swapped-out request's host table;
  * num_free_blocks + sum(len(host table)) + len(released this step) == num_blocks;
  * a swapped-out request holds no device blocks; its host table has, for each block-table
    group in turn (one but for hybrid models, tessellm.cache.kv_groups), exactly
    ceil(num_computed_tokens / block_size) - num_dead_blocks(num_computed_tokens) blocks
    (with a sliding window only the blocks inside it: those it resumes with), in token order.
When the host pool is short, `swap_out` returns False and the scheduler falls back to
recompute for that victim (counted in `SwapStats.fallbacks`): a policy, not a failure.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tessellm.cache.block_pool import BlockPoolError
from tessellm.cache.kv_groups import KVCache
from tessellm.cache.kv_manager import KVCacheError, KVCacheManager, SequenceState
from tessellm.errors import ConfigError


class HostBlockPool:
    """Host block ids 0..num_blocks-1; free ones in a FIFO (released blocks are reused last)."""

    __slots__ = ("_num_blocks", "_free", "_is_free")

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ConfigError(f"num_host_blocks must be an integer >= 0, got {num_blocks!r}")
        self._num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """`n` free host blocks, or None (nothing taken) when fewer are free."""
        if not isinstance(n, int) or n < 0:
            raise BlockPoolError(f"cannot allocate {n!r} host blocks")
        if n > len(self._free):
            return None
        ids = [self._free.popleft() for _ in range(n)]
        for b in ids:
            self._is_free[b] = False
        return ids

    def free(self, block_ids: list[int]) -> None:
        """Return held host blocks. Raises BlockPoolError (nothing freed) on an unknown id, a
        free block or a duplicate."""
        if len(set(block_ids)) != len(block_ids) or any(
                not isinstance(b, int) or not 0 <= b < self._num_blocks or self._is_free[b]
                for b in block_ids):
            raise BlockPoolError(f"host blocks {block_ids} are not distinct held blocks")
        for b in block_ids:
            self._is_free[b] = True
            self._free.append(b)


@dataclass(slots=True)
class SwapStats:
    """Counters: blocks copied each way, requests swapped each way, recompute fallbacks
    (victims preempted by recompute because the host pool was short)."""

    blocks_out: int = 0
    blocks_in: int = 0
    swap_outs: int = 0
    swap_ins: int = 0
    fallbacks: int = 0


class SwapSpace:
    __slots__ = ("kv", "pool", "stats", "_tables", "_out", "_in", "_released")

    def __init__(self, kv: KVCache, num_host_blocks: int) -> None:
        self.kv = kv
        self.pool = HostBlockPool(num_host_blocks)
        self.stats = SwapStats()
        self._tables: dict[str, list[int]] = {}      # swapped-out request -> host blocks
        self._out: list[tuple[int, int]] = []
        self._in: list[tuple[int, int]] = []
        self._released: list[int] = []

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._tables

    def host_table(self, request_id: str) -> list[int]:
        return list(self._tables.get(request_id, ()))

    @property
    def num_swapped(self) -> int:
        return len(self._tables)

    def swap_out(self, request: SequenceState) -> bool:
        """Move a running request's computed KV to host blocks and free its device blocks.
        False (nothing changed) when it has nothing computed or the host pool is short (a
        fallback is counted for the latter): the caller preempts it by recompute then."""
        rid = request.request_id
        computed = request.num_computed_tokens
        if computed == 0:
            return False
        device: list[int] = []
        for m in self.kv.groups:
            n, first = m.num_blocks_needed(computed), m.num_dead_blocks(computed)
            table = m.block_table(rid)
            if len(table) < n or KVCacheManager.NULL_BLOCK in table[first:n]:
                raise KVCacheError(f"request {rid!r} has {computed} computed tokens but not "
                                   f"the blocks {first}..{n - 1} ({table})")
            device += table[first:n]
        host = self.pool.allocate(len(device))
        if host is None:
            self.stats.fallbacks += 1
            return False
        self._out.extend(zip(device, host))
        self._tables[rid] = host
        self.kv.free(request)
        self.stats.blocks_out += len(host)
        self.stats.swap_outs += 1
        return True

    def swap_in(self, request: SequenceState) -> None:
        """The request was just given device blocks (allocate_slots from its kept
        num_computed_tokens): schedule the copies back; its host blocks are released at
        end_step()."""
        rid = request.request_id
        host = self._tables.pop(rid)
        computed = request.num_computed_tokens
        dev = [b for m in self.kv.groups for b in m.block_table(rid)[
            m.num_dead_blocks(computed):m.num_blocks_needed(computed)]]
        if len(dev) != len(host):
            raise KVCacheError(f"request {rid!r} resumed with {len(dev)} device blocks for "
                               f"{len(host)} swapped ones")
        self._in.extend(zip(host, dev))
        self._released.extend(host)
        self.stats.blocks_in += len(host)
        self.stats.swap_ins += 1

    def discard(self, request_id: str) -> None:
        """Forget a swapped-out request that finished while waiting (abort): free its host
        blocks. Copies already handed out stay ordered by the runner's swap stream."""
        host = self._tables.pop(request_id, None)
        if host:
            self.pool.free(host)

    def end_step(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's (swap_out, swap_in) pairs; releases the host blocks resumed from."""
        out, into = self._out, self._in
        self._out, self._in = [], []
        if self._released:
            self.pool.free(self._released)
            self._released = []
        return out, into

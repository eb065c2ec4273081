"""Block tables of the requests in flight, over one BlockPool, with prefix caching.

A request's block table lists, in token order, the blocks holding its KV: the token at
position p lives in row p % block_size of block table[p // block_size], which is slot
table[p // block_size] * block_size + p % block_size of the flat cache.

    block_size = 4; the request has 6 computed tokens and is granted 3 more (9 must fit)

    positions   0  1  2  3 | 4  5  6  7 | 8  .  .  .
    table       [   17     |     3      |    42    ]
                computed: 0..5    new: 6..8    '.': room for later tokens
    allocate_slots(request, 3) adds block 42; 17 and 3 were held already.

Prefix caching (on unless enable_prefix_caching=False, which behaves exactly as before it
existed). A full block whose KV is computed is entered into the cache under the chained hash
of its tokens (`cache_full_blocks`, called after the step that computed it). A new request
asks `get_computed_blocks` for the longest run of cached blocks at the start of its sequence,
then passes them to `allocate_slots`, which shares them (incref) and appends fresh blocks:

    cached:   h0 -> 17, h1 -> 3 (free, ref 0)    new prompt: 10 tokens, same first 8
    get_computed_blocks -> ([17, 3], 8)          allocate_slots(r, 2, [17, 3])
    table     [ 17 (shared) | 3 (revived) | 42 (fresh) ]   computed from token 8 on

A hit never covers the sequence's last token (its logits are needed), so a sequence of
exactly k full blocks can hit at most k - 1 of them.

Copy-on-write (n > 1): `fork(parent, child)` gives the child the parent's table, every block
shared (incref). A shared block is never written: when `allocate_slots` grows a table whose
block at position num_computed_tokens (the first one written) is held by another table too,
it takes a fresh block instead, records the (shared, fresh) pair for the model runner to copy
(`take_block_copies()`, after zeroing) and drops its reference to the shared one, which is
held for the copy until `take_block_copies()` (tessellm.cache.block_copies: why).

Invariants: a block's reference count is the number of tables holding it, and it is in two
tables only if it is a cached block shared through a hit or a block shared through a fork
(copied before either table writes into it); a cached block holds exactly the KV
its hash names and is never written again (it is cached only once all its positions are
computed, and only positions >= num_computed_tokens are written); a table only grows, by
exactly the blocks needed to cover num_computed_tokens + num_new_tokens, until `free` returns
it whole (with a window, its leading entries turn null as described below, never back);
allocation is all-or-nothing.

Sliding window (`sliding_window` W > 0: a query at position p reads only the keys at
positions > p - W): the table's blocks no query reads any more are released and their entries
become the null block (tessellm.cache.sliding_window: the arithmetic, a diagram, the bounds).

One pool, several tables per request (hybrid models, tessellm.cache.kv_groups): a manager may
be given a BlockPool that other managers share (`pool`, `group`); its prefix-cache hashes are
then its group's own (`group` seeds the chain), since the same block of tokens holds different
layers' KV in each group.

Block 0 is the null block: reserved for life, never held through a table (a windowed table's
released entries name it but hold no reference), so block-table padding can point at it.
The physical cache therefore has num_blocks + 1 blocks (`num_physical_blocks`).
Blocks taken from the free queue since the last `take_fresh_blocks()` are reported by it (a
cached block evicted for reuse too), so the model runner can zero them before first use:
together with a zeroed null block, every slot an attention kernel can read through a (padded)
table holds finite values, whatever the pool held before. Cache hits are never reported:
they hold KV that other requests read.

The manager needs only a request's id, token ids, computed-token count and cache salt, so it
takes anything shaped like that (tessellm.request.Request is) and imports nothing from the
layers above.
"""
from __future__ import annotations

from typing import Sequence

from tessellm.cache.block_copies import BlockCopies
from tessellm.cache.block_pool import BlockPool
from tessellm.cache.prefix_cache import BlockHash, check_hits, extend_block_hashes
from tessellm.cache.sequence_state import KVCacheError, SequenceState
from tessellm.cache.sliding_window import (max_held_blocks, new_table_split, num_blocks_for,
                                           num_dead_blocks)
from tessellm.errors import ConfigError

__all__ = ["KVCacheError", "KVCacheManager", "SequenceState"]


class KVCacheManager:
    __slots__ = ("_pool", "_block_size", "_tables", "_fresh", "_caching", "_hashes",
                 "_num_cached", "_copies", "_window", "_released", "_group")

    NULL_BLOCK = 0

    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True, sliding_window: int = 0, *,
                 pool: BlockPool | None = None, group: int = 0) -> None:
        """`sliding_window`: the window of every layer this manager's tables serve (0: none;
        blocks are then held for the whole context). `pool`: a pool of num_blocks + 1 blocks
        shared with other managers, its null block taken already (default: a pool of its
        own); `group`: this manager's group among those (it seeds its prefix-cache hashes)."""
        if not isinstance(sliding_window, int) or sliding_window < 0:
            raise ConfigError(f"sliding_window must be an integer >= 0, got {sliding_window!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(f"block_size must be an integer >= 1, got {block_size!r}")
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ConfigError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        if pool is None:
            pool = BlockPool(num_blocks + 1)
            if pool.allocate(1) != [self.NULL_BLOCK]:
                raise KVCacheError("the block pool did not hand out block 0 first")
        elif pool.num_blocks != num_blocks + 1 or pool.ref_count(self.NULL_BLOCK) != 1:
            raise KVCacheError(f"a shared pool must have {num_blocks} + 1 blocks and its null "
                               f"block taken")
        self._pool = pool
        self._group = group
        self._block_size = block_size
        self._tables: dict[str, list[int]] = {}
        self._fresh: list[int] = []
        self._copies = BlockCopies()
        self._caching = bool(enable_prefix_caching)
        # Per request: hashes of its first full blocks (a prefix of the chain), and how many
        # leading blocks of its table are cached or were offered to the cache already.
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_cached: dict[str, int] = {}
        self._window = sliding_window
        # Per windowed request: how many leading entries of its table are the null block.
        self._released: dict[str, int] = {}

    enable_prefix_caching = property(lambda self: self._caching)
    block_size = property(lambda self: self._block_size)
    pool = property(lambda self: self._pool)

    @property
    def sliding_window(self) -> int:
        """The window whose out-of-window blocks are released (0: none)."""
        return self._window

    @property
    def num_blocks(self) -> int:
        """Usable blocks (the null block excluded)."""
        return self._pool.num_blocks - 1

    @property
    def num_physical_blocks(self) -> int:
        """Blocks the KV cache tensors must hold: the usable ones plus the null block."""
        return self._pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached ones included (they are evicted when needed)."""
        return self._pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool's blocks in use, in [0, 1]."""
        return 1.0 - self._pool.num_free_blocks / self.num_blocks

    @property
    def groups(self) -> tuple[KVCacheManager, ...]:
        """The managers of the request's block-table groups: this one alone (a KVCacheGroups
        has several)."""
        return (self,)

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
        return num_blocks_for(num_tokens, self._block_size)

    def num_dead_blocks(self, num_computed: int) -> int:
        """Leading blocks of a sequence that no query at a position >= num_computed reads
        (tessellm.cache.sliding_window; 0 without a window)."""
        return num_dead_blocks(self._window, self._block_size, num_computed)

    def max_held_blocks(self, num_tokens: int, step_tokens: int) -> int:
        """The most blocks a lone sequence of `num_tokens` tokens holds at once when a step
        computes at most `step_tokens` (the whole context without a window)."""
        return max_held_blocks(self._window, self._block_size, num_tokens, step_tokens)

    def held_blocks(self, request_id: str) -> list[int]:
        """The blocks the request's table holds (its null entries excluded)."""
        return self._tables.get(request_id, [])[self._released.get(request_id, 0):]

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request's table holds (its null entries excluded)."""
        return len(self.held_blocks(request_id))

    def get_computed_blocks(self, request: SequenceState) -> tuple[list[int], int]:
        """The cached blocks holding the longest run of full blocks at the start of the
        request's sequence (prompt and any generated tokens), and the tokens they cover.

        Never covers the last token. Changes no reference count: pass the blocks to
        `allocate_slots` before anything else allocates. ([], 0) when caching is off.
        Raises KVCacheError for a request that holds blocks already.
        """
        if not self._caching:
            return [], 0
        rid = request.request_id
        if rid in self._tables:
            raise KVCacheError(f"request {rid!r} holds blocks already; only a request "
                               f"without blocks can start from cached ones")
        max_hit_blocks = (request.num_tokens - 1) // self._block_size
        hashes = self._hashes.setdefault(rid, [])
        extend_block_hashes(hashes, max_hit_blocks, self._block_size, request.cache_salt,
                            request.token_ids_slice, request.lora_int_id, self._group)
        blocks: list[int] = []
        for block_hash in hashes[:max_hit_blocks]:
            block_id = self._pool.cached_block(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks, len(blocks) * self._block_size

    def allocate_slots(self, request: SequenceState, num_new_tokens: int,
                       computed_blocks: Sequence[int] = ()) -> bool:
        """Grow the request's table to cover num_computed_tokens + num_new_tokens tokens, or,
        with `computed_blocks` (cache hits from get_computed_blocks, for a request without
        blocks and no computed tokens), len(computed_blocks) * block_size + num_new_tokens
        tokens, the table starting with those blocks; the caller then sets the request's
        num_computed_tokens to the tokens they cover.

        Returns False, changing nothing (but the release of blocks out of the window, which
        no query reads any more), when the free queue is too short (hits that sit in the free
        queue count against it too); the scheduler then preempts or waits.
        With a window, a grown table first releases its dead blocks
        (tessellm.cache.sliding_window); a new one holds only the hits inside the window.
        """
        hits = list(computed_blocks)
        table, lead, held_hits, missing, cow = self._growth(request, num_new_tokens, hits)
        if missing == 0 and not hits and not cow:
            return True
        revived = sum(self._pool.ref_count(b) == 0 for b in held_hits)
        if missing + revived + cow > self._pool.num_free_blocks:
            return False
        self._pool.incref(held_hits)   # first: allocating must not evict a hit
        new_blocks = self._pool.allocate(missing + cow)
        self._fresh.extend(new_blocks)
        rid = request.request_id
        if cow:  # a new list: a table list only ever grows in place (see block_table_view)
            first = request.num_computed_tokens // self._block_size
            shared, private = table[first], new_blocks.pop()
            self._copies.record(shared, private)   # its reference is held until the copy
            table = self._tables[rid] = list(table)
            table[first] = private
        if table is None:
            self._tables[rid] = [self.NULL_BLOCK] * lead + held_hits + new_blocks
            # offered already: the hits, and with a window a resumed (swapped-in) request's
            # computed full blocks (offered in its earlier life, or skipped, so that they can
            # be released without waiting for a step; null entries hold nothing to offer)
            offered = max(len(hits), request.num_computed_tokens // self._block_size
                          if self._window else 0)
            if offered:
                self._num_cached[rid] = offered
            if lead:
                self._released[rid] = lead
        else:
            table.extend(new_blocks)
        return True

    def growth(self, request: SequenceState, num_new_tokens: int,
               computed_blocks: Sequence[int] = ()) -> tuple[list[int], int]:
        """What allocate_slots(request, num_new_tokens, computed_blocks) would take: (the hits
        its table would hold, the blocks it would take from the free queue, a copy-on-write
        destination included). Releases the table's blocks out of the window first, as
        allocate_slots does; changes nothing else."""
        _, _, held_hits, missing, cow = self._growth(request, num_new_tokens,
                                                     list(computed_blocks))
        return held_hits, missing + cow

    def _growth(self, request: SequenceState, num_new_tokens: int, hits: list[int]
                ) -> tuple[list[int] | None, int, list[int], int, bool]:
        """(the table after its release of dead blocks (None: none yet), null entries of a
        new table, held hits, fresh blocks, whether the first block written is copied)."""
        if num_new_tokens < 0:
            raise KVCacheError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        rid = request.request_id
        table = self._tables.get(rid)
        start = request.num_computed_tokens + len(hits) * self._block_size
        if hits:
            check_hits(self._pool, self._block_size, request, table is not None, hits,
                       self.num_dead_blocks(start))
        if table is None:   # hits wholly out of the window are not held
            lead, held_hits, missing = new_table_split(self._window, self._block_size, start,
                                                       num_new_tokens, hits)
            return None, lead, held_hits, missing, False
        if self._window:
            table = self._release_dead(rid, table, request.num_computed_tokens)
        held = len(table)
        missing = max(self.num_blocks_needed(request.num_computed_tokens + num_new_tokens)
                      - held, 0)
        first = request.num_computed_tokens // self._block_size   # first block written
        cow = num_new_tokens > 0 and first < held and self._pool.ref_count(table[first]) \
            - self._copies.extra_refs(table[first]) > 1
        return table, 0, [], missing, cow

    def _release_dead(self, rid: str, table: list[int], num_computed: int) -> list[int]:
        """Release the table's blocks out of the window (only those offered to the prefix
        cache when caching is on) and return the table: a new list when any was."""
        dead = self.num_dead_blocks(num_computed)
        if self._caching:
            dead = min(dead, self._num_cached.get(rid, 0))
        done = self._released.get(rid, 0)
        if dead <= done:
            return table
        gone = table[done:dead]
        table = self._tables[rid] = [self.NULL_BLOCK] * dead + table[dead:]
        self._released[rid] = dead
        self._pool.free(reversed(gone))
        return table

    def cache_full_blocks(self, request: SequenceState, num_computed: int | None = None
                          ) -> None:
        """Enter the request's full blocks whose tokens are all computed into the prefix
        cache: the first `num_computed` tokens (default: request.num_computed_tokens). Call
        it after the step that computed them (their KV must be written); blocks offered
        before are skipped, so calling it every step costs only the new blocks."""
        if not self._caching:
            return
        rid = request.request_id
        table = self._tables.get(rid)
        if not table:
            return
        done = request.num_computed_tokens if num_computed is None else num_computed
        num_full = min(done // self._block_size, len(table))
        start = self._num_cached.get(rid, 0)
        if num_full <= start:
            return
        hashes = self._hashes.setdefault(rid, [])
        extend_block_hashes(hashes, num_full, self._block_size, request.cache_salt,
                            request.token_ids_slice, request.lora_int_id, self._group)
        for i in range(start, num_full):
            if table[i] == self.NULL_BLOCK:
                raise KVCacheError(f"request {rid!r}: block {i} was released before it was "
                                   f"offered to the prefix cache")
            self._pool.cache_block(table[i], hashes[i])
        self._num_cached[rid] = num_full

    def fork(self, parent: SequenceState, child: SequenceState) -> None:
        """Give `child` (holding no blocks) the parent's table, every block shared; the child
        then has the parent's computed tokens (the caller sets its count)."""
        pid, cid = parent.request_id, child.request_id
        if cid in self._tables:
            raise KVCacheError(f"request {cid!r} holds blocks already and cannot be forked")
        table = self._tables.get(pid)
        if not table:
            raise KVCacheError(f"request {pid!r} holds no blocks to fork")
        released = self._released.get(pid, 0)
        self._pool.incref(table[released:])
        self._tables[cid] = list(table)
        if released:
            self._released[cid] = released
        if pid in self._hashes:
            self._hashes[cid] = list(self._hashes[pid])
        if pid in self._num_cached:
            self._num_cached[cid] = self._num_cached[pid]

    def take_block_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write pairs (shared source, fresh destination) since the previous call;
        the destinations are among take_fresh_blocks() and must be copied after zeroing.
        Drops the references the sources were held by for their copies: call it once the
        step's allocations are done (Scheduler.schedule does), before the next step's."""
        return self._copies.take(self._pool)

    def take_fresh_blocks(self) -> list[int]:
        """Blocks taken from the free queue since the previous call (each once), for zeroing
        before use. Cache hits are not among them."""
        fresh, self._fresh = self._fresh, []
        return fresh

    def free(self, request: SequenceState) -> None:
        """Return all the request's blocks (not its null entries), last block first, and
        forget its table (cached blocks stay cached until evicted). A request without blocks
        is a no-op."""
        rid = request.request_id
        self._hashes.pop(rid, None)
        self._num_cached.pop(rid, None)
        released = self._released.pop(rid, 0)
        table = self._tables.pop(rid, None)
        if table:
            self._pool.free(reversed(table[released:]))

    def trim(self, request: SequenceState, num_tokens: int) -> None:
        """Free the blocks of the request's table past those that hold its first `num_tokens`
        tokens (speculation: the slots of rejected drafts), last block first; the table
        becomes a new list. Such blocks were never cached (their positions were not
        computed); raises KVCacheError if one was."""
        rid = request.request_id
        table = self._tables.get(rid)
        keep = self.num_blocks_needed(num_tokens)
        if not table or len(table) <= keep:
            return
        if self._num_cached.get(rid, 0) > keep:
            raise KVCacheError(f"request {rid!r}: cannot trim cached blocks ({keep} of "
                               f"{len(table)} kept)")
        self._tables[rid] = table[:keep]
        self._pool.free(reversed(table[keep:]))

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table ([] when it holds no blocks)."""
        return list(self._tables.get(request_id, ()))

    def block_table_view(self, request_id: str) -> Sequence[int]:
        """The request's block table itself, read-only (never mutate it). Invariant: a table
        list only ever grows by appending; any other change (copy-on-write, free and
        reallocation, fork) gives the request a new list, so a reader holding the list it saw
        before knows by identity whether only its tail can be new."""
        return self._tables.get(request_id, ())

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
                f"free={self.num_free_blocks}, requests={len(self._tables)}, "
                f"prefix_caching={self._caching})")

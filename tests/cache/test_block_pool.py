"""BlockPool: LRU free queue, reference counts, cached blocks and their eviction, and the
invariants under random operations."""
from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tessellm.cache.block_pool import BlockPool, BlockPoolError, NoFreeBlocksError
from tessellm.errors import ConfigError, TessellmError


def test_allocate_takes_from_head_and_free_appends_in_given_order() -> None:
    pool = BlockPool(6)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.num_free_blocks == 3
    pool.free([2, 1, 0])                       # a request's blocks, last first
    assert pool.free_block_ids() == [3, 4, 5, 2, 1, 0]
    assert pool.allocate(4) == [3, 4, 5, 2]    # least recently freed first
    assert [pool.ref_count(b) for b in range(6)] == [0, 0, 1, 1, 1, 1]


def test_not_enough_blocks_allocates_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(NoFreeBlocksError) as info:
        pool.allocate(2)
    assert isinstance(info.value, TessellmError)
    assert pool.num_free_blocks == 1
    assert pool.allocate(0) == []
    assert pool.allocate(1) == [3]


def test_shared_block_returns_to_queue_only_at_zero() -> None:
    pool = BlockPool(3)
    a = pool.allocate(2)
    pool.incref(a)
    assert [pool.ref_count(b) for b in a] == [2, 2]
    pool.free(reversed(a))
    assert pool.num_free_blocks == 1
    pool.free(reversed(a))
    assert pool.free_block_ids() == [2, 1, 0]


def test_incref_revives_a_free_block() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.free(blocks)
    pool.incref([2])
    assert pool.ref_count(2) == 1
    assert pool.free_block_ids() == [0, 1, 3]
    assert pool.allocate(3) == [0, 1, 3]


def test_misuse_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    with pytest.raises(BlockPoolError):
        pool.free([blocks[0], blocks[0]])      # held once, freed twice
    with pytest.raises(BlockPoolError):
        pool.free([3])                         # free already
    with pytest.raises(BlockPoolError):
        pool.free([blocks[1], 4])              # out of range
    with pytest.raises(BlockPoolError):
        pool.incref([-1])
    with pytest.raises(BlockPoolError):
        pool.allocate(-1)
    assert [pool.ref_count(b) for b in range(4)] == [1, 1, 0, 0]
    assert pool.free_block_ids() == [2, 3]


def test_cached_free_blocks_stay_hits_until_evicted_in_lru_order() -> None:
    pool = BlockPool(5)
    a = pool.allocate(3)                                  # [0, 1, 2]
    for b, h in zip(a, (b"h0", b"h1", b"h2")):
        assert pool.cache_block(b, h)
    pool.free(reversed(a))                                # last block first
    assert pool.free_block_ids() == [3, 4, 2, 1, 0] and pool.num_cached_blocks == 3
    assert pool.cached_block(b"h0") == 0                  # free, still a hit
    assert pool.allocate(2) == [3, 4] and pool.num_evictions == 0
    assert pool.allocate(1) == [2]                        # the request's last block goes first
    assert pool.cached_block(b"h2") is None and pool.block_hash(2) is None
    assert pool.num_evictions == 1 and pool.num_cached_blocks == 2
    pool.incref([pool.cached_block(b"h0")])               # a hit revives block 0
    assert pool.free_block_ids() == [1] and pool.ref_count(0) == 1
    assert pool.allocate(1) == [1] and pool.cached_block(b"h1") is None
    assert pool.cached_block(b"h0") == 0 and pool.block_hash(0) == b"h0"


def test_cache_block_rules() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    with pytest.raises(BlockPoolError):
        pool.cache_block(2, b"x")                         # free: nobody vouches for its KV
    with pytest.raises(BlockPoolError):
        pool.cache_block(9, b"x")
    assert pool.cache_block(a, b"x")
    assert not pool.cache_block(b, b"x")                  # a duplicate stays uncached
    assert not pool.cache_block(a, b"y")                  # a block is filled once
    assert pool.block_hash(b) is None and pool.cached_block(b"x") == a
    pool.free([a, b])
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 1


@pytest.mark.parametrize("bad", [0, -3, 2.0])
def test_bad_size(bad: object) -> None:
    with pytest.raises(ConfigError):
        BlockPool(bad)  # type: ignore[arg-type]


HASHES = [bytes([i]) for i in range(8)]


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / incref / free / cache against a model: holders are lists of block ids,
    each holding one reference to each of its blocks; the model queue mirrors the LRU order;
    the model cache maps hashes to blocks and loses a block exactly when it is allocated."""

    NUM_BLOCKS = 12

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(self.NUM_BLOCKS)
        self.holders: list[list[int]] = []
        self.queue: list[int] = list(range(self.NUM_BLOCKS))
        self.cache: dict[bytes, int] = {}

    @rule(n=st.integers(0, 5))
    def allocate(self, n: int) -> None:
        if n > len(self.queue):
            with pytest.raises(NoFreeBlocksError):
                self.pool.allocate(n)
            return
        got = self.pool.allocate(n)
        assert got == self.queue[:n]
        del self.queue[:n]
        self.cache = {h: b for h, b in self.cache.items() if b not in got}
        self.holders.append(got)

    @precondition(lambda self: bool(self.holders))
    @rule(data=st.data())
    def share(self, data: st.DataObject) -> None:
        blocks = data.draw(st.sampled_from(self.holders))
        self.pool.incref(blocks)
        self.holders.append(list(blocks))

    @precondition(lambda self: bool(self.queue))
    @rule(data=st.data())
    def revive(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(self.queue))
        self.pool.incref([block])
        self.queue.remove(block)
        self.holders.append([block])

    @precondition(lambda self: bool(self.holders))
    @rule(data=st.data(), reverse=st.booleans())
    def free(self, data: st.DataObject, reverse: bool) -> None:
        i = data.draw(st.integers(0, len(self.holders) - 1))
        blocks = self.holders.pop(i)
        order = blocks[::-1] if reverse else blocks
        self.pool.free(order)
        still_held = {b for h in self.holders for b in h}
        self.queue.extend(b for b in order if b not in still_held)

    @precondition(lambda self: bool(self.holders))
    @rule(data=st.data(), block_hash=st.sampled_from(HASHES))
    def cache(self, data: st.DataObject, block_hash: bytes) -> None:
        block = data.draw(st.sampled_from(data.draw(st.sampled_from(self.holders)) or [None]))
        if block is None:
            return
        fresh = block_hash not in self.cache and block not in self.cache.values()
        assert self.pool.cache_block(block, block_hash) == fresh
        if fresh:
            self.cache[block_hash] = block

    @invariant()
    def invariants_hold(self) -> None:
        pool = self.pool
        queue = pool.free_block_ids()
        assert queue == self.queue
        assert len(queue) == len(set(queue)) == pool.num_free_blocks
        refs = [pool.ref_count(b) for b in range(self.NUM_BLOCKS)]
        for b in range(self.NUM_BLOCKS):
            assert refs[b] == sum(h.count(b) for h in self.holders)
            assert (b in queue) == (refs[b] == 0)
        assert pool.num_free_blocks + sum(r > 0 for r in refs) == self.NUM_BLOCKS
        assert {h: pool.cached_block(h) for h in HASHES if pool.cached_block(h) is not None} \
            == self.cache
        assert pool.num_cached_blocks == len(self.cache)
        for h, b in self.cache.items():
            assert pool.block_hash(b) == h


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)

"""BlockPool: LRU free queue, reference counts, and the invariants under random operations."""
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


@pytest.mark.parametrize("bad", [0, -3, 2.0])
def test_bad_size(bad: object) -> None:
    with pytest.raises(ConfigError):
        BlockPool(bad)  # type: ignore[arg-type]


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / incref / free against a model: holders are lists of block ids, each
    holding one reference to each of its blocks; the model queue mirrors the LRU order."""

    NUM_BLOCKS = 12

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(self.NUM_BLOCKS)
        self.holders: list[list[int]] = []
        self.queue: list[int] = list(range(self.NUM_BLOCKS))

    @rule(n=st.integers(0, 5))
    def allocate(self, n: int) -> None:
        if n > len(self.queue):
            with pytest.raises(NoFreeBlocksError):
                self.pool.allocate(n)
            return
        got = self.pool.allocate(n)
        assert got == self.queue[:n]
        del self.queue[:n]
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


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)

"""Copy-on-write in the KV manager: a fork shares every block; the first write into a shared
block takes a fresh block and records the copy; reference counts stay the table counts."""
from __future__ import annotations

from collections import Counter

from tessellm.cache.kv_manager import KVCacheManager
from tessellm.request import Request
from tessellm.sampling_params import SamplingParams


def _req(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=8), 0.0)


def _check_refs(kv: KVCacheManager, rids: list[str]) -> None:
    held = Counter(b for rid in rids for b in kv.block_table(rid))
    for b, c in held.items():
        assert kv.pool.ref_count(b) == c
    assert len(held) + kv.num_free_blocks == kv.num_blocks


def test_fork_shares_and_the_partial_block_is_copied_before_a_write() -> None:
    kv = KVCacheManager(16, 4)
    parent, child = _req("p", 6), _req("c", 6)
    assert kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    kv.take_fresh_blocks()
    kv.fork(parent, child)
    child.num_computed_tokens = 6
    shared = kv.block_table("p")
    assert kv.block_table("c") == shared and all(kv.pool.ref_count(b) == 2 for b in shared)
    _check_refs(kv, ["p", "c"])
    # the child writes position 6: block 1 (positions 4..7) is shared -> copied
    assert kv.allocate_slots(child, 1)
    copies = kv.take_block_copies()
    new = kv.block_table("c")[1]
    assert copies == [(shared[1], new)] and new in kv.take_fresh_blocks()
    assert kv.block_table("c")[0] == shared[0] and kv.pool.ref_count(shared[1]) == 1
    # the parent is the last holder now: it writes in place
    assert kv.allocate_slots(parent, 1) and kv.take_block_copies() == []
    _check_refs(kv, ["p", "c"])
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == kv.num_blocks


def test_copy_on_write_is_all_or_nothing() -> None:
    kv = KVCacheManager(2, 4)
    parent, child = _req("p", 6), _req("c", 6)
    assert kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = child.num_computed_tokens = 6
    kv.fork(parent, child)
    assert not kv.allocate_slots(child, 1)           # no block for the copy
    assert kv.take_block_copies() == [] and kv.block_table("c") == kv.block_table("p")
    kv.free(child)
    assert kv.allocate_slots(parent, 1) and kv.take_block_copies() == []
    kv.free(parent)
    assert kv.num_free_blocks == kv.num_blocks


def test_full_block_boundary_needs_no_copy() -> None:
    kv = KVCacheManager(8, 4)
    parent, child = _req("p", 8), _req("c", 8)
    assert kv.allocate_slots(parent, 8)
    parent.num_computed_tokens = child.num_computed_tokens = 8
    kv.fork(parent, child)
    assert kv.allocate_slots(child, 1) and kv.take_block_copies() == []
    assert kv.block_table("c")[:2] == kv.block_table("p")
    _check_refs(kv, ["p", "c"])
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == kv.num_blocks

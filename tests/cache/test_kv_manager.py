"""KVCacheManager: block tables grow by exactly what is needed, all-or-nothing, freed in reverse."""
from __future__ import annotations

import pytest

from tessellm.cache.kv_manager import KVCacheError, KVCacheManager
from tessellm.errors import ConfigError
from tessellm.request import Request
from tessellm.sampling_params import SamplingParams


def make_request(rid: str, n_prompt: int = 4) -> Request:
    return Request(rid, list(range(n_prompt)), SamplingParams(max_tokens=4), arrival_time=0.0)


def test_table_grows_to_cover_computed_plus_new() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = make_request("a", 9)
    assert kv.block_table("a") == []
    assert kv.allocate_slots(r, 5)
    assert kv.block_table("a") == [1, 2]  # block 0 is the null block
    r.num_computed_tokens = 5
    assert kv.allocate_slots(r, 3)               # 8 tokens: still two blocks
    assert kv.block_table("a") == [1, 2]
    assert kv.allocate_slots(r, 4)               # 9 tokens: a third block
    assert kv.block_table("a") == [1, 2, 3]
    assert kv.allocate_slots(r, 0)
    assert kv.num_free_blocks == 5
    assert kv.usage == pytest.approx(3 / 8)


def test_not_enough_blocks_allocates_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a, b = make_request("a"), make_request("b")
    assert kv.allocate_slots(a, 4)
    assert not kv.allocate_slots(b, 3)           # needs 2 blocks, 1 free
    assert kv.block_table("b") == []
    assert kv.num_free_blocks == 1
    assert kv.allocate_slots(b, 2)


def test_free_returns_blocks_last_first_and_is_idempotent() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = make_request("a")
    kv.allocate_slots(a, 6)                      # blocks 1, 2, 3
    kv.free(a)
    assert kv.block_table("a") == []
    assert kv.pool.free_block_ids() == [4, 3, 2, 1]
    kv.free(a)
    kv.free(make_request("never-seen"))
    assert kv.num_free_blocks == 4
    b = make_request("b")
    kv.allocate_slots(b, 4)
    assert kv.block_table("b") == [4, 3]         # a's last block is evicted first


def test_no_block_in_two_tables() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=3)
    reqs = [make_request(str(i)) for i in range(4)]
    for step in range(3):
        for r in reqs:
            kv.allocate_slots(r, 2)
            r.num_computed_tokens += 2
    tables = [kv.block_table(r.request_id) for r in reqs]
    flat = [b for t in tables for b in t]
    assert len(flat) == len(set(flat)) == 8 and kv.num_free_blocks == 2


def test_slot_mapping() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate_slots(make_request("x"), 4)      # take block 1 so tables are not trivial
    r = make_request("a", 10)
    kv.allocate_slots(r, 10)
    assert kv.block_table("a") == [2, 3, 4]
    assert kv.slot_mapping(r, 0, 10) == [8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
    assert kv.slot_mapping(r, 6, 12) == [14, 15, 16, 17, 18, 19]
    assert kv.slot_mapping(r, 3, 3) == []
    with pytest.raises(KVCacheError):
        kv.slot_mapping(r, 0, 13)
    with pytest.raises(KVCacheError):
        kv.slot_mapping(r, 5, 4)
    with pytest.raises(KVCacheError):
        kv.slot_mapping(make_request("none"), 0, 1)


def test_sizes_and_validation() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=16)
    assert (kv.num_blocks, kv.block_size, kv.usage) == (5, 16, 0.0)
    assert [kv.num_blocks_needed(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
    with pytest.raises(KVCacheError):
        kv.allocate_slots(make_request("a"), -1)
    with pytest.raises(ConfigError):
        KVCacheManager(num_blocks=5, block_size=0)
    with pytest.raises(ConfigError):
        KVCacheManager(num_blocks=0, block_size=16)


def test_null_block_is_reserved_and_fresh_blocks_are_reported_once() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=2)
    assert kv.num_physical_blocks == 4 and kv.num_blocks == 3 and kv.num_free_blocks == 3
    a, b = make_request("a", 6), make_request("b", 2)
    assert kv.allocate_slots(a, 6)
    assert not kv.allocate_slots(b, 2)              # the null block is never handed out
    assert KVCacheManager.NULL_BLOCK not in kv.block_table("a")
    assert sorted(kv.take_fresh_blocks()) == [1, 2, 3]
    assert kv.take_fresh_blocks() == []
    kv.free(a)
    assert kv.allocate_slots(b, 2)
    assert len(kv.take_fresh_blocks()) == 1
    kv.free(b)
    assert kv.num_free_blocks == kv.num_blocks and kv.usage == 0.0

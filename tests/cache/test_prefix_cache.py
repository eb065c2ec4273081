"""Prefix-cache hashing, the hash <-> block map, and the hit counters."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from tessellm.cache.prefix_cache import (
    CachedBlockMap, PrefixCacheStats, extend_block_hashes, hash_block, root_hash)


def chain(tokens: list[int], block_size: int, salt: str | None = None) -> list[bytes]:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, len(tokens) // block_size, block_size, salt,
                        lambda a, b: tokens[a:b])
    return hashes


def test_hashes_are_stable_and_name_the_whole_prefix() -> None:
    h = chain([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(h) == 2                                  # the partial block is not hashed
    assert h == chain([1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert h[0] == hash_block(root_hash(None), [1, 2, 3, 4])
    assert h[1] == hash_block(h[0], [5, 6, 7, 8])
    assert all(len(x) == 32 for x in h)                 # full sha256 digests
    # The same tokens after a different prefix are a different block.
    assert chain([0, 2, 3, 4, 5, 6, 7, 8], 4)[1] != h[1]
    # Fixed across processes and runs (no PYTHONHASHSEED dependence): a pinned value.
    assert h[0].hex()[:16] == "a00b461d57884c3e"
    assert hash_block(root_hash(None), [1, 2]) != hash_block(root_hash(None), [2, 1])


def test_salt_separates_chains() -> None:
    tokens = list(range(8))
    plain, a, a2, b, empty = (chain(tokens, 4, s) for s in (None, "a", "a", "b", ""))
    assert a == a2
    assert len({plain[0], a[0], b[0], empty[0]}) == 4


def test_extend_only_appends() -> None:
    tokens = list(range(20))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, 2, 4, None, lambda a, b: tokens[a:b])
    first = list(hashes)
    extend_block_hashes(hashes, 5, 4, None, lambda a, b: tokens[a:b])
    assert hashes[:2] == first and hashes == chain(tokens, 4)
    extend_block_hashes(hashes, 3, 4, None, lambda a, b: 1 / 0)   # nothing to add: no call
    assert len(hashes) == 5


@settings(max_examples=50, deadline=None)
@given(a=st.lists(st.integers(0, 3), max_size=24), b=st.lists(st.integers(0, 3), max_size=24),
       block_size=st.sampled_from([1, 2, 4]))
def test_equal_hash_iff_equal_prefix(a: list[int], b: list[int], block_size: int) -> None:
    ha, hb = chain(a, block_size), chain(b, block_size)
    for i in range(min(len(ha), len(hb))):
        same_prefix = a[:(i + 1) * block_size] == b[:(i + 1) * block_size]
        assert (ha[i] == hb[i]) == same_prefix


def test_cached_block_map_is_a_bijection() -> None:
    m = CachedBlockMap()
    assert m.insert(b"x", 3) and len(m) == 1
    assert not m.insert(b"x", 4)          # the first copy stays cached
    assert not m.insert(b"y", 3)          # a block holds one thing
    assert m.get(b"x") == 3 and m.hash_of(3) == b"x" and m.get(b"y") is None
    assert m.evict(3) and not m.evict(3)
    assert m.get(b"x") is None and m.hash_of(3) is None and len(m) == 0
    assert m.insert(b"y", 3)


def test_stats() -> None:
    s = PrefixCacheStats()
    assert s.hit_rate == 0.0
    s.record(10, 8)
    s.record(6, 0)
    assert (s.queries, s.hits, s.num_requests, s.num_hit_requests) == (16, 8, 2, 1)
    assert s.hit_rate == 0.5

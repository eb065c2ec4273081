"""The KV manager with a sliding window: the blocks no later query reads are released (their
table entries become the null block), a prefill chunk keeps the window before it, prefix
hits hold only the blocks inside the window, forks and frees never touch the null block, and
with prefix caching a block is released only once offered to the cache. Also the
copy-on-write source that a preemption in the same step frees (with or without a window)."""
from __future__ import annotations

import pytest

from tessellm.cache.kv_manager import KVCacheError, KVCacheManager
from tessellm.errors import ConfigError
from tessellm.request import Request
from tessellm.sampling_params import SamplingParams

NULL = KVCacheManager.NULL_BLOCK


def _req(rid: str, n: int, first: int = 1) -> Request:
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=400), 0.0)


def _grow(kv: KVCacheManager, r: Request, n: int, hits=(), cache: bool = True) -> None:
    """One synchronous step of `n` tokens: allocate, compute, cache (as the scheduler does)."""
    assert kv.allocate_slots(r, n, hits)
    r.num_computed_tokens += n + len(hits) * kv.block_size
    if cache:
        kv.cache_full_blocks(r)


def _check_refs(kv: KVCacheManager, rids: list[str]) -> None:
    held: dict[int, int] = {}
    for rid in rids:
        for b in kv.block_table(rid):
            if b != NULL:
                held[b] = held.get(b, 0) + 1
    assert all(kv.pool.ref_count(b) == c for b, c in held.items())
    assert len(held) + kv.num_free_blocks == kv.num_blocks
    assert kv.pool.ref_count(NULL) == 1          # reserved, never shared or freed


def test_window_validation_and_dead_blocks() -> None:
    with pytest.raises(ConfigError, match="sliding_window"):
        KVCacheManager(8, 4, sliding_window=-1)
    kv = KVCacheManager(8, 4, sliding_window=6)
    # a query at c sees c - 5 .. c: blocks wholly before c - 5 are dead
    assert [kv.num_dead_blocks(c) for c in range(0, 16)] == \
        [0] * 9 + [1] * 4 + [2] * 3
    assert KVCacheManager(8, 4).num_dead_blocks(1000) == 0


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("window, bs", [(8, 4), (6, 4), (5, 2), (3, 1), (16, 16)])
def test_decode_far_past_the_window_holds_a_bounded_table(window, bs, caching) -> None:
    """Prompt 3 tokens, then 300 decode steps: at each step the table holds exactly the
    blocks of positions c - W + 1 .. c (at most ceil((W - 1) / bs) + 1), the rest are null,
    and freeing returns every block."""
    kv = KVCacheManager(64, bs, enable_prefix_caching=caching, sliding_window=window)
    r = _req("r", 3)
    _grow(kv, r, 3)
    most = 0
    for _ in range(300):
        r.append_output(5)
        c = r.num_computed_tokens
        assert kv.allocate_slots(r, 1)
        table = kv.block_table("r")
        first = max(c - window + 1, 0) // bs
        assert table[:first] == [NULL] * first and NULL not in table[first:]
        assert len(table) == c // bs + 1
        assert kv.num_held_blocks("r") == len(table) - first
        most = max(most, kv.num_held_blocks("r"))
        _check_refs(kv, ["r"])
        r.num_computed_tokens += 1
        kv.cache_full_blocks(r)
    assert most == -(-(window - 1) // bs) + 1
    kv.free(r)
    assert kv.num_free_blocks == kv.num_blocks


def test_a_prefill_chunk_keeps_the_window_before_it() -> None:
    """Window 8, blocks of 4: a chunk from position 20 reads keys from 13 on, so block 3
    (12..15) is kept and blocks 0..2 released; the next chunk from 28 releases up to 4."""
    kv = KVCacheManager(32, 4, sliding_window=8)
    r = _req("r", 40)
    _grow(kv, r, 20)
    assert kv.num_held_blocks("r") == 5            # nothing released before the first chunk
    assert kv.allocate_slots(r, 8)                 # computes 20..27
    table = kv.block_table("r")
    assert table[:3] == [NULL] * 3 and NULL not in table[3:] and len(table) == 7
    r.num_computed_tokens = 28
    kv.cache_full_blocks(r)
    assert kv.allocate_slots(r, 12)                # 28..39 needs keys from 21 on
    assert kv.block_table("r")[:5] == [NULL] * 5 and kv.num_held_blocks("r") == 5
    _check_refs(kv, ["r"])


def test_released_blocks_stay_cached_and_a_hit_holds_only_its_window() -> None:
    """A released block goes through the normal free path: it stays a prefix-cache hit. A
    later request with the same 24 first tokens hits all 6 blocks but holds only those its
    next query's window reaches (positions 17.. for a window of 8)."""
    kv = KVCacheManager(32, 4, sliding_window=8)
    a = _req("a", 30)
    for n in (12, 12, 6):
        _grow(kv, a, n)
    assert kv.block_table("a")[:4] == [NULL] * 4   # c = 24 when the last chunk started
    kv.free(a)
    assert kv.num_free_blocks == kv.num_blocks and kv.pool.num_cached_blocks == 7
    b = _req("b", 26)
    hits, n_hit = kv.get_computed_blocks(b)
    assert n_hit == 24 and len(hits) == 6
    assert kv.growth(b, 2, hits) == (hits[4:], 1)
    free_before = kv.num_free_blocks
    assert kv.allocate_slots(b, 2, hits)
    table = kv.block_table("b")
    assert table[:4] == [NULL] * 4 and table[4:6] == hits[4:] and len(table) == 7
    assert kv.num_free_blocks == free_before - 3   # two hits revived, one fresh block
    assert all(kv.pool.ref_count(h) == 0 for h in hits[:4])   # dead hits stay free, cached
    assert kv.take_fresh_blocks()[-1] == table[6]
    b.num_computed_tokens = 24
    _check_refs(kv, ["b"])
    kv.free(b)
    assert kv.num_free_blocks == kv.num_blocks


def test_with_caching_a_block_is_released_only_once_offered() -> None:
    """Async scheduling allocates step N + 1 before step N is completed (cached): a block
    not yet offered to the cache is kept until cache_full_blocks has seen it."""
    kv = KVCacheManager(32, 4, sliding_window=4)
    r = _req("r", 30)
    assert kv.allocate_slots(r, 16)
    r.num_computed_tokens = 16                    # committed, not completed
    assert kv.allocate_slots(r, 4)                # dead: 3 blocks, none offered yet
    assert NULL not in kv.block_table("r")
    kv.cache_full_blocks(r, 16)                   # step N completes
    r.num_computed_tokens = 20
    assert kv.allocate_slots(r, 4)                # now up to block 3 (keys 17.. needed)
    assert kv.block_table("r")[:4] == [NULL] * 4
    kv.cache_full_blocks(r, 20)
    _check_refs(kv, ["r"])
    # without caching nothing waits
    plain = KVCacheManager(32, 4, enable_prefix_caching=False, sliding_window=4)
    q = _req("q", 30)
    assert plain.allocate_slots(q, 16)
    q.num_computed_tokens = 16
    assert plain.allocate_slots(q, 4)
    assert plain.block_table("q")[:3] == [NULL] * 3


def test_caching_a_released_position_is_refused() -> None:
    kv = KVCacheManager(32, 4, enable_prefix_caching=False, sliding_window=4)
    r = _req("r", 30)
    _grow(kv, r, 16, cache=False)
    assert kv.allocate_slots(r, 4)
    kv._caching = True   # a manager whose rule was broken: the release must not go unseen
    with pytest.raises(KVCacheError, match="released before it was offered"):
        kv.cache_full_blocks(r, 20)


def test_fork_shares_only_held_blocks_and_trim_keeps_the_nulls() -> None:
    kv = KVCacheManager(32, 4, sliding_window=6)
    parent, child = _req("p", 14), _req("c", 14)
    _grow(kv, parent, 10)
    assert kv.allocate_slots(parent, 4)           # 10..13: block 0 (0..3) released
    parent.num_computed_tokens = 14
    kv.cache_full_blocks(parent)
    kv.take_fresh_blocks()
    kv.fork(parent, child)
    child.num_computed_tokens = 14
    assert kv.block_table("c") == kv.block_table("p")
    assert kv.block_table("c")[0] == NULL
    _check_refs(kv, ["p", "c"])
    assert kv.allocate_slots(child, 1)            # writes 14: block 3 copied, block 1 released
    (src, dst), = kv.take_block_copies()
    assert kv.block_table("c")[:2] == [NULL, NULL] and kv.block_table("c")[3] == dst
    assert kv.block_table("p")[3] == src
    _check_refs(kv, ["p", "c"])
    # speculation's rollback: slots past the tokens go, the null entries stay
    child.num_computed_tokens = 14
    assert kv.allocate_slots(child, 6)            # 14..19 verified as drafts
    kv.trim(child, 16)
    assert kv.block_table("c")[:2] == [NULL, NULL] and len(kv.block_table("c")) == 4
    _check_refs(kv, ["p", "c"])
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == kv.num_blocks and kv.pool.ref_count(NULL) == 1


def test_a_copy_source_freed_in_the_same_step_is_not_handed_out() -> None:
    """A child copies its shared partial block, then the parent (the last holder) is
    preempted in the same schedule(): the source must stay held until the copies are taken
    (the runner copies it before the step), not be allocated (and zeroed) first."""
    for window in (0, 8):
        kv = KVCacheManager(4, 4, enable_prefix_caching=False, sliding_window=window)
        parent, child = _req("p", 6), _req("c", 6)
        assert kv.allocate_slots(parent, 6)
        parent.num_computed_tokens = child.num_computed_tokens = 6
        kv.fork(parent, child)
        assert kv.allocate_slots(child, 1)        # copy (shared 1, fresh) for the child
        kv.free(parent)                           # preempted in the same step
        other = _req("o", 8, first=50)
        # one block is free: the copy source is still held (ref 0 once the copies are taken)
        assert kv.num_free_blocks == 1
        assert not kv.allocate_slots(other, 8)
        assert kv.allocate_slots(other, 4)
        (src, dst), = kv.take_block_copies()
        assert src not in kv.block_table("o") and kv.pool.ref_count(src) == 0
        kv.free(child)
        kv.free(other)
        assert kv.num_free_blocks == kv.num_blocks

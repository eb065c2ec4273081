"""Block-table groups over one pool (tessellm.cache.kv_groups): the layout of Gemma-style layer
patterns; a windowed group's table stays bounded while the full group's grows; allocation is
all-or-nothing across groups (a refused one leaves nothing behind), and one group's
allocation never evicts another group's prefix hit; a hit is the longest run cached in every
group; fork, trim, free and swap cover every group; a pool too small for one window is a
start-up error."""
from __future__ import annotations

import pytest

from tessellm.cache.host_pool import SwapSpace
from tessellm.cache.kv_groups import (KVCacheGroups, KVCacheLayout, check_pool_holds_a_window,
                                      make_kv_cache)
from tessellm.cache.kv_manager import KVCacheManager
from tessellm.cache.sliding_window import max_held_blocks
from tessellm.errors import ConfigError
from tessellm.request import Request
from tessellm.sampling_params import SamplingParams

NULL = KVCacheManager.NULL_BLOCK


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=400), 0.0)


def _step(kv: KVCacheGroups, r: Request, n: int, hits=()) -> None:
    """One synchronous step of `n` tokens: allocate, compute, cache (as the scheduler does)."""
    assert kv.allocate_slots(r, n, hits)
    r.num_computed_tokens += n + len(hits) // len(kv.groups) * kv.block_size
    kv.cache_full_blocks(r)


def _check_refs(kv: KVCacheGroups, rids: list[str]) -> None:
    """Reference counts are the tables holding each block, across groups; no block is in two
    groups; the null block is never held."""
    held: dict[int, int] = {}
    owner: dict[int, int] = {}
    for g, m in enumerate(kv.groups):
        for rid in rids:
            for b in m.held_blocks(rid):
                assert b != NULL and owner.setdefault(b, g) == g, (b, g)
                held[b] = held.get(b, 0) + 1
    assert all(kv.pool.ref_count(b) == c for b, c in held.items())
    assert len(held) + kv.num_free_blocks == kv.num_blocks
    assert kv.pool.ref_count(NULL) == 1


def test_layouts_of_gemma_layer_patterns() -> None:
    gemma2 = KVCacheLayout.of([8, 0, 8, 0])
    assert gemma2 == KVCacheLayout(windows=(0, 8), layer_groups=(1, 0, 1, 0),
                                   layer_tensors=(0, 0, 1, 1))
    assert gemma2.num_tensors == 2
    # Gemma 3 1B: every sixth layer full (4 of 26); the windowed ones in groups of 4
    gemma3 = KVCacheLayout.of([0 if (i + 1) % 6 == 0 else 512 for i in range(26)])
    assert gemma3.windows == (0,) + (512,) * 6 and gemma3.num_tensors == 4
    assert [gemma3.layer_groups.count(g) for g in range(7)] == [4, 4, 4, 4, 4, 4, 2]
    for g in range(7):   # a group's layers use distinct tensors
        tensors = [t for t, lg in zip(gemma3.layer_tensors, gemma3.layer_groups) if lg == g]
        assert len(set(tensors)) == len(tensors)
    assert KVCacheLayout.of([8, 8, 8]) == KVCacheLayout((8,), (0, 0, 0), (0, 1, 2))
    assert KVCacheLayout.of([8, 0], grouped=False) == KVCacheLayout((0,), (0, 0), (0, 1))
    assert type(make_kv_cache(8, 4, (8,))) is KVCacheManager
    assert type(make_kv_cache(8, 4, (0, 8))) is KVCacheGroups


@pytest.mark.parametrize("caching", [False, True])
def test_the_windowed_group_stays_bounded_while_the_full_group_grows(caching) -> None:
    """Prompt 10, then 100 decodes: the window-8 group holds at most ceil(7 / 4) + 1 = 3
    blocks at each step, the full group ceil(c / 4); everything returns on free."""
    kv = KVCacheGroups(64, 4, (0, 8), enable_prefix_caching=caching)
    full, windowed = kv.groups
    r = _req("r", range(1, 11))
    _step(kv, r, 10)
    most = 0
    for i in range(100):
        r.append_output(1000 + i)
        _step(kv, r, 1)
        c = r.num_computed_tokens
        assert full.num_held_blocks("r") == -(-c // 4)
        most = max(most, windowed.num_held_blocks("r"))
        assert windowed.num_held_blocks("r") <= max_held_blocks(8, 4, c, 1) == 3
        _check_refs(kv, ["r"])
    assert most == 3 and kv.num_held_blocks("r") == -(-110 // 4) + 3
    kv.free(r)
    assert kv.num_free_blocks == kv.num_blocks


def test_a_refused_allocation_leaves_nothing_in_any_group() -> None:
    """12 tokens need 3 blocks in each group: 6 > 5 free, refused whole (though the first
    group's 3 would fit), then granted once a block is free again."""
    kv = KVCacheGroups(6, 4, (0, 8))
    other = _req("o", [9])
    _step(kv, other, 1)                   # one block in each group: 4 free
    assert kv.num_free_blocks == 4
    r = _req("r", range(1, 13))
    assert kv.growth(r, 12) == ([], 6)
    assert not kv.allocate_slots(r, 12)
    assert kv.num_free_blocks == 4 and kv.held_blocks("r") == []
    assert all(m.block_table("r") == [] for m in kv.groups)
    assert kv.take_fresh_blocks() == [o for o in kv.held_blocks("o")]
    kv.free(other)
    assert kv.allocate_slots(r, 12) and kv.num_held_blocks("r") == 6
    _check_refs(kv, ["r"])


def test_no_group_evicts_another_groups_hit() -> None:
    """r1's 8 tokens are cached in both groups (blocks 1, 2 and 3, 4); r0's two uncached blocks
    are freed after them, so the free queue is [2, 1, 4, 3, 5, 6]. r2 (the same 8 tokens and
    one more) hits both groups and needs a fresh block in each: the first group's must not be
    taken from the head of the queue, which holds the second group's hits."""
    kv = KVCacheGroups(6, 4, (0, 16))
    r1 = _req("r1", range(1, 9))
    _step(kv, r1, 8)
    r0 = _req("r0", [50, 51])
    _step(kv, r0, 2)
    kv.free(r1)
    kv.free(r0)
    r2 = _req("r2", list(range(1, 9)) + [77])
    hits, tokens = kv.get_computed_blocks(r2)
    assert tokens == 8 and len(hits) == 4 and len(set(hits)) == 4
    assert kv.allocate_slots(r2, 1, hits)
    for g, m in enumerate(kv.groups):
        table = m.block_table("r2")
        assert table[:2] == hits[2 * g:2 * g + 2]
        assert all(kv.pool.block_hash(b) is not None for b in table[:2])   # still cached
    _check_refs(kv, ["r2"])


def test_a_hit_out_of_the_window_may_be_evicted_by_another_groups_allocation() -> None:
    """r2 hits r1's 5 blocks in both groups; the windowed group holds only its last 2 (the
    first 3 are out of the window), which r1 released first: they head the free queue, so
    the full group's fresh block evicts one. The windowed group's table never needed it."""
    kv = KVCacheGroups(10, 4, (0, 8))
    prompt = list(range(1, 21))
    r1 = _req("r1", prompt)
    for _ in range(5):
        _step(kv, r1, 4)
    kv.free(r1)
    r2 = _req("r2", prompt + [99])
    hits, tokens = kv.get_computed_blocks(r2)
    assert tokens == 20
    assert kv.allocate_slots(r2, 1, hits)
    windowed = kv.groups[1].block_table("r2")
    assert windowed[:3] == [NULL] * 3 and windowed[3:5] == hits[8:10]
    assert kv.pool.block_hash(hits[5]) is None   # evicted: the full group's fresh block
    _check_refs(kv, ["r2"])


def test_a_hit_is_the_longest_run_cached_in_every_group() -> None:
    """A long request's early blocks leave the windowed group first (released out of the
    window, so first in the LRU): once another request evicts them, the full group's cached
    prefix alone is no hit."""
    kv = KVCacheGroups(12, 4, (0, 8))
    prompt = list(range(1, 21))
    r1 = _req("r1", prompt)
    for _ in range(5):
        _step(kv, r1, 4)
    r2 = _req("r2", prompt + [99])
    hits, tokens = kv.get_computed_blocks(r2)
    assert tokens == 20 and len(hits) == 10         # all of it: both groups cached it
    kv.free(r1)
    filler = _req("f", [500, 501, 502, 503, 504])
    _step(kv, filler, 5)   # 4 blocks from the queue's head: 2 never used, then the first 2
    full_hits, _ = kv.groups[0].get_computed_blocks(r2)   # the windowed group released
    assert len(full_hits) == 5                       # the full group still has it all
    assert kv.get_computed_blocks(r2) == ([], 0)     # the windowed group lost its first


def test_fork_trim_free_and_swap_cover_every_group() -> None:
    kv = KVCacheGroups(32, 4, (0, 8))
    parent = _req("p", range(1, 15))
    _step(kv, parent, 14)
    child = _req("c", range(1, 15))
    kv.fork(parent, child)
    child.num_computed_tokens = parent.num_computed_tokens
    for m in kv.groups:
        assert m.block_table("c") == m.block_table("p")
    _check_refs(kv, ["p", "c"])
    for i in range(4):   # drafts: the child's tables grow by 2 blocks, then are trimmed back
        child.append_output(100 + i)
    assert kv.allocate_slots(child, 4)
    assert kv.take_block_copies()                    # its shared last block, in every group
    kv.trim(child, 15)
    assert [len(m.block_table("c")) for m in kv.groups] == [4, 4]
    _check_refs(kv, ["p", "c"])
    kv.free(child)
    swap = SwapSpace(kv, 16)
    assert swap.swap_out(parent)       # 14 tokens: 4 blocks, the first out of the window
    out, _ = swap.end_step()
    assert len(out) == 4 + 3 and kv.held_blocks("p") == []
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.allocate_slots(parent, 1)
    swap.swap_in(parent)
    _, back = swap.end_step()
    assert [h for h, _ in back] == [h for _, h in out]
    assert [d for _, d in back] == kv.groups[0].block_table("p")[:4] \
        + kv.groups[1].block_table("p")[1:4]
    kv.free(parent)
    assert kv.num_free_blocks == kv.num_blocks


def test_a_pool_too_small_for_one_window_is_refused() -> None:
    # a sequence 4 tokens past a window of 8: 3 full blocks + 3 windowed ones
    check_pool_holds_a_window(KVCacheGroups(6, 4, (0, 8)), 512)
    with pytest.raises(ConfigError, match="5 blocks.*sliding window of 8 tokens needs 6"):
        check_pool_holds_a_window(KVCacheGroups(5, 4, (0, 8)), 512)
    check_pool_holds_a_window(KVCacheGroups(4, 4, (0, 8)), 8)   # the context is the window
    check_pool_holds_a_window(KVCacheManager(1, 4), 512)        # no window: per request

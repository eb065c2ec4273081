"""KVCacheManager: block tables grow by exactly what is needed, all-or-nothing, freed in reverse;
prefix-cache hits are shared, never zeroed, never cover the last token, and are salted."""
from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

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


# ---- prefix caching -------------------------------------------------------------------------

def compute(kv: KVCacheManager, r: Request, n: int) -> None:
    """What a step does to a request granted n tokens: they become computed, then cached."""
    r.num_computed_tokens += n
    kv.cache_full_blocks(r)


def prompt_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), arrival_time=0.0,
                   cache_salt=salt)


def test_a_finished_prompt_is_a_hit_for_the_next_one() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = prompt_request("a", list(range(10)))
    assert kv.get_computed_blocks(a) == ([], 0)
    assert kv.allocate_slots(a, 10) and kv.block_table("a") == [1, 2, 3]
    compute(kv, a, 10)
    assert kv.pool.num_cached_blocks == 2                 # the partial third block is not
    kv.take_fresh_blocks()
    kv.free(a)
    b = prompt_request("b", list(range(9)) + [99, 98])
    hits, n = kv.get_computed_blocks(b)
    assert (hits, n) == ([1, 2], 8)
    assert kv.allocate_slots(b, 3, hits)
    b.num_computed_tokens = n
    assert kv.block_table("b")[:2] == [1, 2] and len(kv.block_table("b")) == 3
    fresh = kv.take_fresh_blocks()
    assert fresh == kv.block_table("b")[2:] and not set(fresh) & {1, 2}   # hits never zeroed
    assert [kv.pool.ref_count(x) for x in (1, 2)] == [1, 1]
    kv.free(b)
    assert kv.num_free_blocks == kv.num_blocks


def test_a_hit_never_covers_the_last_token() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = prompt_request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    compute(kv, a, 8)
    assert kv.pool.num_cached_blocks == 2
    same = prompt_request("same", list(range(8)))
    hits, n = kv.get_computed_blocks(same)
    assert n == 4 and hits == kv.block_table("a")[:1]     # 8 tokens: the last block recomputes
    longer = prompt_request("longer", list(range(9)))
    assert kv.get_computed_blocks(longer) == (kv.block_table("a"), 8)
    with pytest.raises(KVCacheError, match="last"):
        kv.allocate_slots(same, 0, kv.block_table("a"))
    kv.free(a)
    kv.free(same)
    kv.free(longer)


def test_shared_blocks_are_counted_once_per_table() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a = prompt_request("a", [5, 6, 7, 8, 9])
    kv.allocate_slots(a, 5)
    compute(kv, a, 5)                                     # blocks 1, 2 cached; 3 partial
    b = prompt_request("b", [5, 6, 7, 8, 1, 2])
    hits, n = kv.get_computed_blocks(b)
    assert hits == [1, 2] and kv.allocate_slots(b, 2, hits)
    b.num_computed_tokens = n
    assert [kv.pool.ref_count(x) for x in (1, 2, 3, 4)] == [2, 2, 1, 1]
    assert kv.num_free_blocks == 6 - 4                     # four distinct blocks held
    kv.free(a)
    assert [kv.pool.ref_count(x) for x in (1, 2, 3)] == [1, 1, 0]
    kv.free(b)
    assert kv.num_free_blocks == 6 and kv.pool.num_cached_blocks == 2


def test_salt_separates_caches() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = prompt_request("a", [1, 2, 3, 4, 5], salt="alice")
    kv.allocate_slots(a, 5)
    compute(kv, a, 5)
    kv.free(a)
    for salt, expected in ((None, 0), ("bob", 0), ("", 0), ("alice", 4)):
        r = prompt_request(f"r-{salt}", [1, 2, 3, 4, 5], salt=salt)
        assert kv.get_computed_blocks(r)[1] == expected
        kv.free(r)


def test_free_hits_count_against_the_free_queue_and_failure_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = prompt_request("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(a, 5)
    compute(kv, a, 5)
    kv.free(a)                                            # 4 free, 2 of them cached
    hog = prompt_request("hog", [9])
    kv.allocate_slots(hog, 2)                             # takes the one uncached block left
    b = prompt_request("b", [1, 2, 3, 4, 7, 7, 7])
    hits, n = kv.get_computed_blocks(b)
    assert n == 4 and kv.num_free_blocks == 3
    assert not kv.allocate_slots(b, 3, hits)              # 2 revived + 2 new > 3 free
    assert kv.block_table("b") == [] and kv.num_free_blocks == 3
    assert all(kv.pool.ref_count(x) == 0 for x in hits)
    assert kv.allocate_slots(b, 2, hits)                  # 2 revived + 1 new
    kv.free(b)
    kv.free(hog)
    assert kv.num_free_blocks == 4


def test_an_evicted_block_is_fresh_and_breaks_the_chain() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = prompt_request("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(a, 5)
    compute(kv, a, 5)
    kv.take_fresh_blocks()
    kv.free(a)                                            # queue: 3 (partial), 2, 1
    assert kv.pool.free_block_ids() == [3, 2, 1]
    x = prompt_request("x", [8, 8, 8])
    kv.allocate_slots(x, 3)                               # evicts block 2 (the 2nd cached)
    assert kv.take_fresh_blocks() == [3, 2] and kv.pool.num_evictions == 1
    b = prompt_request("b", [1, 2, 3, 4, 5])
    assert kv.get_computed_blocks(b) == ([1], 2)
    kv.free(x)
    c = prompt_request("c", [1, 2, 3, 4, 5])
    kv.free(b)
    assert kv.get_computed_blocks(c) == ([1], 2)          # block 2 lost its hash for good
    kv.free(c)


def test_misuse_of_hits() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a = prompt_request("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(a, 5)
    compute(kv, a, 5)
    with pytest.raises(KVCacheError):
        kv.get_computed_blocks(a)                         # holds blocks already
    with pytest.raises(KVCacheError):
        kv.allocate_slots(a, 1, [1])
    b = prompt_request("b", [1, 2, 3, 4, 5])
    with pytest.raises(KVCacheError):
        kv.allocate_slots(b, 1, [3])                      # block 3 is not cached
    with pytest.raises(KVCacheError):
        kv.allocate_slots(b, 1, [1, 1])
    assert kv.block_table("b") == []
    kv.free(a)


def test_disabled_prefix_caching_is_the_plain_manager() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=2, enable_prefix_caching=False)
    assert not kv.enable_prefix_caching
    a = prompt_request("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(a, 5)
    compute(kv, a, 5)
    assert kv.pool.num_cached_blocks == 0
    kv.free(a)
    assert kv.get_computed_blocks(prompt_request("b", [1, 2, 3, 4, 5])) == ([], 0)
    assert kv.pool.free_block_ids() == [4, 5, 6, 3, 2, 1]


def test_generated_tokens_are_cached_too() -> None:
    """A preempted request resumes from its own blocks, prompt and output alike."""
    kv = KVCacheManager(num_blocks=8, block_size=2)
    r = prompt_request("r", [1, 2, 3])
    kv.allocate_slots(r, 3)
    compute(kv, r, 3)
    for token in (4, 5, 6):
        r.output_token_ids.append(token)
        kv.allocate_slots(r, 1)
        compute(kv, r, 1)
    r.output_token_ids.append(7)                          # sampled, not computed: 7 tokens
    table = kv.block_table("r")
    kv.free(r)                                            # preempted
    r.num_computed_tokens = 0
    assert kv.get_computed_blocks(r) == (table[:3], 6)
    kv.free(r)


# ---- random operations against a model of what every KV slot holds -------------------------

class KVMachine(RuleBasedStateMachine):
    """Requests over a 2-token alphabet are admitted with their hits,
    grown, computed, preempted and finished at random. The model tracks what each physical
    slot holds: the KV of position p of a sequence is named by its tokens 0..p; a block handed
    out fresh is zeroed (None). Every computed position a table reaches must hold its own KV,
    which catches a wrong hit, a hit zeroed as fresh, and a shared block written twice."""

    NUM_BLOCKS, BLOCK_SIZE, CACHING = 10, 2, True

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(self.NUM_BLOCKS, self.BLOCK_SIZE, self.CACHING)
        self.slots: dict[int, tuple[int, ...] | None] = {}
        self.waiting: list[Request] = []
        self.running: dict[str, Request] = {}
        self.pending: dict[str, int] = {}     # granted this "step", not computed yet
        self.ids = 0

    @rule(base=st.sampled_from([[0, 1, 1, 0, 1, 0, 0, 1], [1, 1, 1, 1, 0, 0]]),
          cut=st.integers(0, 8), tail=st.lists(st.integers(0, 1), max_size=3),
          salt=st.sampled_from([None, None, "s"]))
    def arrive(self, base: list[int], cut: int, tail: list[int], salt: str | None) -> None:
        """Prompts are mostly a cut of one of two base sequences, so prefixes repeat."""
        self.ids += 1
        self.waiting.append(prompt_request(str(self.ids), (base[:cut] + tail) or [0], salt))

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data(), tail=st.lists(st.integers(0, 1), max_size=3))
    def follow(self, data: st.DataObject, tail: list[int]) -> None:
        """A new request that repeats (part of) a running one's sequence, same salt."""
        r = data.draw(st.sampled_from(list(self.running.values())))
        cut = data.draw(st.integers(0, r.num_tokens))
        self.ids += 1
        self.waiting.append(prompt_request(
            str(self.ids), (r.all_token_ids[:cut] + tail) or [1], r.cache_salt))

    @precondition(lambda self: bool(self.waiting))
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        r = data.draw(st.sampled_from(self.waiting))
        hits, k = self.kv.get_computed_blocks(r)
        assert k == len(hits) * self.BLOCK_SIZE < r.num_tokens
        for p in range(k):                    # a hit holds exactly this sequence's KV
            assert self.slots.get(self.slot(hits, p)) == tuple(r.all_token_ids[:p + 1])
        n = data.draw(st.integers(1, r.num_tokens - k))
        free_before = self.kv.num_free_blocks
        if not self.kv.allocate_slots(r, n, hits):
            assert self.kv.block_table(r.request_id) == []
            assert self.kv.num_free_blocks == free_before
            return
        r.num_computed_tokens = k
        self.waiting.remove(r)
        self.running[r.request_id] = r
        self.pending[r.request_id] = n

    @precondition(lambda self: any(rid not in self.pending for rid in self.running))
    @rule(data=st.data(), token=st.integers(0, 1))
    def grow(self, data: st.DataObject, token: int) -> None:
        r = data.draw(st.sampled_from([r for rid, r in self.running.items()
                                       if rid not in self.pending]))
        if r.num_computed_tokens == r.num_tokens:
            r.output_token_ids.append(token)  # the last step sampled it
        n = data.draw(st.integers(1, r.num_tokens - r.num_computed_tokens))
        if self.kv.allocate_slots(r, n):
            self.pending[r.request_id] = n

    @rule()
    def step(self) -> None:
        """The model runner zeroes fresh blocks, then writes the granted positions."""
        for block in self.kv.take_fresh_blocks():
            for row in range(self.BLOCK_SIZE):
                self.slots[block * self.BLOCK_SIZE + row] = None
        for rid, n in self.pending.items():
            r = self.running[rid]
            table = self.kv.block_table(rid)
            for p in range(r.num_computed_tokens, r.num_computed_tokens + n):
                self.slots[self.slot(table, p)] = tuple(r.all_token_ids[:p + 1])
            r.num_computed_tokens += n
            self.kv.cache_full_blocks(r)
        self.pending.clear()

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data(), preempt=st.booleans())
    def release(self, data: st.DataObject, preempt: bool) -> None:
        r = data.draw(st.sampled_from(list(self.running.values())))
        self.kv.free(r)
        del self.running[r.request_id]
        self.pending.pop(r.request_id, None)
        if preempt:
            r.num_computed_tokens = 0
            self.waiting.append(r)

    def slot(self, table: list[int], p: int) -> int:
        return table[p // self.BLOCK_SIZE] * self.BLOCK_SIZE + p % self.BLOCK_SIZE

    @invariant()
    def invariants_hold(self) -> None:
        kv, pool = self.kv, self.kv.pool
        tables = {rid: kv.block_table(rid) for rid in self.running}
        flat = [b for t in tables.values() for b in t]
        assert KVCacheManager.NULL_BLOCK not in flat
        for b in range(1, kv.num_physical_blocks):
            assert pool.ref_count(b) == flat.count(b)
            assert flat.count(b) <= 1 or pool.block_hash(b) is not None
        assert len(set(flat)) + kv.num_free_blocks == kv.num_blocks
        if not self.CACHING:
            assert len(flat) == len(set(flat)) and pool.num_cached_blocks == 0
        for r in self.waiting:
            assert kv.block_table(r.request_id) == []
        for rid, r in self.running.items():
            assert len(tables[rid]) == kv.num_blocks_needed(
                r.num_computed_tokens + self.pending.get(rid, 0))
            for p in range(r.num_computed_tokens):
                assert self.slots.get(self.slot(tables[rid], p)) == tuple(r.all_token_ids[:p + 1])


class PlainKVMachine(KVMachine):
    CACHING = False


TestKVMachine = KVMachine.TestCase
TestKVMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestPlainKVMachine = PlainKVMachine.TestCase
TestPlainKVMachine.settings = settings(max_examples=30, stateful_step_count=40, deadline=None)

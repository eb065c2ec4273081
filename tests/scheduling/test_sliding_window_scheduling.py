"""The scheduler over a KV manager that releases the blocks out of a sliding window, against a
fake model over a fake paged KV cache that attends only to the window: random workloads with
shared prefixes (prefix-cache hits), request groups (n > 1, copy-on-write forks), drafts
(speculation and its rollback), chunked prefill and preemption by recompute or swap in a
small pool. Every step, each query reads the KV of exactly its window's positions through the
block table (a released block that is still needed, or a reused one, fails the read); a
windowed sequence holds at most window_block_bound blocks; and every request's tokens equal
those of the same workload with nothing released (window 0 in the manager). At the end every
device and host block is free."""
from __future__ import annotations

import random

import pytest
from hypothesis import event, given, settings, strategies as st

from scheduling_fixtures import check_window_table, make_scheduler, window_block_bound
from tessellm.cache.kv_manager import KVCacheManager
from tessellm.request import Request
from tessellm.sampling_params import SamplingParams
from tessellm.scheduler import Scheduler, SchedulerOutput

NULL = KVCacheManager.NULL_BLOCK


def next_token(seq: list[int], window: int, salt: int) -> int:
    """What the windowed fake model samples after `seq`: a function of the window's tokens,
    the position and the sample's salt (its index in its group), never EOS."""
    return 1 + (sum(seq[-window:]) * 31 + len(seq) + 7 * salt) % 97


def salt(r: Request) -> int:
    return int(r.request_id.rsplit("-", 1)[1])


class WindowModel:
    """Runs a step over a fake paged cache: slot -> the token prefix whose KV it holds. Block
    work in the runner's order (swap-outs, zeroing of fresh blocks, copy-on-write, swap-ins);
    then per entry every row's KV written, then each row reads the slots of the positions its
    window covers and must find exactly their prefixes."""

    def __init__(self, sched: Scheduler, window: int) -> None:
        self.sched, self.kv, self.window = sched, sched.kv, window
        self.slots: dict[int, tuple[int, ...] | None] = {}
        self.host: dict[int, list] = {}
        self.num_reads = 0

    def _block(self, block: int) -> list:
        bs = self.kv.block_size
        return [self.slots.get(block * bs + r) for r in range(bs)]

    def _set_block(self, block: int, rows: list) -> None:
        bs = self.kv.block_size
        for r, x in enumerate(rows):
            self.slots[block * bs + r] = x

    def run(self, out: SchedulerOutput) -> tuple[dict[str, int], dict[str, list[int]]]:
        kv, bs, w = self.kv, self.kv.block_size, self.window
        for dev, host in out.swap_out:
            self.host[host] = self._block(dev)
        for block in kv.take_fresh_blocks():
            assert block != NULL
            self._set_block(block, [None] * bs)
        for src, dst in out.block_copies:
            self._set_block(dst, self._block(src))
        for host, dev in out.swap_in:
            self._set_block(dev, self.host[host])
        sampled: dict[str, int] = {}
        accepted: dict[str, list[int]] = {}
        for s in out.scheduled:
            r, table = s.request, kv.block_table(s.request.request_id)
            start = r.num_computed_tokens
            seq = list(r.all_token_ids) + list(s.draft_token_ids)
            stop = start + s.num_tokens
            for p in range(start, stop):
                assert table[p // bs] != NULL
                self.slots[table[p // bs] * bs + p % bs] = tuple(seq[:p + 1])
            for p in range(start, stop):   # row p attends to keys max(0, p - w + 1) .. p
                for k in range(max(0, p - w + 1), p + 1):
                    block = table[k // bs]
                    assert block != NULL, (r.request_id, p, k, table)
                    assert self.slots.get(block * bs + k % bs) == tuple(seq[:k + 1])
                    self.num_reads += 1
            if r.num_computed_tokens + s.num_real_tokens != r.num_tokens:
                continue
            # verify rows: the draft at row j is accepted when the model's draw there agrees
            real, a = list(r.all_token_ids), 0
            for d in s.draft_token_ids:
                if next_token(real, w, salt(r)) != d:
                    break
                real.append(d)
                a += 1
            if s.draft_token_ids:
                accepted[r.request_id] = list(s.draft_token_ids[:a])
            sampled[r.request_id] = next_token(real, w, salt(r))
            for child in out.forks.get(r.request_id, ()):   # the parent's row, own salt
                sampled[child.request_id] = next_token(real, w, salt(child))
        return sampled, accepted


def run(groups: list[tuple[list[int], int, int]], window: int, release: bool, block_size: int,
        num_blocks: int, max_num_seqs: int, budget: int, caching: bool,
        swap_blocks: int | None, draft_seed: int | None
        ) -> tuple[dict[str, list[int]], int, int]:
    """Outputs per request id, the preemptions and the swap-outs. `release`: the manager
    releases the blocks out of the window (else it holds every block; the model still
    attends to the window alone)."""
    sched = make_scheduler(num_blocks, block_size, max_num_seqs, budget, max_model_len=512,
                           caching=caching, swap_blocks=swap_blocks,
                           window=window if release else 0)
    kv, model = sched.kv, WindowModel(sched, window)
    rng = random.Random(draft_seed)
    requests: list[Request] = []
    for g, (prompt, max_tokens, n) in enumerate(groups):
        reqs = [Request(f"g{g}-{i}", list(prompt), SamplingParams(max_tokens=max_tokens),
                        arrival_time=0.0) for i in range(n)]
        sched.add_request_group(reqs[0], reqs[1:]) if n > 1 else sched.add_request(reqs[0])
        requests += reqs
    steps = 0
    while sched.has_unfinished:
        if draft_seed is not None:   # the true continuation with random mistakes
            for r in sched.running:
                r.draft_token_ids = []
                if r.output_token_ids and r.num_computed_tokens == r.num_tokens - 1:
                    seq, drafts = list(r.all_token_ids), []
                    for _ in range(rng.randint(0, 4)):
                        t = next_token(seq, window, salt(r)) if rng.random() < 0.7 else 99
                        drafts.append(t)
                        seq.append(t)
                    r.draft_token_ids = drafts
        out = sched.schedule()
        for s in out.scheduled:
            check_window_table(kv, s.request, s.num_tokens)
            if release:
                assert kv.num_held_blocks(s.request.request_id) <= \
                    window_block_bound(kv, s.num_tokens)
        held: dict[int, int] = {}
        for r in sched.running:
            for b in kv.block_table(r.request_id):
                if b != NULL:
                    held[b] = held.get(b, 0) + 1
        assert all(kv.pool.ref_count(b) == c for b, c in held.items())
        assert len(held) + kv.num_free_blocks == kv.num_blocks   # no leak, null never held
        sampled, accepted = model.run(out)
        sched.update_from_output(out, sampled, accepted)
        for r in sched.running:   # rejected drafts' slots are gone after every step
            assert len(kv.block_table(r.request_id)) <= kv.num_blocks_needed(r.num_tokens)
        steps += 1
        assert steps < 5000
    assert kv.num_free_blocks == kv.num_blocks
    if sched.swap_space is not None:
        assert sched.swap_space.pool.num_free_blocks == swap_blocks
    assert model.num_reads > 0
    return ({r.request_id: r.output_token_ids for r in requests}, sched.num_preemptions,
            sched.swap_stats.swap_outs)


BASE = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3]


@settings(max_examples=120, deadline=None)
@given(groups=st.lists(st.tuples(st.integers(0, len(BASE)), st.lists(st.integers(1, 9),
                                                                     max_size=12),
                                 st.integers(1, 40), st.integers(1, 3)),
                       min_size=1, max_size=6),
       window=st.sampled_from([2, 3, 5, 8, 13, 24]), block_size=st.sampled_from([1, 2, 4]),
       extra_blocks=st.integers(0, 4), max_num_seqs=st.integers(1, 6),
       budget=st.integers(2, 24), caching=st.booleans(),
       swap_blocks=st.sampled_from([None, None, 0, 6, 40]),
       drafts=st.one_of(st.none(), st.integers(0, 10**6)))
def test_released_window_blocks_change_no_output(groups, window, block_size, extra_blocks,
                                                 max_num_seqs, budget, caching, swap_blocks,
                                                 drafts) -> None:
    workload = [((BASE[:cut] + tail) or [1], m, n) for cut, tail, m, n in groups]
    # validation's rule (the whole context fits the pool alone), so both runs can take it
    needed = max(-(-(len(p) + m) // block_size) for p, m, _ in workload)
    args = (block_size, needed + extra_blocks, max_num_seqs, budget, caching, swap_blocks,
            drafts)
    held_all, preemptions_held, _ = run(workload, window, False, *args)
    released, preemptions, _ = run(workload, window, True, *args)
    assert released == held_all
    event(f"preempted: {min(preemptions, 2)} (holding all: {min(preemptions_held, 2)})")
    event(f"groups: {max(n for *_, n in workload) > 1}")


@pytest.mark.parametrize("swap_blocks", [None, 0, 200])
@pytest.mark.parametrize("caching", [False, True])
def test_preempted_windowed_requests_resume_with_their_window(swap_blocks, caching) -> None:
    """Seven requests (two groups of two among them) with 30..42-token prompts sharing a
    prefix, a window of 24 in blocks of 2, six at a time in a pool of what one whole context
    needs: they preempt each other (by recompute, by swap, or recompute after a host pool of
    0), resume with only the blocks inside their window, and give the tokens of the run that
    holds every block."""
    rng = random.Random(7)
    workload = [(BASE + [rng.randint(1, 9) for _ in range(2 + 3 * g)], 40 - 3 * g,
                 2 if g in (1, 4) else 1) for g in range(5)]
    needed = max(-(-(len(p) + m) // 2) for p, m, _ in workload)
    args = (2, needed, 6, 24, caching, swap_blocks, None)
    held_all, _, _ = run(workload, 24, False, *args)
    released, preemptions, swap_outs = run(workload, 24, True, *args)
    assert released == held_all
    assert preemptions > 0
    assert (swap_outs > 0) is (swap_blocks == 200)


@pytest.mark.parametrize("release", [True, False])
def test_a_long_generation_holds_the_window_and_is_never_preempted(release: bool) -> None:
    """Four requests generate 400 tokens each with a window of 8 in blocks of 4, in a pool of
    101 blocks (what one whole context needs: validation's rule). Released, each holds at
    most 3 blocks at every step (ceil((8 - 1) / 4) + 1) and nobody is preempted; holding
    every block they preempt each other."""
    window, bs = 8, 4
    sched = make_scheduler(num_blocks=101, block_size=bs, max_num_seqs=4, budget=16,
                           max_model_len=512, caching=True, window=window if release else 0)
    model = WindowModel(sched, window)
    requests = [Request(f"r-{i}", [1 + i, 2, 3], SamplingParams(max_tokens=400),
                        arrival_time=0.0) for i in range(4)]
    for r in requests:
        sched.add_request(r)
    most = most_in_use = 0
    while sched.has_unfinished:
        out = sched.schedule()
        for r in sched.running:
            most = max(most, sched.kv.num_held_blocks(r.request_id))
            check_window_table(sched.kv, r, None)
        most_in_use = max(most_in_use, sched.kv.num_blocks - sched.kv.num_free_blocks)
        sched.update_from_output(out, *model.run(out))
    if release:
        assert most == 3 and most_in_use <= 12
        assert sched.num_preemptions == 0
    else:
        assert most > 50 and sched.num_preemptions > 0
    assert all(len(r.output_token_ids) == 400 for r in requests)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks

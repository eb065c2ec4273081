"""The scheduler with speculation, against a fake model whose next token is a function of the
sequence so far: whatever drafts the requests get (right, wrong, too many for the budget or
the pool), every request's output equals a run without drafts, no request holds blocks past
its tokens after a step, every block returns, and a malformed outcome is refused."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduling_fixtures import make_request, make_scheduler
from tessellm.scheduler import SchedulerError


def next_token(seq: list[int]) -> int:
    return 1 + (sum(seq) * 31 + len(seq)) % 97


def run(sched, requests, draft_rng: random.Random | None
        ) -> tuple[dict[str, list[int]], int]:
    """Outputs per request, and how many drafts were accepted."""
    for r in requests:
        sched.add_request(r)
    kv = sched.kv
    num_accepted = 0
    for _ in range(2000):
        if not sched.has_unfinished:
            break
        if draft_rng is not None:   # drafts: the true continuation with random mistakes
            for r in sched.running:
                r.draft_token_ids = []
                if r.output_token_ids and r.num_computed_tokens == r.num_tokens - 1:
                    seq, drafts = list(r.all_token_ids), []
                    for _ in range(draft_rng.randint(0, 5)):
                        t = next_token(seq) if draft_rng.random() < 0.7 else 99
                        drafts.append(t)
                        seq.append(t)
                    r.draft_token_ids = drafts
        out = sched.schedule()
        sampled, accepted = {}, {}
        for s in out.scheduled:
            r = s.request
            if r.num_computed_tokens + s.num_real_tokens != r.num_tokens:
                continue
            seq, a = list(r.all_token_ids), 0
            for d in s.draft_token_ids:   # the model's draws at each verify row
                if next_token(seq) != d:
                    break
                seq.append(d)
                a += 1
            if s.draft_token_ids:
                accepted[r.request_id] = s.draft_token_ids[:a]
                num_accepted += a
            sampled[r.request_id] = next_token(seq)
        sched.update_from_output(out, sampled, accepted)
        for r in sched.running:   # rejected drafts' slots are gone after every step
            assert len(kv.block_table(r.request_id)) <= kv.num_blocks_needed(r.num_tokens)
    assert not sched.has_unfinished
    assert kv.num_free_blocks == kv.num_blocks
    return {r.request_id: r.output_token_ids for r in requests}, num_accepted


def requests_of(seed: int) -> list:
    rng = random.Random(seed)
    return [make_request(f"r{i}", 0, rng.randint(1, 30),
                         tokens=[rng.randint(1, 90) for _ in range(rng.randint(1, 20))])
            for i in range(rng.randint(1, 6))]


@given(seed=st.integers(0, 10**6), blocks=st.sampled_from([24, 40, 64]),
       budget=st.sampled_from([8, 16, 64]), caching=st.booleans())
@settings(max_examples=60, deadline=None)
def test_drafts_never_change_outputs_or_leak_blocks(seed, blocks, budget, caching):
    plain, _ = run(make_scheduler(num_blocks=blocks, budget=budget, caching=caching),
                   requests_of(seed), None)
    drafted, accepted = run(make_scheduler(num_blocks=blocks, budget=budget, caching=caching),
                            requests_of(seed), random.Random(seed))
    assert drafted == plain
    if sum(len(o) for o in plain.values()) > 40:   # long enough that drafts were taken
        assert accepted > 0


def test_accepted_drafts_must_be_a_prefix_of_the_scheduled_ones():
    sched = make_scheduler()
    r = make_request("a", 0, 10, tokens=[5, 6, 7])
    sched.add_request(r)
    out = sched.schedule()
    sched.update_from_output(out, {"a": next_token(r.all_token_ids)})
    r.draft_token_ids = [11, 12]
    out = sched.schedule()
    assert out.scheduled[0].draft_token_ids == (11, 12)
    with pytest.raises(SchedulerError, match="not a prefix"):
        sched.update_from_output(out, {"a": 3}, {"a": [12]})
    with pytest.raises(SchedulerError, match="not a prefix"):
        sched.update_from_output(out, {"a": 3}, {"b": []})
    sched.update_from_output(out, {"a": 3}, {"a": [11]})
    assert r.output_token_ids[-2:] == [11, 3] and r.num_computed_tokens == r.num_tokens - 1

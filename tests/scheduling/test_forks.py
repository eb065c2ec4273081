"""Request groups (n > 1) in the scheduler: siblings fork from the parent's computed prompt,
share its blocks (copied before a write), stay within the limits, and give the tokens of
requests run alone; the ones without a free sequence slot, or whose parent was aborted, run as
ordinary requests."""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings, strategies as st
from scheduling_fixtures import make_request, make_scheduler

from tessellm.errors import InvalidRequestError
from tessellm.request import Request, RequestStatus
from tessellm.scheduler import Scheduler, SchedulerOutput


def token(r: Request) -> int:
    """A fake model's sample: a function of the sequence and the sample's index in its group
    (its 'seed', the id's suffix), never EOS."""
    salt = int(r.request_id.rsplit("-", 1)[1])
    return 1 + (sum(r.all_token_ids) * 31 + r.num_tokens + 7 * salt) % 97


def run_step(sched: Scheduler) -> tuple[SchedulerOutput, list[Request]]:
    out = sched.schedule()
    cfg, kv = sched.config, sched.kv
    assert out.num_batched_tokens <= cfg.max_num_batched_tokens
    sampled = {}
    for s in out.scheduled:
        r = s.request
        if r.num_computed_tokens + s.num_tokens == r.num_tokens:
            sampled[r.request_id] = token(r)
            for child in out.forks.get(r.request_id, ()):   # the parent's row, own salt
                assert child.all_token_ids == r.all_token_ids
                sampled[child.request_id] = token(child)
        else:
            assert r.request_id not in out.forks
    done = sched.update_from_output(out, sampled)
    assert sched.num_running <= cfg.max_num_seqs
    held = Counter(b for r in sched.running for b in kv.block_table(r.request_id))
    assert all(kv.pool.ref_count(b) == c for b, c in held.items())
    assert len(held) + kv.num_free_blocks == kv.num_blocks         # no leak
    return out, done


def group(gid: str, n_prompt: int, max_tokens: int, n: int) -> list[Request]:
    return [make_request(f"{gid}-{i}", n_prompt, max_tokens,
                         tokens=[(3 + j * 5) % 50 for j in range(n_prompt)]) for i in range(n)]


def solo(n_prompt: int, max_tokens: int, i: int) -> list[int]:
    sched = make_scheduler()
    (r,) = group("solo", n_prompt, max_tokens, i + 1)[i:]
    sched.add_request(r)
    while sched.has_unfinished:
        run_step(sched)
    return r.output_token_ids


def test_siblings_fork_share_and_copy_the_partial_block() -> None:
    sched = make_scheduler(block_size=4)
    reqs = group("g", 6, 5, 3)
    sched.add_request_group(reqs[0], reqs[1:])
    assert sched.num_running == 0 and sched.get_request("g-2") is reqs[2]
    out, _ = run_step(sched)
    assert out.forks == {"g-0": reqs[1:]}
    tables = [sched.kv.block_table(r.request_id) for r in reqs]
    assert tables[0] == tables[1] == tables[2] and all(
        sched.kv.pool.ref_count(b) == 3 for b in tables[0])
    assert all(r.num_computed_tokens == 6 and r.status is RequestStatus.RUNNING for r in reqs)
    out, _ = run_step(sched)            # all three write position 6: two copies, one in place
    assert len(out.block_copies) == 2
    assert sched.kv.pool.ref_count(tables[0][0]) == 3          # the full block stays shared
    while sched.has_unfinished:
        run_step(sched)
    for i, r in enumerate(reqs):
        assert r.output_token_ids == solo(6, 5, i)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_siblings_beyond_the_cap_are_queued_and_an_aborted_parent_frees_its_group() -> None:
    sched = make_scheduler(max_num_seqs=2)
    reqs = group("g", 5, 3, 3)
    sched.add_request_group(reqs[0], reqs[1:])
    out, _ = run_step(sched)
    assert out.forks == {"g-0": [reqs[1]]} and sched.waiting == (reqs[2],)
    while sched.has_unfinished:
        run_step(sched)
    assert [r.output_token_ids for r in reqs] == [solo(5, 3, i) for i in range(3)]

    sched = make_scheduler()
    reqs = group("h", 5, 3, 2)
    sched.add_request_group(reqs[0], reqs[1:])
    assert sched.abort("h-0") is reqs[0]
    assert sched.waiting == (reqs[1],)
    while sched.has_unfinished:
        run_step(sched)
    assert reqs[1].output_token_ids == solo(5, 3, 1)
    # a pending sibling can be aborted on its own
    reqs = group("k", 5, 3, 2)
    sched.add_request_group(reqs[0], reqs[1:])
    assert sched.abort("k-1") is reqs[1] and reqs[1].is_finished
    while sched.has_unfinished:
        run_step(sched)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_group_validation_queues_nothing() -> None:
    sched = make_scheduler()
    a, b = group("g", 5, 3, 2)
    other = make_request("g-9", 4, 3)
    with pytest.raises(InvalidRequestError):
        sched.add_request_group(a, [b, other])           # another prompt
    with pytest.raises(InvalidRequestError):
        sched.add_request_group(a, [b, b])               # an id twice
    assert not sched.has_unfinished and sched.get_request("g-1") is None
    sched.add_request_group(a, [b])
    with pytest.raises(InvalidRequestError):
        sched.add_request(make_request("g-1", 3, 3))     # the id of a pending sibling


@settings(max_examples=40, deadline=None)
@given(groups=st.lists(st.tuples(st.integers(1, 13), st.integers(1, 6), st.integers(1, 4)),
                       min_size=1, max_size=5),
       block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(24, 64),
       max_num_seqs=st.integers(1, 6), budget=st.integers(4, 32),
       caching=st.booleans())
def test_random_groups_finish_within_limits_with_solo_tokens(
        groups, block_size, num_blocks, max_num_seqs, budget, caching) -> None:
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size,
                           max_num_seqs=max_num_seqs, budget=budget, caching=caching)
    added = []
    for g, (n_prompt, max_tokens, n) in enumerate(groups):
        reqs = group(f"g{g}", n_prompt, max_tokens, n)
        sched.add_request_group(reqs[0], reqs[1:])
        added.append((reqs, n_prompt, max_tokens))
    steps = 0
    while sched.has_unfinished:
        run_step(sched)
        steps += 1
        assert steps < 2000
    for reqs, n_prompt, max_tokens in added:
        for i, r in enumerate(reqs):
            assert r.output_token_ids == solo(n_prompt, max_tokens, i)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks

"""Helpers of the sliding-window engine tests (test_sliding_window_engine.py: every layer
windowed; test_hybrid_window_engine.py: Gemma's windowed and full layers): engines with the
same step limits, the window's block bound, a recorder of the blocks each request holds per
block-table group, a switch that makes engines hold every block, and the mixed workload both
files run under preemption."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tessellm import LLM, SamplingParams
from tessellm.cache.kv_groups import KVCacheLayout
from tessellm.models.spec import ModelSpec

WINDOW, BLOCK = 8, 4


def bound(n: int, lag: int = 0) -> int:
    """The most blocks a windowed group's table holds for a sequence computing n tokens:
    ceil((W + n - 2) / bs) + 1, or with async scheduling and a step of up to `lag` tokens in
    flight ceil((max(W - 1, lag) + n - 1) / bs) + 1 (tessellm.cache.sliding_window)."""
    return -(-(max(WINDOW - 1, lag) + n - 1) // BLOCK) + 1


def make(path: Path, cache_dir: Path, **options: Any) -> LLM:
    # the same step limits for every engine here: kernels are profiled once for them
    opts = dict(block_size=BLOCK, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=24,
                dtype="float32")
    opts.update(options)
    return LLM(model=str(path), device="cpu", load_progress=False, cache_dir=str(cache_dir),
               **opts)


class Recorder:
    """Wraps the engine's scheduler: after every schedule(), the blocks each scheduled
    request holds in each block-table group (a windowed group's checked against bound), and
    the pool's blocks in use. `held_per_step` / `group_held_per_step`: a lone scheduled
    request's blocks, all groups together / per group."""

    def __init__(self, llm: LLM, lag: int = 0) -> None:
        self.kv, sched = llm.engine.kv, llm.engine.scheduler
        self.most_held = 0
        self.most_in_use = 0
        self.held_per_step: list[int] = []
        self.group_held_per_step: list[tuple[int, ...]] = []
        schedule = sched.schedule

        def recording():
            out = schedule()
            for s in out.scheduled:
                held = self.held(s.request.request_id)
                self.most_held = max(self.most_held, sum(held))
                for m, h in zip(self.kv.groups, held):
                    if m.sliding_window:
                        assert h <= bound(s.num_tokens, lag), (s.request.request_id, held)
            if len(out.scheduled) == 1:
                held = self.held(out.scheduled[0].request.request_id)
                self.held_per_step.append(sum(held))
                self.group_held_per_step.append(held)
            self.most_in_use = max(self.most_in_use,
                                   self.kv.num_blocks - self.kv.num_free_blocks)
            return out
        sched.schedule = recording

    def held(self, request_id: str) -> tuple[int, ...]:
        return tuple(m.num_held_blocks(request_id) for m in self.kv.groups)


@pytest.fixture
def no_release(monkeypatch: pytest.MonkeyPatch):
    """Engines built inside hold every block: one block-table group without a window (the
    kernels keep their windows), as every model did before the groups."""
    def off() -> None:
        monkeypatch.setattr(ModelSpec, "kv_layout", property(
            lambda self: KVCacheLayout.of([0] * self.num_layers)))
    return off


def run_mixed(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], fork: int,
              swap: bool) -> tuple[list[list[int]], list[list[int]]]:
    """The first prompt alone (it fills the prefix cache), the rest at once, then prompt
    `fork` again with n = 2. Checks that prefix hits and preemptions (swaps when `swap`)
    happened and every block is free again; returns the tokens in prompt order and the
    fork's two samples."""
    first = llm.generate([prompts[0]], params[0])[0].token_ids
    outs = llm.generate(prompts[1:], params[1:], n=None)
    forked = llm.generate([prompts[fork]], params[fork], n=2)[0]
    eng = llm.engine
    assert eng.scheduler.prefix_cache_hits > 0
    assert eng.stats.num_preemptions > 0
    if swap:
        assert eng.stats.num_swapped_out_blocks > 0
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    return [first] + [o.token_ids for o in outs], [s.token_ids for s in forked.samples]


def tokens_alone(memo: list[list[int]], path: Path, cache_dir: Path,
                 prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """Each prompt's greedy tokens alone in a fresh engine, computed once into `memo` (a
    module's list: every parametrization of a test compares against the same run)."""
    if not memo:
        alone = make(path, cache_dir)
        memo.extend(alone.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params))
    return memo

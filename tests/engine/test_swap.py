"""Swap preemption end to end on `cpu` and on the asynchronous `sim` device: recompute and
swap give exactly the tokens of an unpreempted run, swap traffic is counted, a missing wait
on a swap event is caught by sim's poisoned destinations, and a short host pool falls back
to recompute."""
from __future__ import annotations

import pytest

from tessellm import LLM, SamplingParams
from tessellm.engine.kv_swap import KVSwapper, block_runs
from tessellm.engine.llm_engine import StepError

PROMPTS = ["Once upon a time", "The cat", "Lily and Ben went to the park. They",
           "One day, a little bird"]
PARAMS = SamplingParams(max_tokens=40, temperature=0.0)
SMALL = dict(dtype="float32", load_progress=False, block_size=4, num_kv_blocks=22,
             max_num_seqs=4)


@pytest.fixture(scope="module")
def unpreempted(stories_dir) -> list[list[int]]:
    llm = LLM(str(stories_dir), device="cpu", dtype="float32", load_progress=False,
              block_size=4)
    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("device", ["cpu", "sim"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_gives_the_tokens_of_an_unpreempted_run(stories_dir, unpreempted,
                                                           device, mode):
    llm = LLM(str(stories_dir), device=device, preemption_mode=mode, **SMALL)
    got = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert got == unpreempted
    stats, swap = llm.engine.stats, llm.engine.scheduler.swap_stats
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_swapped_out_blocks == swap.blocks_out > 0
        assert stats.num_swapped_in_blocks == swap.blocks_in == swap.blocks_out
        assert swap.fallbacks == 0
        # resumed without recompute: only the prompts were computed as prompt tokens
        assert stats.num_prompt_tokens == sum(len(llm.encode(p)) for p in PROMPTS)
        assert llm.engine.scheduler.swap_space.pool.num_free_blocks == \
            llm.engine.parts.num_host_kv_blocks
    else:
        assert stats.num_swapped_out_blocks == 0


def test_host_pool_lives_in_the_device_host_allocator(stories_dir):
    llm = LLM(str(stories_dir), device="sim", preemption_mode="swap", num_host_kv_blocks=7,
              **SMALL)
    parts = llm.engine.parts
    assert parts.num_host_kv_blocks == 7
    assert all(parts.device.host_buffers.contains(h) for h in parts.host_kv_caches)
    assert [tuple(h.shape) for h in parts.host_kv_caches] == \
        [(2, 7) + tuple(c.shape[2:]) for c in parts.kv_caches]


@pytest.mark.parametrize("hook", ["wait_for_compute", "wait"])
def test_missing_swap_wait_is_caught_on_sim(stories_dir, unpreempted, monkeypatch, hook,
                                            request):
    """Without the wait before compute (swap-in) or before reuse (swap-out), sim's poisoned
    destinations make the run fail or give other tokens."""
    llm = LLM(str(stories_dir), device="sim", preemption_mode="swap", **SMALL)
    monkeypatch.setattr(KVSwapper, hook, lambda self, event: None)
    try:
        got = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    except StepError:
        got = None
    finally:
        llm.engine.parts.device.synchronize()
    assert got != unpreempted
    monkeypatch.undo()
    # with the wait back, an engine gives the right tokens (a fresh one: the broken run's
    # poisoned KV may sit in this one's prefix cache, which rightly serves it again)
    fresh = LLM(str(stories_dir), device="sim", preemption_mode="swap", **SMALL)
    assert [o.token_ids for o in fresh.generate(PROMPTS, PARAMS)] == unpreempted


def test_short_host_pool_falls_back_to_recompute(stories_dir, unpreempted):
    llm = LLM(str(stories_dir), device="cpu", preemption_mode="swap", num_host_kv_blocks=1,
              **SMALL)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == unpreempted
    swap = llm.engine.scheduler.swap_stats
    assert swap.fallbacks > 0 and swap.blocks_out == 0


def test_block_runs_merge_consecutive_pairs():
    assert block_runs([(3, 0), (4, 1), (5, 2), (9, 3), (2, 4)]) == \
        [(3, 0, 3), (9, 3, 1), (2, 4, 1)]
    assert block_runs([]) == []


def test_default_host_pool_is_capped_by_the_hosts_available_memory(monkeypatch):
    """Sized like the device pool by default, but never past HOST_POOL_SHARE of the host's
    available memory (split among tensor-parallel ranks): pinned memory cannot be paged out.
    An explicit size is taken as given."""
    import torch

    from tessellm.config import EngineConfig
    from tessellm.device import MemoryInfo
    from tessellm.engine import builder
    from tessellm.models.spec import ModelSpec

    spec = ModelSpec("llama", 100, 64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     intermediate_size=128, norm_eps=1e-5, max_position_embeddings=64,
                     tie_word_embeddings=True)
    per_block = 2 * 4 * 2 * 16 * 4 * 2    # K and V, block_size 4, fp32, 2 layers
    monkeypatch.setattr(builder, "host_memory_info",
                        lambda: MemoryInfo(total_bytes=10**9, free_bytes=100 * per_block))

    def count(**kw) -> int:
        config = EngineConfig(model="m", preemption_mode="swap", block_size=4, **kw)
        return builder.host_kv_block_count(config, spec, torch.float32, 1000)

    assert count() == 50                                    # half of 100 blocks' worth
    assert count(tensor_parallel_size=2) == 25
    assert count(num_host_kv_blocks=300) == 300
    assert count(swap_space_bytes=200 * per_block) == 200
    config = EngineConfig(model="m", preemption_mode="swap", block_size=4)
    assert builder.host_kv_block_count(config, spec, torch.float32, 10) == 10   # device-sized

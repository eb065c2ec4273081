"""The engine's decode-graph path (padding to a captured size, persistent inputs, slot -1),
driven through a CPU device whose stand-in graphs check what a CUDA graph relies on."""
from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

import pytest

from tessellm import LLM, SamplingParams
from tessellm.plugin_spec import ENTRY_POINT_GROUP
from tessellm.plugins import PluginManager

PROMPTS = ["Once upon a time", "The cat", "Lily and Ben went to the park. They"]


def _manager() -> PluginManager:
    eps = [e for e in entry_points(group=ENTRY_POINT_GROUP) if e.name == "cpu"]
    return PluginManager(eps + [EntryPoint("cpu-graphs", "graph_device:plugin",
                                           ENTRY_POINT_GROUP)]).load()


def _run(device: str, **options) -> tuple[LLM, list[list[int]]]:
    llm = LLM(options.pop("model"), plugins=_manager(), device=device,
              dtype="float32", load_progress=False, **options)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0.0))
    return llm, [o.token_ids for o in outs]


@pytest.mark.parametrize("max_num_seqs", [5, 8])
def test_padded_graph_steps_give_the_eager_tokens(stories_dir, max_num_seqs):
    _, eager = _run("cpu", model=str(stories_dir), max_num_seqs=max_num_seqs)
    llm, graphed = _run("cpu-graphs", model=str(stories_dir), max_num_seqs=max_num_seqs)
    assert graphed == eager
    dev = llm.engine.parts.device
    runner = llm.engine.runner
    # every size was captured up front on padding rows, then 3 decodes ran padded to 4
    assert sorted(dev.graphs) == runner.graph_sizes
    assert dev.graphs[4].calls > 1
    # padding rows wrote nothing: the null block is still zero
    assert all(float(c[:, 0].abs().max()) == 0.0 for c in runner.kv_caches)


def test_enforce_eager_captures_nothing(stories_dir):
    llm, _ = _run("cpu-graphs", model=str(stories_dir), max_num_seqs=4, enforce_eager=True)
    assert llm.engine.runner.graph_sizes == []
    assert llm.engine.parts.device.graphs == {}


def test_graph_sizes_capped_by_max_num_seqs(stories_dir):
    llm, _ = _run("cpu-graphs", model=str(stories_dir), max_num_seqs=2)
    assert llm.engine.runner.graph_sizes == [1, 2]


def test_measured_kv_budget_sizes_the_pool(stories_dir):
    llm, _ = _run("cpu-graphs", model=str(stories_dir), max_num_seqs=4,
                  gpu_memory_utilization=0.5, max_num_batched_tokens=64)
    parts = llm.engine.parts
    spec = parts.spec
    per_block = 2 * 16 * spec.num_kv_heads * spec.head_dim * 4 * spec.num_layers
    assert parts.device.profiled == 1
    assert parts.num_kv_blocks == (1 << 17) // per_block


def test_given_kv_size_skips_the_measurement(stories_dir):
    llm, _ = _run("cpu-graphs", model=str(stories_dir), max_num_seqs=4, num_kv_blocks=40)
    assert llm.engine.parts.device.profiled == 0
    assert llm.engine.parts.num_kv_blocks == 40


def test_profiling_pass_splits_the_largest_step_by_max_model_len():
    from tessellm.engine.memory_profile import largest_step_lengths
    assert largest_step_lengths(2048, 512) == [512] * 4
    assert largest_step_lengths(100, 64) == [64, 36]
    assert largest_step_lengths(8, 256) == [8]


def test_speculative_verify_steps_replay_captured_graphs(stories_dir):
    """With speculation a verify entry is decode rows: 2 sequences x (1 + 3) rows make steps
    of up to 8 rows, captured as decode graphs up front, and the tokens are the eager ones."""
    prompts = ["Tom had a red ball. Tom had a red ball. Tom had a red", "The sun was"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(stories_dir), dtype="float32", load_progress=False,
                                     max_num_seqs=2).generate(prompts, params)]
    llm = LLM(str(stories_dir), plugins=_manager(), device="cpu-graphs", dtype="float32",
              load_progress=False, max_num_seqs=2,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "adaptive": False})
    assert llm.engine.runner.graph_sizes[-1] == 8
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.speculator.stats.accepted_tokens > 0
    graphs = llm.engine.parts.device.graphs
    assert sum(g.calls for size, g in graphs.items() if size > 2) > 1   # verify steps replayed

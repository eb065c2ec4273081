"""The `xla` device end to end on PJRT's CPU client: the real stories260K model against
transformers' greedy tokens, no compilation after start-up under a mixed workload, seeds."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("torch_xla", reason="torch_xla is only in .venv-xla (scripts/setup_xla.sh)")

from tessellm import LLM, SamplingParams  # noqa: E402
from tessellm.plugins import PluginManager  # noqa: E402

OPTIONS = dict(dtype="float32", load_progress=False, max_num_seqs=4, max_num_batched_tokens=32)
PROMPTS = ["Once upon a time", "The cat sat on the mat and looked at the",
           "Lily and Ben went to the park. They played on the swings and the slide until the "
           "sun went down, and then", "One day"]


@pytest.fixture(scope="module")
def xla_llm(stories_dir):
    return LLM(str(stories_dir), device="xla", **OPTIONS)


def test_device_is_listed_available_with_its_backend() -> None:
    records = {r.name: r for r in PluginManager().load().device_records()}
    assert records["xla"].available, records["xla"].reason
    dev = PluginManager().load().select_device("xla")
    assert dev.distributed_backend == "xla"
    shapes = dev.static_shapes(2048, 64)
    assert shapes.token_buckets == (16, 32, 64, 128, 256, 512, 1024, 2048)
    assert shapes.seq_buckets == (1, 2, 4, 8, 16, 32, 64)


def test_stories_greedy_matches_reference(xla_llm, stories_dir) -> None:
    ref = json.loads((stories_dir / "reference_greedy.json").read_text())
    out = xla_llm.generate([ref["prompt"]], SamplingParams(max_tokens=ref["max_new_tokens"],
                                                           temperature=0.0))[0]
    assert xla_llm.encode(ref["prompt"]) + out.token_ids == ref["token_ids"]


def test_mixed_workload_compiles_nothing_after_startup(stories_dir) -> None:
    """Different prompt lengths, a prompt longer than a step (chunked prefill) and a KV pool
    too small for all of them at once (preemption), after start-up precompilation: not one
    more XLA compilation, and the tokens the CPU engine gives."""
    small = dict(OPTIONS, num_kv_blocks=12, block_size=8)
    llm = LLM(str(stories_dir), device="xla", **small)
    dev = llm.engine.parts.device
    before = dev.runtime_counters()["xla_compilations"]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    outs = llm.generate(PROMPTS, params)
    assert dev.runtime_counters()["xla_compilations"] == before
    assert llm.engine.stats.num_preemptions > 0
    cpu = LLM(str(stories_dir), device="cpu", **small)
    assert [o.token_ids for o in outs] == [o.token_ids for o in cpu.generate(PROMPTS, params)]


def test_seeded_sampling_is_reproducible(xla_llm) -> None:
    """torch_xla has no device generator: seeded rows draw their noise on the host from
    their own generator, so a seed gives the same tokens every time."""
    params = [SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=s) for s in (7, 7, 8)]
    a, b, c = (o.token_ids for o in xla_llm.generate(["Once upon a time"] * 3, params))
    assert a == b
    assert a != c


def test_compile_count_reaches_the_core_stats(xla_llm) -> None:
    """The count the server exports as tessellm:device_counter{name="xla_compilations"}."""
    from tessellm.engine.engine_core import core_stats
    counters = core_stats(xla_llm.engine).device_counters
    assert counters["xla_compilations"] >= len(xla_llm.engine.runner.static_shapes.shapes())


def test_lora_batch_equals_the_cpu_engine(stories_dir, tmp_path) -> None:
    """LoRA on xla (the portable lora_add, static shapes): a batch mixing two adapters and
    the base model gives the CPU engine's tokens, and nothing compiles after start-up."""
    from tessellm import LoRARequest
    from tessellm.cli.bench_lora import random_adapters
    options = dict(OPTIONS, enable_lora=True, max_loras=2, max_lora_rank=8)
    cpu = LLM(str(stories_dir), device="cpu", kernel_selection="first", **options)
    loras: list[LoRARequest | None] = random_adapters(cpu, 2, 8, seed=3, b_scale=0.5)
    loras.insert(1, None)
    prompts = PROMPTS[:3]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    want = [o.token_ids for o in cpu.generate(prompts, params, lora_request=loras)]
    llm = LLM(str(stories_dir), device="xla", **options)
    dev = llm.engine.parts.device
    before = dev.runtime_counters()["xla_compilations"]
    assert [o.token_ids for o in llm.generate(prompts, params, lora_request=loras)] == want
    assert dev.runtime_counters()["xla_compilations"] == before
    assert len({tuple(t) for t in want}) == 3

"""The CUDA plugin's Triton kernels end to end, on CPU tensors through Triton's interpreter
(device `triton-interpret`): the real stories260K model against transformers' greedy tokens,
seeded random sampling (the Triton sample kernel) against the cpu device's tokens (also with
async scheduling, whose sampler tables go up through the staging buffers), and the
kernel table showing the Triton kernels chosen (each checked against the reference)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tessellm import LLM, SamplingParams
from tessellm.plugins import PluginManager

TRITON_OPS = {"attention_decode": "decode_triton_paged", "attention_prefill": "prefill_triton_paged",
              "write_kv_cache": "write_kv_triton", "rms_norm": "rms_norm_triton",
              "fused_add_rms_norm": "fused_add_rms_norm_triton",
              "rotary_embedding": "rotary_triton", "silu_and_mul": "silu_and_mul_triton",
              "sample_tokens": "sample_triton"}


def test_devices_report_why_they_are_or_are_not_available() -> None:
    records = {r.name: r for r in PluginManager().load().device_records()}
    assert records["triton-interpret"].available, records["triton-interpret"].reason
    assert not records["cuda"].available
    assert "TRITON_INTERPRET=1" in records["cuda"].reason


@pytest.mark.slow
def test_stories_greedy_matches_reference(stories_dir) -> None:
    ref = json.loads((stories_dir / "reference_greedy.json").read_text())
    ref_ids = ref["token_ids"] if isinstance(ref["token_ids"], list) else json.loads(ref["token_ids"])
    llm = LLM(str(stories_dir), device="triton-interpret", dtype="float32",
              load_progress=False, max_num_seqs=4, max_num_batched_tokens=64)
    out = llm.generate([ref["prompt"]], SamplingParams(max_tokens=ref["max_new_tokens"],
                                                       temperature=0.0))[0]
    assert llm.encode(ref["prompt"]) + out.token_ids == ref_ids
    used = {q.op: name for q, name in llm.engine.parts.selector.chosen().items()}
    for op, name in TRITON_OPS.items():
        assert used.get(op) == name, (op, used.get(op))


@pytest.mark.slow
def test_stories_seeded_sampling_matches_cpu(stories_dir) -> None:
    from tessellm_cuda.triton_ops import sampling
    prompts = ["Once upon a time", "The little dog", "A bird"]
    params = [SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=7),
              SamplingParams(max_tokens=16, temperature=1.2, top_k=20, min_p=0.05, seed=3),
              SamplingParams(max_tokens=16, temperature=0.7, seed=11)]
    tokens = {}
    for device, overlap in (("cpu", False), ("triton-interpret", False),
                            ("triton-interpret", True)):
        llm = LLM(str(stories_dir), device=device, dtype="float32", load_progress=False,
                  max_num_seqs=4, max_num_batched_tokens=64, async_scheduling=overlap)
        got = [o.token_ids for o in llm.generate(prompts, params)]
        if overlap:   # steps launched before the previous one's ids were read back
            assert llm.engine.stats.num_overlapped_steps > 0
            assert got == tokens[device]
            continue
        tokens[device] = got
        select = llm.engine.runner.sampler.select_kernel
        if device == "cpu":
            assert select is None   # no sample_tokens kernel: the reference op runs
        else:
            assert select(3, llm.engine.parts.spec.vocab_size) is sampling.sample_tokens
    assert tokens["triton-interpret"] == tokens["cpu"]
    assert all(len(t) == 16 for t in tokens["cpu"])


@pytest.mark.slow
def test_speculation_on_triton_kernels_with_async_scheduling(stories_dir) -> None:
    """Verify steps (decode rows) through the Triton decode attention and sampling kernels,
    with async scheduling on (steps with drafts complete before the next is scheduled):
    greedy and seeded tokens equal the CPU's without speculation."""
    prompts = ["Tom had a red ball. Tom had a red ball. Tom had a red", "The little dog"]
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.8, seed=5, ignore_eos=True)]
    want = [o.token_ids for o in LLM(str(stories_dir), device="cpu", dtype="float32",
                                     load_progress=False, max_num_seqs=4,
                                     max_num_batched_tokens=64).generate(prompts, params)]
    llm = LLM(str(stories_dir), device="triton-interpret", dtype="float32",
              load_progress=False, max_num_seqs=4, max_num_batched_tokens=64,
              async_scheduling=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "adaptive": False})
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.speculator.stats.accepted_tokens > 0


@pytest.mark.slow
def test_kernels_command_shows_triton_kernels_chosen(stories_dir, tmp_path) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", TESSELLM_CACHE_DIR=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "tessellm.cli.main", "kernels", "--model", str(stories_dir),
         "--device", "triton-interpret", "--dtype", "float32", "--buckets", "1,4", "--json"],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout)
    chosen = {r["query"].split("|")[0]: r for r in rows}
    for op, name in TRITON_OPS.items():
        row = chosen[op]
        assert row["choice"] == name, row
        assert all(c["correct"] for c in row["ranking"]), row   # checked against the reference


def test_staging_buffers_come_from_the_host_pool(stories_dir) -> None:
    """The runner's host buffers are carved out of the plugin's chunked pool, and its use is
    reported through runtime_counters (the server's tessellm:device_counter)."""
    llm = LLM(str(stories_dir), device="triton-interpret", dtype="float32",
              load_progress=False, max_num_seqs=4, max_num_batched_tokens=64,
              kernel_selection="first")
    counters = llm.engine.parts.device.runtime_counters()
    assert counters["host_pool_buffers"] >= 10         # 9 staging buffers + sampled ids
    assert 0 < counters["host_pool_used_bytes"] <= counters["host_pool_reserved_bytes"]
    assert counters["host_pool_pinned"] == 0.0         # pinned only on cuda

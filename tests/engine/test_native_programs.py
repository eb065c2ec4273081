"""The CPU device's native decode programs (tessellm_cpu.native_program, decode_programs):
the same tokens and the same logits as the eager plan, failures that stay with their step, a
program recorded again when its kernel choices change."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tessellm import LLM, SamplingParams
from tessellm.engine.llm_engine import StepError
from tessellm_cpu.decode_programs import DecodeProgram, program_batch_sizes

PROMPTS = ["Once upon a time", "The cat", "Lily and Ben went to the park. They", "A dog",
           "One day, a little girl", "Tom had a red ball"]
# different lengths: the decode batch shrinks 6 -> 1, so sizes 6 (5 padded to 6), 4, 3, 2, 1 run
MAX_TOKENS = [4, 9, 14, 19, 24, 30]


def _random_llama(tmp_path_factory, stories_dir, name: str, **changes) -> Path:
    """A random Llama of stories260K's vocabulary and tokenizer, its config changed so."""
    from transformers import LlamaConfig, LlamaForCausalLM
    out = tmp_path_factory.mktemp(name)
    config = json.loads((stories_dir / "config.json").read_text())
    config.update(changes)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config)).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    for f in stories_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def mha_dir(tmp_path_factory, stories_dir) -> Path:
    """As many KV heads as query heads."""
    return _random_llama(tmp_path_factory, stories_dir, "mha", num_hidden_layers=2,
                         num_key_value_heads=json.loads(
                             (stories_dir / "config.json").read_text())["num_attention_heads"])


@pytest.fixture(scope="module")
def dims32_dir(tmp_path_factory, stories_dir) -> Path:
    """Every linear's dimensions multiples of 32 (the pair-tile bf16 linears' condition), an
    LM head of its own (a tied one stays a plain weight)."""
    return _random_llama(tmp_path_factory, stories_dir, "dims32", num_hidden_layers=2,
                         intermediate_size=128, tie_word_embeddings=False)


def _llm(model: Path, eager: bool, **options) -> LLM:
    options = {"kernel_selection": "first", **options}
    return LLM(str(model), enforce_eager=eager, max_num_seqs=6, load_progress=False, **options)


def _generate(llm: LLM) -> list[list[int]]:
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


def _programs(llm: LLM) -> list[DecodeProgram]:
    return [p for p in llm.engine.runner.shapes._compiled.values()
            if isinstance(p, DecodeProgram)]


CASES = {
    "fp32 dense GQA": dict(dtype="float32"),
    "bf16 dense GQA": dict(dtype="bfloat16"),
    "fp32 packed q8_0": dict(dtype="float32", quantization="q8_0"),
    "fp32 packed q4_0, int8 activations": dict(dtype="float32", quantization="q4_0",
                                              packed_activations="q8_0"),
    "bf16 packed q8_0": dict(dtype="bfloat16", quantization="q8_0"),
    # torch kernels in the step: Python nodes, the KV write's side effect among them
    "fp32 packed, torch KV write and silu": dict(
        dtype="float32", quantization="q8_0",
        kernel_selection={"write_kv_cache": "write_kv_index_copy",
                          "silu_and_mul": "silu_and_mul_chunk"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_program_tokens_and_logits_equal_the_eager_plan(stories_dir, case, monkeypatch):
    options = CASES[case]
    eager = _generate(_llm(stories_dir, True, **options))
    llm = _llm(stories_dir, False, **options)
    assert llm.engine.runner.graph_sizes == program_batch_sizes(6)
    # every replay also runs the eager plan on the same inputs: the logits are the same bits
    diffs: list[bool] = []
    real_run = DecodeProgram.run

    def both(self, feeds):
        out = real_run(self, feeds).clone()
        diffs.append(torch.equal(out, self.plan.run(feeds)))
        return out
    monkeypatch.setattr(DecodeProgram, "run", both)
    assert _generate(llm) == eager
    assert diffs and all(diffs)
    monkeypatch.undo()
    ran = {p.program.output.shape[0]: p for p in _programs(llm) if p.program is not None}
    assert {1, 2, 3, 4, 6} <= set(ran)
    assert all(p.recordings == 1 for p in ran.values())   # recorded once, replayed after
    assert _generate(llm) == eager


def test_mha_program_equals_eager(mha_dir):
    eager = _generate(_llm(mha_dir, True, dtype="float32", quantization="q8_0"))
    assert _generate(_llm(mha_dir, False, dtype="float32", quantization="q8_0")) == eager


def test_bf16dot_linears_in_a_program_equal_eager(dims32_dir):
    """The AVX-512 BF16 linear (its own weight form) as program nodes: the eager plan's
    tokens, and no linear left to Python."""
    from tessellm_cpu.native_build import host_cpu_flags
    if "avx512_bf16" not in host_cpu_flags():
        pytest.skip("no AVX-512 BF16 on this CPU: the linear is not offered")
    options = dict(dtype="bfloat16", kernel_selection={"linear": "linear_bf16dot_native"})
    eager = _generate(_llm(dims32_dir, True, **options))
    llm = _llm(dims32_dir, False, **options)
    assert _generate(llm) == eager
    programs = [p.program for p in _programs(llm) if p.program is not None]
    assert programs
    for program in programs:
        ops = {label.rsplit("(", 1)[1].rstrip(")") for label in program.fallbacks}
        assert "linear" not in ops, program.fallbacks


TORCH_NODES = CASES["fp32 packed, torch KV write and silu"]


def test_packed_decode_runs_in_one_crossing(stories_dir):
    """With every op native (packed linears, the float32 linear for stories260K's dense down
    projection and tied LM head, the native attention, norms, rotary), a decode step is one
    program_run call with no Python node."""
    llm = _llm(stories_dir, False, dtype="float32", quantization="q8_0")
    _generate(llm)
    program = _programs(llm)[0].program
    assert program.python_calls == len(program.fallbacks) == 0
    assert program.native_calls > 5 * 6


def test_torch_kernels_in_a_program_are_reported_as_python_nodes(stories_dir):
    llm = _llm(stories_dir, False, **TORCH_NODES)
    _generate(llm)
    program = _programs(llm)[0].program
    assert program.python_calls == len(program.fallbacks) > 0
    # labels are "node (op)"; what else the profiler put on torch kernels depends on the CPU
    assert "silu_and_mul" in {label.rsplit("(", 1)[1].rstrip(")")
                              for label in program.fallbacks}, program.fallbacks
    assert program.native_calls >= 5   # the rest stays native: at least each layer's attention


def test_a_failing_node_fails_its_step_only(stories_dir, monkeypatch):
    llm = _llm(stories_dir, False, dtype="float32", quantization="q8_0")
    good = _generate(llm)
    real_run = DecodeProgram.run
    calls = {"n": 0}

    def poisoned(self, feeds):   # one decode step with a position outside the rotary table
        calls["n"] += 1
        if calls["n"] != 3:
            return real_run(self, feeds)
        pos = feeds["positions"]
        saved = pos.clone()
        pos[0] = 10 ** 9
        try:
            return real_run(self, feeds)
        finally:
            pos.copy_(saved)
    monkeypatch.setattr(DecodeProgram, "run", poisoned)
    with pytest.raises(StepError, match="outside the rotary table") as info:
        _generate(llm)
    assert {r.finish_reason.value for r in info.value.failed} == {"error"}
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    monkeypatch.undo()
    assert _generate(llm) == good   # the same programs, replayed again


def test_a_python_node_that_raises_fails_its_step_only(stories_dir, monkeypatch):
    llm = _llm(stories_dir, False, **TORCH_NODES)
    good = _generate(llm)
    program = _programs(llm)[0].program
    seg = next(s for s in program.segments if not isinstance(s, tuple))
    real_fn = seg.fn

    def boom(*args):
        raise RuntimeError("injected fallback failure")
    seg.fn = boom
    llm.generate(["x"], SamplingParams(max_tokens=1))   # prefill only: eager, unaffected
    with pytest.raises(StepError, match="injected fallback failure"):
        llm.generate([PROMPTS[0]] * _programs(llm)[0].program.output.shape[0],
                     SamplingParams(max_tokens=4, temperature=0.0))
    seg.fn = real_fn
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    assert _generate(llm) == good


def test_program_is_recorded_again_when_a_kernel_choice_changes(stories_dir):
    from tessellm.graph.lowering import KernelSite
    from tessellm.plugin_api import KernelQuery
    llm = _llm(stories_dir, False, dtype="float32", quantization="q8_0")
    before = _generate(llm)
    plan = llm.engine.parts.plan
    site = next(ins.fn for ins in plan.instructions
                if isinstance(ins.fn, KernelSite) and ins.fn.op == "linear_packed")
    one = next(p for p in _programs(llm) if p.program is not None
               and p.program.output.shape[0] == 1)
    old_native = one.program.native_calls
    # every bucket of the site on the portable dequantize-then-matmul kernel (torch)
    for bucket in list(site._kernels):
        site._bind(bucket, site.selector.best(
            KernelQuery(site.op, site.dtype, bucket, site.dims),
            lambda k: k.name == "linear_packed_dequant_matmul"))
    assert _generate(llm) == before
    assert one.recordings == 2
    assert one.program.native_calls == old_native - 1    # that linear is a Python node now


def test_batch_sizes_cover_every_decode_step():
    assert program_batch_sizes(1) == [1]
    assert program_batch_sizes(6) == [1, 2, 3, 4, 5, 6]
    assert program_batch_sizes(64)[:11] == [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24]
    assert program_batch_sizes(64)[-1] == 64
    assert program_batch_sizes(70)[-2:] == [64, 70]


def test_enforce_eager_records_nothing(stories_dir):
    llm = _llm(stories_dir, True, dtype="float32")
    _generate(llm)
    assert llm.engine.runner.graph_sizes == [] and not _programs(llm)


def test_a_failed_allocation_while_recording_fails_its_step_only(stories_dir, monkeypatch):
    """A recording whose scratch cannot be had fails that step; the next step records."""
    from tessellm_cpu.program_builder import ProgramBuilder
    good = _generate(_llm(stories_dir, True, dtype="float32", quantization="q8_0"))
    llm = _llm(stories_dir, False, dtype="float32", quantization="q8_0")
    real_scratch = ProgramBuilder.scratch
    calls = {"n": 0}

    def scarce(self, nbytes):
        calls["n"] += 1
        if calls["n"] == 1:
            raise MemoryError("injected: no scratch memory")
        return real_scratch(self, nbytes)
    monkeypatch.setattr(ProgramBuilder, "scratch", scarce)
    with pytest.raises(StepError, match="no scratch memory"):
        _generate(llm)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    assert _generate(llm) == good


def test_no_thread_is_left_spinning_after_shutdown(stories_dir):
    """Engines with native programs come and go: the process keeps no more threads than the
    OpenMP team it had, and once they are shut down no CPU time is spent (libgomp's team
    spins a while at the end of a region, then sleeps)."""
    import gc
    import os
    import time

    def threads() -> int:
        status = Path("/proc/self/status").read_text()
        return int(next(line for line in status.splitlines()
                        if line.startswith("Threads:")).split()[1])

    def cpu_seconds() -> float:
        t = os.times()
        return t.user + t.system

    with _llm(stories_dir, False, dtype="float32", quantization="q8_0") as llm:
        _generate(llm)
    gc.collect()
    before = threads()
    for _ in range(3):
        with _llm(stories_dir, False, dtype="float32", quantization="q8_0") as llm:
            _generate(llm)
        gc.collect()
    assert threads() <= before
    time.sleep(0.5)
    t0 = cpu_seconds()
    time.sleep(1.0)
    assert cpu_seconds() - t0 < 0.1


def test_per_head_norms_read_the_fused_qkv_in_place(qwen3_random_dir):
    """qwen3 normalizes q and k per head, [T, heads, D] slices of the fused qkv output whose
    rows do not flatten to one stride: the native rms_norm reads them in place as T groups of
    `heads` rows (they were Python nodes, 2.5 ms of a Qwen3-MoE Q4_K_M decode step), with
    the eager plan's tokens."""
    path = qwen3_random_dir
    eager = _generate(_llm(path, True, dtype="float32", quantization="q8_0"))
    llm = _llm(path, False, dtype="float32", quantization="q8_0")
    assert _generate(llm) == eager
    recorded = [p.program for p in _programs(llm) if p.program is not None]
    assert recorded
    for program in recorded:
        assert not [label for label in program.fallbacks if "rms_norm" in label], \
            program.fallbacks

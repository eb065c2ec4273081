"""The `quantization` engine option: weight-only quantization of a safetensors model at load
(linears packed after fusion, the LM head kept dense), and how it meets GGUF files and devices
without packed kernels."""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch

from tessellm import LLM, SamplingParams
from tessellm.errors import ConfigError
from tessellm.quant.formats import PackedWeight

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from logits_probe import prefill_logits_and_token  # noqa: E402

GREEDY = SamplingParams(max_tokens=40, temperature=0.0)


def _llm(path, **options) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", load_progress=False, **options)


@pytest.fixture(scope="module")
def reference(stories_dir) -> dict:
    return json.loads((stories_dir / "reference_greedy.json").read_text())


@pytest.fixture(scope="module")
def dense(stories_dir) -> LLM:
    return _llm(stories_dir)


def _packed_weights(llm: LLM) -> dict[str, PackedWeight]:
    return {name: w for name, w in llm.engine.parts.weights.items()
            if isinstance(w, PackedWeight)}


@pytest.mark.parametrize(("option", "fmt", "min_same"), [("int8", "Q8_0", 40), ("q8_0", "Q8_0", 40),
                                                          ("q4_1", "Q4_1", 10),
                                                          ("q4_0", "Q4_0", 10)])
def test_safetensors_linears_quantized_at_load(stories_dir, reference, dense, option, fmt,
                                               min_same) -> None:
    """Measured on stories260K (logits std 6.6): Q8_0 moves the prefill logits by 0.13 and
    keeps all 40 greedy tokens of the reference; the 4-bit formats move them by 1.5-2.6 and
    keep the first 23-30 (min_same leaves a margin of 2x)."""
    llm = _llm(stories_dir, quantization=option)
    parts = llm.engine.parts
    assert f"quantize_{fmt.lower()}" in parts.pass_report.applied
    packed = _packed_weights(llm)
    assert packed and {w.format.name for w in packed.values()} == {fmt}
    # fused qkv and gate/up are packed as one matrix each, o_proj too; down_proj (K = 172,
    # not a multiple of 32) and the LM head stay dense
    assert {n.split(".")[0] for n in packed} == {"qkv_proj", "gate_up_proj", "model"}
    assert all(n.endswith(f"o_proj.weight.{fmt.lower()}") for n in packed if n[0] == "m")
    assert not any("down_proj" in n or "lm_head" in n for n in packed)
    # no dense copy of a packed weight survives dead-code removal
    assert not any(n.removesuffix(f".{fmt.lower()}") in parts.weights for n in packed)
    assert parts.weight_bytes < dense.engine.parts.weight_bytes
    out = llm.generate([reference["prompt"]], GREEDY)[0]
    ids = out.prompt_token_ids + out.token_ids
    same = next((i for i, (a, b) in enumerate(zip(ids, reference["token_ids"])) if a != b),
                len(reference["token_ids"])) - len(out.prompt_token_ids)
    assert same >= min_same, (same, out.text)
    if fmt == "Q8_0":
        ours, _ = prefill_logits_and_token(llm, reference["token_ids"][:5])
        theirs, _ = prefill_logits_and_token(dense, reference["token_ids"][:5])
        torch.testing.assert_close(ours, theirs, atol=0.3, rtol=0)


def test_quantizing_a_gguf_file_is_refused() -> None:
    gguf = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "stories260K" \
        / "stories260K.gguf"
    with pytest.raises(ConfigError, match="safetensors"):
        _llm(gguf, quantization="int8")


def test_a_device_without_packed_kernels(stories_dir, caplog) -> None:
    """keep_packed(): an explicit quantization needs linear_packed on the device; a GGUF on a
    device without packed kernels is dequantized at load, with a warning that says so."""
    from tessellm.config import EngineConfig
    from tessellm.engine.builder import keep_packed
    from tessellm.kernels.registry import Kernel, KernelRegistry
    from tessellm.models.source import ModelSource

    class Device:
        name = "bare"

    bare, full = KernelRegistry(), KernelRegistry()
    for op in ("linear_packed", "embedding_packed"):
        full.register(Kernel(op, f"{op}_ref", lambda *a: None, "bare"))
    hf = ModelSource("hf_dir", stories_dir, "stories")
    gguf = ModelSource("gguf", stories_dir / "x.gguf", "x")
    with pytest.raises(ConfigError, match="no linear_packed kernel"):
        keep_packed(EngineConfig(quantization="int8"), hf, Device(), bare)
    assert keep_packed(EngineConfig(quantization="int8"), hf, Device(), full) is False
    assert keep_packed(EngineConfig(), gguf, Device(), full) is True
    assert keep_packed(EngineConfig(quantization="none"), gguf, Device(), full) is False
    with caplog.at_level(logging.WARNING):
        assert keep_packed(EngineConfig(), gguf, Device(), bare) is False
    assert "dequantized at load" in caplog.text


def test_packed_gguf_on_the_simulated_accelerator() -> None:
    """The sim device runs the reference ops, packed ones included, on its own arena."""
    from tessellm.models.source import default_model_file
    llm = LLM(str(default_model_file()), device="sim", dtype="float32", load_progress=False,
              max_num_seqs=2, num_kv_blocks=16)
    assert _packed_weights(llm)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert "Paris" in out.text


def test_q8_activations_opt_in_rounds_packed_linear_inputs(stories_dir, reference) -> None:
    """packed_activations="q8_0": every packed linear becomes linear_packed_q8act; the C VNNI
    kernel and the torch one give the same tokens, and against float activations the prefill
    logits move by the int8 rounding of the inputs. The two kernels' outputs differ by float
    rounding (tests/kernels/test_linear_q8act.py holds them to it), but through the layers a
    last-bit difference can move the next block's int8 rounding by one step (seen: 0.14 in
    the logits once the profiler picked other norm kernels), so end to end the logits are
    held to a fraction of that step's effect, not to float rounding."""
    base = dict(quantization="q8_0", kernel_selection="first")
    exact = _llm(stories_dir, **base)
    runs = {}
    for kernel in ("linear_q8act_vnni", "linear_packed_q8act_torch"):
        llm = _llm(stories_dir, **{**base, "packed_activations": "q8_0",
                                   "kernel_selection": {"linear_packed_q8act": kernel}})
        parts = llm.engine.parts
        assert "q8_activations" in parts.pass_report.applied
        labels = parts.plan.describe()
        assert sum("ops.linear_packed_q8act]" in x for x in labels) == 3 * parts.spec.num_layers
        assert not any("ops.linear_packed]" in x for x in labels)
        logits, _ = prefill_logits_and_token(llm, reference["token_ids"][:5])
        runs[kernel] = (logits, llm.generate([reference["token_ids"][:5]], GREEDY)[0].token_ids)
    (a_logits, a_tokens), (b_logits, b_tokens) = runs.values()
    assert a_tokens == b_tokens
    torch.testing.assert_close(a_logits, b_logits, atol=0.3, rtol=0)
    float_logits, _ = prefill_logits_and_token(exact, reference["token_ids"][:5])
    moved = (a_logits - float_logits).abs().max().item()
    assert 1e-4 < moved < 1.0, moved


def test_auto_activations_follow_the_device(stories_dir) -> None:
    """packed_activations="auto": int8 where the device says they pay (the CPU plugin: where
    its VNNI linear builds) and the model has packed linears; float otherwise, with nothing
    to refuse (an explicit q8_0 on unpacked weights is a ConfigError)."""
    from tessellm_cpu.native_build import host_cpu_flags
    vnni = {"avx512bw", "avx512_vnni"} <= host_cpu_flags()   # the VNNI kernel builds here
    small = dict(max_num_seqs=1, enforce_eager=True, kernel_selection="first")   # the graph
    packed = _llm(stories_dir, quantization="q8_0", packed_activations="auto", **small)
    assert packed.engine.parts.packed_activations == ("q8_0" if vnni else "float")
    assert ("q8_activations" in packed.engine.parts.pass_report.applied) == vnni
    plain = _llm(stories_dir, packed_activations="auto", **small)
    assert plain.engine.parts.packed_activations == "float"
    assert _llm(stories_dir, quantization="q8_0", **small).engine.parts.packed_activations \
        == "float"
    sim = LLM(str(stories_dir), device="sim", dtype="float32", load_progress=False,
              quantization="q8_0", packed_activations="auto", **small)
    assert sim.engine.parts.packed_activations == "float"   # sim does not prefer int8


def test_q8_activations_need_packed_weights_and_a_kernel(stories_dir) -> None:
    with pytest.raises(ConfigError, match="applies to packed weights"):
        _llm(stories_dir, packed_activations="q8_0")
    with pytest.raises(ConfigError, match="no linear_packed_q8act kernel"):   # tests set
        LLM(str(stories_dir), device="triton-interpret", dtype="float32",   # TRITON_INTERPRET
            load_progress=False, quantization="q8_0", packed_activations="q8_0")

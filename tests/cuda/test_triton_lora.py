"""The Triton lora_add against the reference op through Triton's interpreter: mixed slots
and base-model rows, one adapter on every row, none, ranks that are not a power of two and
ranks past one rank tile, empty batches."""
from __future__ import annotations

import pytest
import torch

from tessellm.kernels.profiler import TOLERANCES
from tessellm.kernels.reference_lora import lora_add as reference
from tessellm_cuda.triton_ops import lora


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, k, n, slots_n, rank, mix", [
    (7, 48, 40, 4, 16, "mixed"), (1, 64, 300, 2, 24, "one"), (5, 32, 16, 3, 8, "none"),
    (3, 40, 130, 2, 80, "mixed"), (0, 16, 16, 1, 8, "mixed")])
def test_triton_lora_add_equals_reference(dtype, rows, k, n, slots_n, rank, mix) -> None:
    g = torch.Generator().manual_seed(rows * 31 + rank)
    x = torch.randn((rows, k), generator=g).to(dtype)
    y = torch.randn((rows, n), generator=g).to(dtype)
    a = (torch.randn((slots_n, rank, k), generator=g) * k ** -0.5).to(dtype)
    b = (torch.randn((slots_n, rank, n), generator=g) * rank ** -0.5).to(dtype)
    slots = {"mixed": torch.randint(-1, slots_n, (rows,), generator=g),
             "one": torch.full((rows,), slots_n - 1),
             "none": torch.full((rows,), -1)}[mix]
    out = lora.lora_add(x, y, a, b, slots)
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(out, reference(x, y, a, b, slots), rtol=rtol, atol=atol)
    base = slots < 0
    assert torch.equal(out[base], y[base])


@pytest.fixture(scope="module")
def stories_adapter(stories_dir, tmp_path_factory):
    """A PEFT adapter over stories260K (rank 8, every projection, random weights) and the
    PeftModel it came from."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(stories_dir), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in sorted(peft_model.named_parameters(), key=lambda kv: kv[0]):
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    out = tmp_path_factory.mktemp("stories-lora") / "adapter"
    peft_model.save_pretrained(str(out))
    return out, peft_model.eval()


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_lora_engine_on_the_interpreter_equals_peft(stories_dir, stories_adapter,
                                                    overlap: bool) -> None:
    """The Triton lora_add in a whole engine (and with async scheduling, whose step inputs
    go up through the staging buffers): greedy tokens equal PeftModel's, the base model's
    rows in the same batch equal transformers' base model."""
    from tessellm import LLM, LoRARequest, SamplingParams
    path, peft_model = stories_adapter
    llm = LLM(str(stories_dir), device="triton-interpret", dtype="float32",
              load_progress=False, max_num_seqs=4, max_num_batched_tokens=64,
              enable_lora=True, max_loras=1, max_lora_rank=8, async_scheduling=overlap)
    used = {q.op: name for q, name in llm.engine.parts.selector.chosen().items()}
    assert used["lora_add"] == "lora_add_triton"
    ids = llm.encode("Once upon a time")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    lora = LoRARequest("stories", 1, str(path))
    outs = llm.generate([ids, ids], params, lora_request=[lora, None])
    with torch.inference_mode():
        prompt = torch.tensor([ids])
        want = peft_model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                   do_sample=False, max_new_tokens=12, min_new_tokens=12)
        with peft_model.disable_adapter():
            base = peft_model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                       do_sample=False, max_new_tokens=12, min_new_tokens=12)
    assert outs[0].token_ids == want[0, len(ids):].tolist()
    assert outs[1].token_ids == base[0, len(ids):].tolist()
    assert outs[0].token_ids != outs[1].token_ids

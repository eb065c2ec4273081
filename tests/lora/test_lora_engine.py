"""Multi-LoRA end to end on random Llama and Qwen3 models with adapters built by `peft`:
logits and greedy tokens equal PeftModel's; a batch mixing the base model and several adapters
equals each request run alone, also with more adapters than slots (LRU while serving) and with
preemption; prefix-cache blocks are never shared across adapters; bad adapters are refused
before anything is queued. (The suite checks after every test that no KV block leaked.)"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_fixtures import hf_greedy
from logits_probe import recorded_logits
from lora_fixtures import BaseModel, make_adapter, make_base
from tessellm import LLM, LoRARequest, SamplingParams
from tessellm.errors import InvalidRequestError

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = ["Hello there, how are you doing", "The capital of France is",
           "Once upon a time in a land far away", "def fibonacci(n):", "1, 2, 3, 4,",
           "Tell me a story", "What is the weather like", "Paris London Berlin"]


class Adapters:
    def __init__(self, base: BaseModel, root: Path, count: int) -> None:
        self.base = base
        self.requests = [LoRARequest(f"ad{i}", i + 1, str(root / f"ad{i}")) for i in range(count)]
        self.peft = [make_adapter(base, root / f"ad{i}", seed=100 + i, rank=(4, 8, 16)[i % 3])
                     for i in range(count)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Adapters:
    root = tmp_path_factory.mktemp("lora-llama")
    return Adapters(make_base("llama", root / "base"), root, 4)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Adapters:
    root = tmp_path_factory.mktemp("lora-qwen3")
    return Adapters(make_base("qwen3", root / "base"), root, 1)


def _engine(m: Adapters, **options) -> LLM:
    options = {"enable_lora": True, "max_loras": 4, "max_lora_rank": 16,
               "load_progress": False, "kernel_selection": "first", **options}
    return LLM(str(m.base.directory), **options)


@pytest.mark.parametrize("which", ["llama", "qwen3"])
def test_logits_and_greedy_tokens_equal_peft(which: str, request: pytest.FixtureRequest) -> None:
    m: Adapters = request.getfixturevalue(which)
    llm = _engine(m, max_loras=2, kernel_selection="profile")
    ids = m.base.tokenizer.encode(PROMPTS[0])
    peft_model, lora = m.peft[0], m.requests[0]
    with torch.inference_mode():
        expect = peft_model(torch.tensor([ids])).logits[0, -1]
    with recorded_logits(llm) as seen:
        out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0),
                           lora_request=lora)[0]
    torch.testing.assert_close(seen[0][0], expect, rtol=1e-4, atol=1e-4)
    assert out.token_ids[0] == int(expect.argmax())
    got = llm.generate([ids], GREEDY, lora_request=lora)[0].token_ids
    assert got == hf_greedy(peft_model, ids, 12)
    base = llm.generate([ids], GREEDY)[0].token_ids
    assert base == hf_greedy(m.base.hf, ids, 12) and base != got


def _alone(llm: LLM, ids: list[list[int]], loras: list) -> list[list[int]]:
    return [llm.generate([i], GREEDY, lora_request=lora)[0].token_ids for i, lora in zip(ids, loras)]


def _mixed(m: Adapters) -> tuple[list[list[int]], list]:
    ids = [m.base.tokenizer.encode(p) for p in PROMPTS]
    loras = [None if i % 4 == 3 else m.requests[i % 3] for i in range(len(ids))]
    loras[-1] = m.requests[3]
    return ids, loras


@pytest.fixture(scope="module")
def alone(llama: Adapters) -> list[list[int]]:
    ids, loras = _mixed(llama)
    return _alone(_engine(llama), ids, loras)


def test_mixed_batch_equals_each_request_alone(llama: Adapters, alone) -> None:
    ids, loras = _mixed(llama)
    llm = _engine(llama)
    outs = llm.generate(ids, GREEDY, lora_request=loras)
    assert [o.token_ids for o in outs] == alone
    # adapters of the same prompt differ from each other and from the base model
    one = ids[0]
    distinct = {tuple(llm.generate([one], GREEDY, lora_request=lora)[0].token_ids)
                for lora in [None, *llama.requests]}
    assert len(distinct) == 5


def test_more_adapters_than_slots_with_preemption(llama: Adapters, alone) -> None:
    ids, loras = _mixed(llama)
    llm = _engine(llama, max_loras=2, max_cpu_loras=2, num_kv_blocks=10, block_size=4)
    engine = llm.engine
    running_adapters = []
    step = engine.step

    def watched_step():
        finished = step()
        running_adapters.append({r.lora_int_id for r in engine.scheduler.running} - {0})
        return finished
    engine.step = watched_step
    outs = llm.generate(ids, GREEDY, lora_request=loras)
    assert [o.token_ids for o in outs] == alone
    assert max(len(a) for a in running_adapters) == 2          # never more than the slots
    assert engine.lora.slots.num_loads > 4                      # slots were reused (LRU)
    assert engine.stats.num_preemptions > 0


def test_prefix_cache_is_never_shared_across_adapters(llama: Adapters) -> None:
    llm = _engine(llama, block_size=4)
    sched = llm.engine.scheduler
    ids = llama.base.tokenizer.encode(" ".join(PROMPTS))
    one = SamplingParams(max_tokens=1, temperature=0.0)
    hits = []
    for lora in [llama.requests[0], llama.requests[1], None, llama.requests[0], None]:
        before = sched.prefix_cache_hits
        llm.generate([ids], one, lora_request=lora)
        hits.append(sched.prefix_cache_hits - before)
    assert hits[:3] == [0, 0, 0] and hits[3] > 0 and hits[4] > 0


def test_packed_base_weights_with_float_adapters(llama: Adapters) -> None:
    """An int8 (q8_0 packed) base with a float adapter: its logits are PEFT's within what
    int8 rounding moves the base model's own logits, and the adapter's term is there."""
    llm = _engine(llama, quantization="int8", max_loras=1)
    ids = llama.base.tokenizer.encode(PROMPTS[1])
    with torch.inference_mode():
        expect = llama.peft[1](torch.tensor([ids])).logits[0, -1]
        base = llama.base.hf(torch.tensor([ids])).logits[0, -1]
    one = SamplingParams(max_tokens=1, temperature=0.0)
    with recorded_logits(llm) as seen:
        llm.generate([ids], one, lora_request=llama.requests[1])
        llm.generate([ids], one)
    with_adapter, without = seen[0][0], seen[1][0]
    rounding = (without - base).abs().max()
    assert (with_adapter - expect).abs().max() < 2 * rounding + 0.02
    assert (expect - base).abs().max() > 10 * rounding   # the adapter's term is not noise


def test_bad_adapters_are_refused_and_nothing_is_queued(llama: Adapters, tmp_path: Path) -> None:
    llm = _engine(llama, max_lora_rank=8)
    ids = llama.base.tokenizer.encode(PROMPTS[2])
    cases = [
        (LoRARequest("missing", 9, str(tmp_path / "nope")), "does not exist"),
        (llama.requests[2], "exceeds max_lora_rank 8"),   # rank 16
        ("ad0", "LoRARequest or one per prompt"),
        ([llama.requests[0], llama.requests[1]], "1 prompts but 2"),
    ]
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text(
        (Path(llama.requests[0].lora_path) / "adapter_config.json").read_text())
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 16)
    cases.append((LoRARequest("corrupt", 10, str(corrupt)), "not a readable safetensors"))
    for lora, message in cases:
        with pytest.raises(InvalidRequestError, match=message):
            llm.generate([ids], GREEDY, lora_request=lora)
        assert not llm.engine.has_unfinished()
    # a refused request leaves no adapter state: no counters, no slot written
    assert llm.engine.lora.counts == {} and llm.engine.lora.slots.num_loads == 0
    llm.generate([ids], GREEDY, lora_request=llama.requests[0])
    with pytest.raises(InvalidRequestError, match="lora_int_id 1 is adapter 'ad0'"):
        llm.generate([ids], GREEDY, lora_request=LoRARequest("other", 1, "/x"))
    # the engine is unharmed: the good adapter still gives its tokens
    assert llm.generate([ids], GREEDY, lora_request=llama.requests[0])[0].token_ids == \
        hf_greedy(llama.peft[0], ids, 12)


def test_an_engine_without_lora_refuses_lora_requests(llama: Adapters) -> None:
    llm = LLM(str(llama.base.directory), load_progress=False, kernel_selection="first")
    with pytest.raises(InvalidRequestError, match="enable_lora is off"):
        llm.generate([[1, 2, 3]], GREEDY, lora_request=llama.requests[0])
    assert not llm.engine.has_unfinished()

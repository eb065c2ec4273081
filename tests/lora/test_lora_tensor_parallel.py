"""LoRA with tensor parallelism: 2 ranks over gloo (1 thread each) equal one process, float32:
a batch mixing the base model and two adapters (GQA 4/2: k/v split by KV head; o and down
split by input columns, their partial terms summed by the base linear's all_reduce), also
when an adapter is loaded into a slot mid-run (max_loras 1: the workers load it too)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from logits_probe import recorded_logits
from lora_fixtures import make_adapter, make_base
from tessellm import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[128000, 9906, 1070, 11], [128000, 791, 6864, 315, 9822, 374], [128000, 40, 1093]]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora-tp")
    base = make_base("llama", root / "base")
    make_adapter(base, root / "ad0", seed=300, rank=8)
    make_adapter(base, root / "ad1", seed=301, rank=4, targets=("q_proj", "v_proj",
                                                                  "down_proj"))
    return root


def _run(models: Path, tp: int, max_loras: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    loras = [LoRARequest("ad0", 1, str(models / "ad0")), None,
             LoRARequest("ad1", 2, str(models / "ad1"))]
    with LLM(str(models / "base"), device="cpu", dtype="float32", num_threads=1,
             max_num_seqs=4, num_kv_blocks=64, load_progress=False, kernel_selection="first",
             tensor_parallel_size=tp, enable_lora=True, max_loras=max_loras,
             max_lora_rank=8) as llm:
        tokens = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, lora_request=loras)]
        with recorded_logits(llm) as seen:
            for p, lora in zip(PROMPTS, loras):
                llm.generate([p], SamplingParams(max_tokens=1, temperature=0.0),
                             lora_request=lora)
    return tokens, [s[0] for s in seen]


@pytest.mark.parametrize("max_loras", [2, 1])
def test_two_ranks_equal_one(models: Path, max_loras: int) -> None:
    want_tokens, want_logits = _run(models, 1, max_loras)
    got_tokens, got_logits = _run(models, 2, max_loras)
    assert got_tokens == want_tokens
    assert len({tuple(t) for t in want_tokens}) == 3
    for got, want in zip(got_logits, want_logits):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

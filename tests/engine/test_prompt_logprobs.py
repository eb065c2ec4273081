"""Prompt logprobs (SamplingParams.prompt_logprobs, the engine side of `echo` with logprobs):
each prompt token after the first gets its logprob given the tokens before it, equal to
transformers' log_softmax over the same weights, whatever the chunking of the prompt; the
prompt is computed without prefix-cache hits, a preempted (recomputed) request keeps exactly
one entry per token, and a device with static step shapes refuses the request where it enters
(LLMEngine, or an engine core's front end)."""
from __future__ import annotations

import dataclasses

import asyncio

import pytest
import torch

from tessellm import LLM, SamplingParams
from tessellm.engine.async_engine import AsyncEngine
from tessellm.engine.core_client import EngineCoreClient
from tessellm.errors import InvalidRequestError

PROMPT = ("Once upon a time there was a little girl named Lily. She loved to play outside in "
          "the sunshine. One day she saw a big red ball in the park and she ran to get it")


@pytest.fixture(scope="module")
def reference(stories_dir) -> tuple[list[int], torch.Tensor]:
    from transformers import AutoModelForCausalLM
    llm = LLM(str(stories_dir), dtype="float32", load_progress=False, kernel_selection="first")
    ids = llm.encode(PROMPT)
    model = AutoModelForCausalLM.from_pretrained(str(stories_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return ids, torch.log_softmax(logits.float(), -1)


def _check(entries, ids, lp, k) -> None:
    assert entries[0] is None and len(entries) == len(ids)
    for i, e in enumerate(entries[1:]):
        assert e.token_id == ids[i + 1]
        assert e.logprob == pytest.approx(lp[i, ids[i + 1]].item(), abs=1e-4)
        assert len(e.top) == k
        assert [t for t, _ in e.top] == lp[i].topk(k).indices.tolist()


@pytest.mark.parametrize("budget", [16, 512])
def test_prompt_logprobs_equal_transformers_whatever_the_chunks(stories_dir, reference, budget):
    ids, lp = reference
    llm = LLM(str(stories_dir), dtype="float32", load_progress=False, kernel_selection="first",
              max_num_batched_tokens=budget)
    outs = llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=3, temperature=0,
                                                          prompt_logprobs=3, n=2),
                                           SamplingParams(max_tokens=3, temperature=0)])
    _check(outs[0].prompt_logprobs, ids, lp, 3)
    assert outs[1].prompt_logprobs is None
    assert outs[0].token_ids == outs[1].token_ids   # the output itself is unchanged


def test_no_cache_hit_skips_the_prompt_and_a_recomputed_one_keeps_one_entry_per_token(
        stories_dir, reference):
    """The same prompt again would hit the prefix cache, but its prompt logits must be
    computed: the entries are all there (a recomputed request, whose entries are, may hit)."""
    ids, lp = reference
    llm = LLM(str(stories_dir), dtype="float32", load_progress=False, kernel_selection="first",
              block_size=16, num_kv_blocks=10, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=60, temperature=0, prompt_logprobs=1, ignore_eos=True)
    first = llm.generate([PROMPT], params)[0]
    crowd = llm.generate([PROMPT] * 3, params)   # 3 x 8 blocks in a pool of 10: preemption
    assert llm.engine.stats.num_preemptions > 0
    for out in [first, *crowd]:
        _check(out.prompt_logprobs, ids, lp, 1)
        assert out.token_ids == first.token_ids


def test_a_static_shape_device_refuses_prompt_logprobs(stories_dir, monkeypatch):
    llm = LLM(str(stories_dir), dtype="float32", load_progress=False, kernel_selection="first")
    assert llm.engine.limits.prompt_logprobs   # cpu: no static shapes
    # what an engine on a static-shape device is built with (its limits come from the device)
    monkeypatch.setattr(llm.engine, "limits",
                        dataclasses.replace(llm.engine.limits, prompt_logprobs=False))
    with pytest.raises(InvalidRequestError, match="static shapes"):
        llm.generate([PROMPT], SamplingParams(max_tokens=2, prompt_logprobs=0))

    async def main():   # through an engine core: the front end refuses it (Ready says so)
        core = EngineCoreClient.in_thread(llm.engine)
        await core.wait_ready()
        engine = AsyncEngine(core, llm.tokenizer)
        engine.start()
        try:
            with pytest.raises(InvalidRequestError, match="static shapes"):
                engine.add_request(llm.encode(PROMPT), SamplingParams(
                    max_tokens=2, prompt_logprobs=0), "r")
            assert engine._streams == {}
        finally:
            await engine.shutdown()

    asyncio.run(main())

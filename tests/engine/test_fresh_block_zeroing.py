"""Fresh KV blocks: zeroed when handed out, except those the step's own forward pass writes
in full (a prefill covering them). A pool poisoned with NaN before the first request, read
by kernels that attend over whole padded blocks, still gives the reference tokens."""
from __future__ import annotations

from tessellm import LLM, SamplingParams
from tessellm.engine.block_work import BlockWork

# kernels that read every slot of every block in a (padded) table, masking the unused ones
WHOLE_BLOCKS = {"attention_decode": "decode_batched_sdpa",
                "attention_prefill": "prefill_batched_sdpa"}


def _llm(stories_dir, **kw) -> LLM:
    return LLM(str(stories_dir), dtype="float32", block_size=8, load_progress=False,
               max_num_seqs=4, **kw)


def test_only_blocks_the_step_leaves_partly_unwritten_are_zeroed(stories_dir, monkeypatch):
    zeroed: list[list[int]] = []
    real = BlockWork.zero
    monkeypatch.setattr(BlockWork, "zero",
                        lambda self, ids: (zeroed.append(list(ids)), real(self, ids))[1])
    llm = _llm(stories_dir)
    zeroed.clear()
    prompt = list(range(5, 5 + 20))            # 20 tokens: blocks of 8, 8 and 4 slots
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    assert sum(len(z) for z in zeroed) == 1, zeroed   # the partial third block only
    zeroed.clear()
    llm.generate([list(range(40, 40 + 16))],  # exactly two full blocks: nothing to zero
                 SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    assert sum(len(z) for z in zeroed) == 0, zeroed


def test_poisoned_pool_gives_the_reference_tokens(stories_dir):
    prompts = [list(range(5, 5 + n)) for n in (16, 21, 8, 3)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in _llm(stories_dir).generate(prompts, params)]
    llm = _llm(stories_dir, kernel_selection=WHOLE_BLOCKS)
    for cache in llm.engine.parts.kv_caches:
        cache[:, 1:] = float("nan")            # every block but the null block
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want

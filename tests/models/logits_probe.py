"""Reading the logits tessellm samples from (it has no public logits API yet): wrap the
engine's sampler and keep every logits batch it receives."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from tessellm import LLM, SamplingParams
from tessellm.engine.model_runner import PADDING_ROW
from tessellm.engine.sampler import SampleRequest, SamplerOutput


@contextmanager
def recorded_logits(llm: LLM) -> Iterator[list[torch.Tensor]]:
    """Every logits batch the sampler receives, in call order, copied to the host, without
    the rows a padded step adds (PADDING_ROW)."""
    seen: list[torch.Tensor] = []
    sampler = llm.engine.runner.sampler

    def record(logits: torch.Tensor, rows: Sequence[SampleRequest],
               masks: Any = None) -> SamplerOutput:
        real = sum(1 for r in rows if r is not PADDING_ROW)
        seen.append(logits[:real].detach().cpu().clone())
        return sampler(logits, rows, masks)

    llm.engine.runner.sampler = record
    try:
        yield seen
    finally:
        llm.engine.runner.sampler = sampler


def prefill_logits_and_token(llm: LLM, ids: list[int]) -> tuple[torch.Tensor, int]:
    """tessellm's logits [vocab] at the last position of `ids` (in the engine's dtype) and the
    greedy token the engine sampled from them."""
    with recorded_logits(llm) as seen:
        out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0,
                                                 ignore_eos=True))[0]
    assert len(seen) == 1 and seen[0].shape[0] == 1, [tuple(t.shape) for t in seen]
    return seen[0][0], out.token_ids[0]

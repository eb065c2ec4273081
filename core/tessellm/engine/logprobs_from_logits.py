"""Logprobs from logits rows: of the tokens a step sampled (the sampler's logprobs stage, on
the penalised, biased and masked float32 logits) and of prompt positions (the model's own
distribution). Both read back to the host once per call."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tessellm.engine.logit_penalties import select_rows
from tessellm.engine.token_logprobs import TokenLogprobs

if TYPE_CHECKING:
    from tessellm.engine.sampler import SampleRequest


def fill_logprobs(
    out: list[TokenLogprobs | None],
    x: torch.Tensor,
    token_ids: torch.Tensor,
    rows: Sequence[SampleRequest],
    which: list[int],
) -> None:
    """Set out[i] for every row i in `which` from log_softmax(float32(x)) (penalised logits)."""
    sub, index = select_rows(x, which)
    chosen = token_ids if index is None else token_ids.index_select(0, index)
    logprobs = torch.log_softmax(sub.float(), dim=-1)
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    ks = [min(rows[i].params.logprobs or 0, x.shape[1]) for i in which]
    top_lp: list[list[float]] = [[] for _ in which]
    top_ids: list[list[int]] = [[] for _ in which]
    if max(ks) > 0:
        top = logprobs.topk(max(ks), dim=-1)
        top_lp, top_ids = top.values.tolist(), top.indices.tolist()
    for j, (i, token, lp, k) in enumerate(zip(which, chosen.tolist(), chosen_lp, ks)):
        out[i] = TokenLogprobs(token, lp, list(zip(top_ids[j][:k], top_lp[j][:k])))


def prompt_logprobs_of(logits: torch.Tensor, spans: Sequence[tuple[object, int, int]]
                       ) -> dict[str, list[TokenLogprobs]]:
    """Prompt logprobs from the logits of prompt positions: `spans` are (request, first
    position, count) in row order; row j of a span is position first + j, whose logits give
    the logprob of prompt token first + j + 1 and the request's `prompt_logprobs` most likely
    tokens there (log_softmax of the float32 logits, no penalty or filter: the model's own
    distribution). One host read for the whole step."""
    targets = [r.prompt_token_ids[p + 1] for r, first, count in spans   # type: ignore[attr-defined]
               for p in range(first, first + count)]
    lp = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(targets, dtype=torch.long, device=logits.device).unsqueeze(1)
    chosen = lp.gather(1, index).squeeze(1).tolist()
    k = max(r.params.prompt_logprobs for r, _, _ in spans)   # type: ignore[attr-defined]
    top_lp: list[list[float]] = [[] for _ in targets]
    top_ids: list[list[int]] = [[] for _ in targets]
    if k > 0:
        top = lp.topk(min(k, lp.shape[1]), dim=-1)
        top_lp, top_ids = top.values.tolist(), top.indices.tolist()
    out: dict[str, list[TokenLogprobs]] = {}
    row = 0
    for r, first, count in spans:
        want = r.params.prompt_logprobs   # type: ignore[attr-defined]
        out[r.request_id] = [   # type: ignore[attr-defined]
            TokenLogprobs(targets[j], chosen[j], list(zip(top_ids[j][:want], top_lp[j][:want])))
            for j in range(row, row + count)]
        row += count
    return out

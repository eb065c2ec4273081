"""Penalties and logit biases on rows of a step's logits (the sampler's first two stages; the
order and formulas are its contract, see engine/sampler.py). Every function works out of
place on a float32 copy: the caller's logits are never written to, and rows not named pass
through with their values unchanged."""
from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tessellm.engine.sampler import SampleRequest


def select_rows(x: torch.Tensor, which: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows `which` of x, and their index tensor (None when `which` is every row in order)."""
    if len(which) == x.shape[0]:
        return x, None
    index = torch.tensor(which, dtype=torch.long, device=x.device)
    return x.index_select(0, index), index


def penalize_rows(
    logits: torch.Tensor, rows: Sequence[SampleRequest], which: list[int]
) -> torch.Tensor:
    """float32 copy of `logits` with rows `which` penalised (the others converted only)."""
    x = logits.float()
    sub, index = select_rows(x, which)
    penalized = _apply_penalties(sub, [rows[i] for i in which])
    return penalized if index is None else x.index_copy(0, index, penalized)


def bias_rows(x: torch.Tensor, rows: Sequence[SampleRequest], which: list[int]
               ) -> torch.Tensor:
    """float32 copy of x with each row of `which` plus its logit bias (ids checked before)."""
    row_ids, token_ids, values = [], [], []
    for i in which:
        for token, bias in rows[i].params.logit_bias.items():   # type: ignore[union-attr]
            row_ids.append(i)
            token_ids.append(token)
            values.append(bias)
    out = x.to(torch.float32, copy=True)
    index = (torch.tensor(row_ids, dtype=torch.long, device=x.device),
             torch.tensor(token_ids, dtype=torch.long, device=x.device))
    out.index_put_(index, torch.tensor(values, dtype=torch.float32, device=x.device),
                   accumulate=True)
    return out


def _apply_penalties(x: torch.Tensor, rows: Sequence[SampleRequest]) -> torch.Tensor:
    """Penalised float32 logits [n, vocab] (out of place); every row has some penalty."""
    vocab = x.shape[1]
    params = [r.params for r in rows]
    out_counts = _token_counts([r.output_token_ids for r in rows], vocab, x.device)
    if any(p.repetition_penalty != 1.0 for p in params):
        # Rows with penalty 1 skip their prompt: x / 1 == x * 1 == x, so they pass unchanged.
        prompts = [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else () for r in rows]
        seen = (_token_counts(prompts, vocab, x.device) > 0) | (out_counts > 0)
        rep = _column([p.repetition_penalty for p in params], x.device)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        freq = _column([p.frequency_penalty for p in params], x.device)
        pres = _column([p.presence_penalty for p in params], x.device)
        x = x - freq * out_counts - pres * (out_counts > 0).float()
    return x


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _token_counts(
    seqs: Sequence[Sequence[int]], vocab: int, device: torch.device
) -> torch.Tensor:
    """counts[i, t] = occurrences of token t in seqs[i], float32 [len(seqs), vocab].

    One scatter_add of every id at flat index i * vocab + t; ids are range-checked on the host
    first, since an out-of-range id would silently count for another row.
    """
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    flat = torch.tensor(list(chain.from_iterable(seqs)), dtype=torch.long)
    counts = torch.zeros(len(seqs) * vocab, dtype=torch.float32, device=device)
    if flat.numel():
        if int(flat.min()) < 0 or int(flat.max()) >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab}) to apply penalties")
        row = torch.repeat_interleave(torch.arange(len(seqs), dtype=torch.long), lengths)
        index = (row * vocab + flat).to(device)
        counts.scatter_add_(0, index, torch.ones(index.shape, dtype=torch.float32, device=device))
    return counts.view(len(seqs), vocab)

"""One rank's links to its pipeline neighbours: point-to-point send/recv on torch.distributed
(the device plugin's backend: gloo on cpu, nccl on cuda) over a group of every rank, with the
compute timeout, so a dead neighbour (closed connection) or a late one (timeout) raises.

One forward pass (`run`), synchronous: a stage after the first receives the hidden state
[T, H] from the same tensor-parallel rank of the previous stage, runs its plan, and sends
its result on to the next stage's; the last stage's first rank sends the logits to rank 0,
which waits for them after sending its own stage's hidden state. Every rank knows the shapes
from the step it replays (T tokens, R logits rows), so only the tensors travel.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tessellm.models.pipeline import HIDDEN_FEED
from tessellm.parallel.layout import RankLayout


class StageLink:
    def __init__(self, group: dist.ProcessGroup, layout: RankLayout, rank: int,
                 hidden_size: int, vocab_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.group, self.layout, self.rank = group, layout, rank
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.dtype, self.device = dtype, device
        stage = layout.stage_of(rank)
        self.prev = rank - layout.tp if stage > 0 else None
        self.next = rank + layout.tp if stage < layout.pp - 1 else None
        self.sends_logits = rank == layout.logits_rank and rank != 0
        self.takes_logits = rank == 0 and layout.logits_rank != 0

    def run(self, run_plan: Callable[[dict[str, Any]], torch.Tensor], feeds: dict[str, Any],
            num_tokens: int, num_logits: int) -> torch.Tensor:
        """This stage's part of one forward pass; rank 0 gets the logits, the others their
        stage's output."""
        if self.prev is not None:
            hidden = torch.empty((num_tokens, self.hidden_size), dtype=self.dtype,
                                 device=self.device)
            dist.recv(hidden, self.prev, group=self.group)
            feeds = {**feeds, HIDDEN_FEED: hidden}
        out = run_plan(feeds)
        if self.next is not None:
            dist.send(out.contiguous(), self.next, group=self.group)
        if self.sends_logits:
            dist.send(out.to(self.dtype).contiguous(), 0, group=self.group)
        if self.takes_logits:
            out = torch.empty((num_logits, self.vocab_size), dtype=self.dtype,
                              device=self.device)
            dist.recv(out, self.layout.logits_rank, group=self.group)
        return out

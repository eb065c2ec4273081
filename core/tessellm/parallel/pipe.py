"""One rank's links to its pipeline neighbours: point-to-point sends and receives on
torch.distributed (the device plugin's backend: gloo on cpu, nccl on cuda) over a group of
every rank, each wait bounded by the compute timeout, so a dead neighbour (closed connection)
or a late one (timeout) raises.

One step (`run`) is one or more micro-batches (parallel.micro_batches), in order. A stage
after the first receives micro-batch i's hidden state [T_i, H] from the same tensor-parallel
rank of the previous stage, runs its plan on it and sends the result on with a non-blocking
send, then goes straight on to micro-batch i + 1: so stage s computes i + 1 while stage s + 1
computes i. The last stage's first rank sends each micro-batch's logits to rank 0, which
receives them after its own stage has sent every micro-batch on, and puts them back in the
step's row order. A rank waits for its own sends before it returns (a send's tensor lives
until then; the next step's sends never overtake). Every rank knows the shapes from the step
it replays (tokens and logits rows per micro-batch), so only the tensors travel.

Receives are posted one micro-batch at a time, never ahead of a send the peer is waiting
for: on nccl a pair's sends and receives run in the order they were posted.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tessellm.models.pipeline import HIDDEN_FEED
from tessellm.parallel.layout import RankLayout
from tessellm.parallel.micro_batches import MicroBatchSplit


@dataclass(slots=True)
class PipeStats:
    steps: int = 0
    micro_batches: int = 0


class StageLink:
    def __init__(self, group: dist.ProcessGroup, layout: RankLayout, rank: int,
                 hidden_size: int, vocab_size: int, dtype: torch.dtype,
                 device: torch.device, micro_batches: int = 1,
                 micro_batch_tokens: int = 1, timeout_s: float = 120.0) -> None:
        self.group, self.layout, self.rank = group, layout, rank
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.dtype, self.device = dtype, device
        self.micro_batches = micro_batches   # the most a step is split into
        self.micro_batch_tokens = micro_batch_tokens   # ... each of this many tokens or more
        self.timeout = timedelta(seconds=timeout_s)
        stage = layout.stage_of(rank)
        self.prev = rank - layout.tp if stage > 0 else None
        self.next = rank + layout.tp if stage < layout.pp - 1 else None
        self.sends_logits = rank == layout.logits_rank and rank != 0
        self.takes_logits = rank == 0 and layout.logits_rank != 0
        self.stats = PipeStats()

    def run(self, run_plan: Callable[[dict[str, Any]], torch.Tensor],
            feeds: list[dict[str, Any]], split: MicroBatchSplit) -> torch.Tensor:
        """This stage's part of one step (`feeds[i]`: micro-batch i's inputs); rank 0 gets
        the step's logits, the others their stage's output of the last micro-batch."""
        sends: list[tuple[dist.Work, torch.Tensor]] = []
        out = None
        for i, (mb, mb_feeds) in enumerate(zip(split.batches, feeds)):
            if self.prev is not None:
                hidden = self._recv((len(mb.tokens), self.hidden_size), self.prev, i)
                mb_feeds = {**mb_feeds, HIDDEN_FEED: hidden}
            out = run_plan(mb_feeds)
            if self.next is not None:
                sends.append(self._isend(out, self.next, i))
            if self.sends_logits:
                sends.append(self._isend(out.to(self.dtype), 0, i))
        if self.takes_logits:
            out = split.assemble([self._recv((len(mb.logits), self.vocab_size),
                                             self.layout.logits_rank, i)
                                  for i, mb in enumerate(split.batches)])
        for work, _ in sends:
            work.wait(self.timeout)
        self.stats.steps += 1
        self.stats.micro_batches += len(split.batches)
        return out

    def _isend(self, t: torch.Tensor, dst: int, tag: int) -> tuple[dist.Work, torch.Tensor]:
        t = t.contiguous()
        return dist.isend(t, dst, group=self.group, tag=tag), t

    def _recv(self, shape: tuple[int, int], src: int, tag: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=self.dtype, device=self.device)
        dist.irecv(t, src, group=self.group, tag=tag).wait(self.timeout)
        return t

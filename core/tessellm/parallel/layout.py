"""Where a rank sits in a tensor x pipeline parallel engine.

ranks = tensor_parallel_size * pipeline_parallel_size. Rank r is tensor-parallel rank
r % TP of pipeline stage r // TP: a stage's ranks are contiguous (one tensor-parallel group
each, so a stage's all-reduces stay on one machine when a node holds TP ranks), and rank t of
stage s hands its hidden state to rank t of stage s + 1. Rank 0 (stage 0) is the engine: it
schedules and samples, so the last stage's rank 0 sends it the logits.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RankLayout:
    tp: int = 1
    pp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp

    def stage_of(self, rank: int) -> int:
        return rank // self.tp

    def tp_rank_of(self, rank: int) -> int:
        return rank % self.tp

    def stage_ranks(self, stage: int) -> list[int]:
        return list(range(stage * self.tp, (stage + 1) * self.tp))

    @property
    def logits_rank(self) -> int:
        """The rank that sends the logits to rank 0 (the last stage's first rank)."""
        return (self.pp - 1) * self.tp

    def describe(self, rank: int) -> str:
        """'rank 3' with its pipeline stage when there are several: how errors name a rank."""
        if self.pp == 1:
            return f"tensor-parallel rank {rank}"
        return f"pipeline stage {self.stage_of(rank)} (rank {rank})"

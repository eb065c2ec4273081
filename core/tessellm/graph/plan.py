"""ExecutionPlan: a lowered graph as a flat list of instructions over numbered slots.

Each instruction calls one function (a chosen kernel, a kernel site that picks a kernel per
token bucket, or a structural helper) with arguments that are slot references or constants,
and stores the result in its slot. After an instruction, every slot whose last reader it was is
cleared, so intermediates are released as early as possible (buffer reuse by liveness).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

# What every step feeds a plan's `run` (and a plan `DevicePlugin.compile` returns): token ids
# [T] int64, positions [T] int64, the AttentionMetadata, the rows whose logits are returned
# [R] int64, and each layer's KV cache under KV_CACHE_FEED.format(layer=i).
STEP_FEEDS = ("input_ids", "positions", "attn_meta", "logits_indices")
KV_CACHE_FEED = "kv_cache_{layer}"


@dataclass(frozen=True, slots=True)
class Slot:
    index: int


@dataclass(slots=True)
class Instruction:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    out: int
    release: tuple[int, ...]
    label: str


class ExecutionPlan:
    """Instruction arguments that are not slots (eps, scales, dims) get slots of their own past
    `num_slots`, filled at every run, so each instruction fetches its arguments with one
    precomputed getter (the plan's per-op host cost is part of every decode step)."""

    def __init__(self, instructions: list[Instruction], num_slots: int,
                 inputs: dict[str, int], constants: dict[int, Any], output: int) -> None:
        self.instructions = instructions
        self.num_slots = num_slots
        self.inputs = inputs
        self.constants = constants
        self.output = output
        self._literals: list[tuple[int, Any]] = []
        self._getters = [self._getter(ins.args) for ins in instructions]

    def _getter(self, args: tuple[Any, ...]) -> Callable[[list[Any]], Any]:
        """env -> the instruction's arguments (a tuple or list, to be unpacked)."""
        idx = []
        for a in args:
            if type(a) is Slot:
                idx.append(a.index)
            else:
                idx.append(self.num_slots + len(self._literals))
                self._literals.append((idx[-1], a))
        if len(idx) == 1:
            return operator.itemgetter(slice(idx[0], idx[0] + 1))
        return operator.itemgetter(*idx) if idx else operator.itemgetter(slice(0, 0))

    def run(self, feeds: dict[str, Any]) -> Any:
        env: list[Any] = [None] * (self.num_slots + len(self._literals))
        for i, v in self.constants.items():
            env[i] = v
        for i, v in self._literals:
            env[i] = v
        for name, i in self.inputs.items():
            env[i] = feeds[name]
        for ins, get in zip(self.instructions, self._getters):
            env[ins.out] = ins.fn(*get(env))
            for r in ins.release:
                env[r] = None
        return env[self.output]

    def describe(self) -> list[str]:
        return [ins.label for ins in self.instructions]

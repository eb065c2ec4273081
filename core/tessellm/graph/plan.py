"""ExecutionPlan: a lowered graph as a flat list of instructions over numbered slots.

Each instruction calls one function (a chosen kernel, a kernel site that picks a kernel per
token bucket, or a structural helper) with arguments that are slot references or constants,
and stores the result in its slot. After an instruction, every slot whose last reader it was is
cleared, so intermediates are released as early as possible (buffer reuse by liveness).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


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
    def __init__(self, instructions: list[Instruction], num_slots: int,
                 inputs: dict[str, int], constants: dict[int, Any], output: int) -> None:
        self.instructions = instructions
        self.num_slots = num_slots
        self.inputs = inputs
        self.constants = constants
        self.output = output

    def run(self, feeds: dict[str, Any]) -> Any:
        env: list[Any] = [None] * self.num_slots
        for i, v in self.constants.items():
            env[i] = v
        for name, i in self.inputs.items():
            env[i] = feeds[name]
        for ins in self.instructions:
            env[ins.out] = ins.fn(*[env[a.index] if type(a) is Slot else a for a in ins.args])
            for r in ins.release:
                env[r] = None
        return env[self.output]

    def describe(self) -> list[str]:
        return [ins.label for ins in self.instructions]

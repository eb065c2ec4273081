"""ExecutionPlan: a lowered graph as a flat list of instructions over numbered slots.

Each instruction calls one function (a chosen kernel, a kernel site that picks a kernel per
token bucket, or a structural helper) with arguments that are slot references or constants,
and stores the result in its slot. After an instruction, every slot whose last reader it was is
cleared, so intermediates are released as early as possible (buffer reuse by liveness).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Protocol

# What every step feeds a plan's `run` (and a plan `DevicePlugin.compile` returns): token ids
# [T] int64, positions [T] int64, the AttentionMetadata, the rows whose logits are returned
# [R] int64, and each layer's KV cache under KV_CACHE_FEED.format(layer=i).
# A hybrid model's graph has one more metadata feed per block-table group after the first
# (attn_meta_feed(g); tessellm.cache.kv_groups), its layers' tables and slots.
STEP_FEEDS = ("input_ids", "positions", "attn_meta", "logits_indices")
KV_CACHE_FEED = "kv_cache_{layer}"


def attn_meta_feed(group: int) -> str:
    """The name of block-table group `group`'s attention metadata feed."""
    return f"attn_meta_{group}" if group else "attn_meta"


def group_meta_feeds(inputs: dict[str, int]) -> list[tuple[str, int]]:
    """(name, group) of each metadata feed past the first among a plan's inputs."""
    return [(name, g) for g in range(1, len(inputs)) if (name := attn_meta_feed(g)) in inputs]


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


class BindingClock:
    """Counts kernel rebindings: every kernel site of a plan ticks it when it changes the
    kernel of a bucket it had bound, so anything compiled from the plan (a device's native
    program) can tell that a choice it recorded may have changed."""

    __slots__ = ("ticks",)

    def __init__(self) -> None:
        self.ticks = 0

    def tick(self) -> None:
        self.ticks += 1


class PlanTracer(Protocol):
    """What `ExecutionPlan.trace` runs a plan through (a device recording it). An
    instruction's `fn` that runs kernels says which: `fn.kernels_for(*args)` gives the
    Kernels a call with those arguments runs (in order), or None when the call does more
    than run kernels (a collective, or an attention step that also concatenates); an `fn`
    without it is a structural function (views, splits, row selection: no side effects)."""

    def call(self, ins: Instruction, args: tuple[Any, ...]) -> Any:
        """Run `ins` on `args` (normally `ins.fn(*args)`); its result is stored."""

    def released(self, value: Any) -> None:
        """`value` (an instruction's result) has had its last reader."""


class PlanProfileSink(Protocol):
    """Where a compiled plan reports its time while profiled (`tessellm bench ... --profile`):
    a compiled plan with a `profile_sink` attribute (None normally) adds each run's time to
    the sink set there."""

    def kernel(self, kind: str, seconds: float, calls: int = 1) -> None:
        """Time spent in kernels of op `kind`."""

    def host(self, kind: str, seconds: float) -> None:
        """Time spent around the kernels: crossings into native code, barriers between
        kernels, Python nodes (`kind` says which)."""


class ExecutionPlan:
    """Instruction arguments that are not slots (eps, scales, dims) get slots of their own past
    `num_slots`, filled at every run, so each instruction fetches its arguments with one
    precomputed getter (the plan's per-op host cost is part of every decode step)."""

    def __init__(self, instructions: list[Instruction], num_slots: int,
                 inputs: dict[str, int], constants: dict[int, Any], output: int,
                 clock: BindingClock | None = None) -> None:
        self.instructions = instructions
        self.clock = clock or BindingClock()
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

    @property
    def kernel_generation(self) -> int:
        """Changes whenever a kernel site of the plan changes the kernel of a bucket it had
        bound (a choice overridden, a weight layout unified); a bucket's first binding leaves
        it as it is."""
        return self.clock.ticks

    def _env(self, feeds: dict[str, Any]) -> list[Any]:
        env: list[Any] = [None] * (self.num_slots + len(self._literals))
        for i, v in self.constants.items():
            env[i] = v
        for i, v in self._literals:
            env[i] = v
        for name, i in self.inputs.items():
            env[i] = feeds[name]
        return env

    def run(self, feeds: dict[str, Any]) -> Any:
        env = self._env(feeds)
        for ins, get in zip(self.instructions, self._getters):
            env[ins.out] = ins.fn(*get(env))
            for r in ins.release:
                env[r] = None
        return env[self.output]

    def trace(self, feeds: dict[str, Any], tracer: PlanTracer) -> Any:
        """`run`, with each instruction called through `tracer.call` and each result handed
        to `tracer.released` right after its last reader (the plan's buffer liveness), so a
        device can record the plan as it runs (DevicePlugin.compile)."""
        env = self._env(feeds)
        for ins, get in zip(self.instructions, self._getters):
            env[ins.out] = tracer.call(ins, get(env))
            for r in ins.release:
                tracer.released(env[r])
                env[r] = None
        return env[self.output]

    def describe(self) -> list[str]:
        return [ins.label for ins in self.instructions]

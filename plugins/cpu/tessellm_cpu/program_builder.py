"""Recording a native program (tessellm_cpu.native_program's module docstring says how):
`ProgramBuilder` traces the plan once, runs each native kernel as a one-node program while
it records it, turns what is not native into Python nodes, and lays the buffers out in one
arena by liveness (`layout`)."""
from __future__ import annotations

import bisect
import ctypes
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from tessellm.plugin_api import graph_ops
from tessellm_cpu.native_team import TeamKernelC
from tessellm_cpu.program_runtime import (ALIGN, NotRecordable, ProgramNode, ProgramRecorder,
                                          ProgramRunner)


@dataclass(slots=True)
class Buffer:
    """A tensor a program writes: its recording-time storage and lifetime (clock ticks)."""

    tensor: torch.Tensor
    ptr: int
    nbytes: int
    birth: int
    death: int = -1
    refs: int = 0
    offset: int = -1


@dataclass(slots=True)
class NativeCall:
    """A recorded kernel call: its team entry, argument block, and how it raises an error
    code (`raise_error(code)`; it reads only what stays valid: scalars, the node's own info
    block, tensors outside the arena)."""

    team: int
    args: ctypes.Structure
    raise_error: Callable[[int], None]
    label: str
    keep: tuple = ()


@dataclass(slots=True)
class PythonCall:
    """An instruction replayed in Python: fn(*args) with args resolved at replay (feeds by
    name, arena tensors relocated), its results copied into `outputs`."""

    fn: Callable[..., Any]
    args: list[tuple[str, Any]]
    outputs: list[torch.Tensor]
    label: str


def tensors_of(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


def _short_label(ins: Any) -> str:
    """`node (op)` of an instruction, e.g. "linear_3 (linear)"."""
    op = getattr(ins.fn, "op", None) or getattr(ins.fn, "__name__", type(ins.fn).__name__)
    return f"{ins.label.split(' ', 1)[0].lstrip('%')} ({op})"


class ProgramBuilder:
    """A PlanTracer that records the plan for one step shape (see the module docstring)."""

    def __init__(self, runner: ProgramRunner, feeds: dict[str, Any],
                 select_rows: Callable[..., Any] | None,
                 recorder: "ProgramRecorder | None" = None) -> None:
        self.runner = runner
        self.recorder = recorder
        self.threads = runner.default_threads()
        self.feeds = feeds
        self._feed_ids = {id(v): k for k, v in feeds.items()}
        self._select_rows = select_rows
        self.calls: list[NativeCall | PythonCall] = []
        self.buffers: list[Buffer] = []
        self._by_ptr: list[tuple[int, int]] = []   # (ptr, index into buffers), sorted
        self.clock = 0
        self.fallbacks: dict[str, str] = {}        # instruction label -> why it runs in Python
        self._declined: str | None = None
        self._one = (ProgramNode * 1)()

    # -- what kernels call while recording ------------------------------------------------
    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A tensor for a node to write (a buffer of the program)."""
        t = torch.empty(tuple(shape), dtype=dtype)
        self._register(t)
        return t

    def scratch(self, nbytes: int) -> int:
        """The address of `nbytes` of scratch for the node about to be recorded (0 for none)."""
        if nbytes <= 0:
            return 0
        t = torch.empty(((nbytes + ALIGN - 1) // ALIGN * ALIGN,), dtype=torch.uint8)
        self._register(t).death = self.clock   # lives for its node only
        return t.data_ptr()

    def decline(self, why: str) -> None:
        """The kernel being called cannot be a node here (it would read a temporary): the
        instruction runs as a Python node."""
        self._declined = why

    @property
    def declined(self) -> str | None:
        """Why the instruction being recorded declined to be native (None: it did not)."""
        return self._declined

    def node(self, call: NativeCall) -> None:
        """Record `call` and run it now (the recording computes the step)."""
        self._one[0].fn, self._one[0].args = call.team, ctypes.addressof(call.args)
        rc, _ = self.runner.run(self._one, 1, self.threads)
        if rc:
            call.raise_error(rc)
        self.calls.append(call)
        self.clock += 1

    # -- PlanTracer -------------------------------------------------------------------------
    def call(self, ins: Any, args: tuple[Any, ...]) -> Any:
        start, first_buffer, self._declined = len(self.calls), len(self.buffers), None
        why = None
        kernels_for = getattr(ins.fn, "kernels_for", None)
        kernels = None if kernels_for is None else kernels_for(*args)
        if ins.fn is graph_ops.select_rows and self._select_rows is not None:
            out = self._select_rows(*args)
        elif kernels_for is not None and (kernels is None or not all(
                isinstance(k.fn, TeamKernelC) for k in kernels)):
            # a torch kernel, a collective: the whole call replays in Python (nothing of it
            # is recorded, so a side effect such as a KV write is never lost)
            why = "runs a kernel that is not a native team kernel" if kernels is not None \
                else "does more than run kernels"
            with self.recorder_paused():
                out = ins.fn(*args)
        else:
            out = ins.fn(*args)
            if kernels is not None and self._declined is None \
                    and len(self.calls) - start != len(kernels):
                why = f"ran {len(self.calls) - start} native nodes for {len(kernels)} kernels"
        outs = tensors_of(out)
        internal = [self._find(t.data_ptr()) for t in outs]
        why = why or self._declined
        if why is None and any(b is None for b in internal):
            if len(self.calls) == start and all(self._is_view_of_input(t, args) for t, b
                                                in zip(outs, internal) if b is None):
                pass   # a structural view of stable inputs (weights, feeds): nothing to replay
            else:
                why = "returns tensors no native kernel wrote"
        if why is not None:
            del self.calls[start:]   # what it ran natively runs again inside the Python node
            internal = [b if b is not None else self._register(t)
                        for t, b in zip(outs, internal)]
            label = _short_label(ins)
            fn = getattr(ins.fn, "__wrapped__", ins.fn)   # not a profiler's timer around it
            self.calls.append(PythonCall(fn, [self._arg_recipe(a) for a in args], outs, label))
            self.fallbacks[label] = why
        for b in internal:
            if b is not None:
                b.refs += 1
        for b in self.buffers[first_buffer:]:
            if b.refs == 0 and b.death < 0:
                b.death = self.clock   # written and read inside this instruction only
        self.clock += 1
        return out

    def released(self, value: Any) -> None:
        for t in tensors_of(value):
            b = self._find(t.data_ptr())
            if b is not None:
                b.refs -= 1
                if b.refs == 0:
                    b.death = self.clock

    @contextmanager
    def recorder_paused(self) -> Iterator[None]:
        """Kernels called inside run eagerly (the instruction replays in Python)."""
        if self.recorder is None:
            yield
            return
        with self.recorder.paused():
            yield

    # -- internals ----------------------------------------------------------------------------
    def _register(self, t: torch.Tensor) -> Buffer:
        storage = t.untyped_storage()
        b = Buffer(t, storage.data_ptr(), storage.nbytes(), self.clock)
        bisect.insort(self._by_ptr, (b.ptr, len(self.buffers)))
        self.buffers.append(b)
        return b

    def _find(self, ptr: int) -> Buffer | None:
        i = bisect.bisect_right(self._by_ptr, (ptr, len(self.buffers))) - 1
        if i < 0:
            return None
        b = self.buffers[self._by_ptr[i][1]]
        return b if b.ptr <= ptr < b.ptr + max(b.nbytes, 1) else None

    @staticmethod
    def _is_view_of_input(t: torch.Tensor, args: tuple[Any, ...]) -> bool:
        storage = t.untyped_storage().data_ptr()
        return any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == storage
                   for a in args)

    def _arg_recipe(self, a: Any) -> tuple[str, Any]:
        name = self._feed_ids.get(id(a))
        if name is not None:
            return ("feed", name)
        if isinstance(a, torch.Tensor):
            return ("tensor", a)   # relocated after layout if it lives in a buffer
        if isinstance(a, (tuple, list)) and any(isinstance(x, torch.Tensor)
                                                and self._find(x.data_ptr()) for x in a):
            raise NotRecordable("a Python node takes a sequence of program tensors")
        return ("value", a)

    # -- layout -------------------------------------------------------------------------------
    def layout(self) -> int:
        """Offsets of every buffer in one arena (first fit by liveness); returns its size."""
        end = self.clock
        for b in self.buffers:
            if b.refs > 0 or b.death < 0:
                b.death = end   # still held when the plan ends: its output
        placed: list[Buffer] = []
        total = 0
        for b in sorted(self.buffers, key=lambda b: (b.birth, -b.nbytes)):
            size = (b.nbytes + ALIGN - 1) // ALIGN * ALIGN
            live = sorted((p for p in placed if not (p.death < b.birth or b.death < p.birth)),
                          key=lambda p: p.offset)
            offset = 0
            for p in live:
                if offset + size <= p.offset:
                    break
                offset = max(offset, p.offset + (p.nbytes + ALIGN - 1) // ALIGN * ALIGN)
            b.offset = offset
            placed.append(b)
            total = max(total, offset + size)
        return max(total, ALIGN)

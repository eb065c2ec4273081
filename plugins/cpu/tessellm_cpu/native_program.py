"""Native programs: a decode step's plan recorded once into a flat array of C kernel calls and
replayed by one call per step (native/program.c), the CPU analogue of a CUDA graph.

Recording (`record_program`): the plan runs once for real through `ExecutionPlan.trace`, with
this thread's `ProgramRecorder` active. A native kernel called while recording (a
`TeamKernelC`) does not run on its own: it hands the builder its argument block, whose
tensors it allocated from the builder (`empty`, `scratch`), and the builder runs it there as
a one-node program, so the recording computes the step it records. An instruction that ran
no native kernel and returned views of what it read (splits, heads) needs nothing at
replay; one that returned new tensors (a torch kernel, a kernel that declined: it would have
made a temporary copy) becomes a Python node: at replay it runs again on the same inputs and
its results are copied into the buffers later nodes read. `select_rows` (the rows the LM
head reads) runs as a native node.

Buffers: every tensor a node or a Python node writes lives in one arena per program, laid
out by liveness (the plan's last readers, `PlanTracer.released`; a node's scratch lives for
that node only): first fit in order of birth, so two buffers share bytes only if their
lifetimes are disjoint. The recording allocates them separately, then relocates every
pointer of every argument block, and every tensor a Python node reads, into the arena.
What a node reads that it did not allocate (weights, the KV cache, the step's input
buffers) is outside the arena and must not move: the engine passes the same input buffers
for a padded decode shape on every step (the pointers are checked at every replay; a moved
input means the program is recorded again), and a kernel never passes a pointer into a
temporary of its own while recording (it declines instead).

Replay (`NativeProgram.run`): segments in order, a run of native nodes as one
`program_run` call, a Python node as a call; a node that fails (a position, slot or block id
out of range) raises the error its kernel raises eagerly, and the program stays usable. The
output (logits) is a tensor in the arena: overwritten by the next replay, so it is read
before the next step runs (as the engine's sampler does).
"""
from __future__ import annotations

import bisect
import ctypes
import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from tessellm.plugin_api import ExecutionPlan, graph_ops
from tessellm_cpu.native_build import build_library, entry_point
from tessellm_cpu.native_team import TeamKernelC

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native") / "program.c"
ALIGN = 64


class ProgramNode(ctypes.Structure):
    _fields_ = [("fn", ctypes.c_void_p), ("args", ctypes.c_void_p)]


class NotRecordable(RuntimeError):
    """The plan cannot be recorded for this step's shape (the program runs eagerly)."""


class ProgramRunner:
    """native/program.c: `run(nodes, count, threads, seconds)` -> (code, failed index)."""

    def __init__(self) -> None:
        native = build_library(SOURCE)
        self._run = entry_point(native, "program_run")
        self._run.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
                              ctypes.c_void_p]
        self._run.restype = ctypes.c_int
        threads = entry_point(native, "program_default_threads")
        threads.restype = ctypes.c_int
        self._threads = threads
        self._failed = ctypes.c_int64(-1)

    def default_threads(self) -> int:
        return int(self._threads())

    def run(self, nodes: Any, count: int, threads: int, seconds: Any = None) -> tuple[int, int]:
        rc = self._run(ctypes.addressof(nodes), count, threads, ctypes.addressof(self._failed),
                       None if seconds is None else ctypes.addressof(seconds))
        return rc, self._failed.value


class ProgramRecorder:
    """The builder a thread is recording with (None: kernels run eagerly). One per device;
    every native kernel of the device holds it, so a kernel called inside a recording finds
    the builder without any argument of the plan changing."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.runner: "ProgramRunner | None" = None   # set once programs are available

    @property
    def active(self) -> "ProgramBuilder | None":
        return getattr(self._local, "builder", None)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No builder for the calls inside (they run eagerly); the recording goes on after."""
        builder = self.active
        self._local.builder = None
        try:
            yield
        finally:
            self._local.builder = builder

    @contextmanager
    def recording(self, builder: "ProgramBuilder") -> Iterator[None]:
        if self.active is not None:
            raise RuntimeError("a native program is already being recorded on this thread")
        self._local.builder = builder
        try:
            yield
        finally:
            self._local.builder = None


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


def _tensors(value: Any) -> list[torch.Tensor]:
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
        outs = _tensors(out)
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
        for t in _tensors(value):
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


class NativeProgram:
    """A recorded plan: `run(feeds)` replays it (see the module docstring)."""

    def __init__(self, builder: ProgramBuilder, output: Any, generation: int,
                 pointers: tuple[int, ...]) -> None:
        self.runner = builder.runner
        self.threads = builder.threads
        self.generation = generation
        self.pointers = pointers
        self.fallbacks = dict(builder.fallbacks)
        size = builder.layout()
        self.arena = torch.empty((size,), dtype=torch.uint8)
        base = self.arena.data_ptr()
        if base % ALIGN:
            raise NotRecordable(f"the program arena is not {ALIGN}-byte aligned")

        def relocate(ptr: int) -> int:
            b = builder._find(ptr)
            return ptr if b is None else base + b.offset + (ptr - b.ptr)

        def relocate_tensor(t: torch.Tensor) -> torch.Tensor:
            b = builder._find(t.data_ptr())
            if b is None:
                return t
            byte = b.offset + (t.data_ptr() - b.ptr)
            if byte % t.element_size():
                raise NotRecordable("a program tensor is not aligned to its element size")
            typed = self.arena.view(t.dtype)   # the arena is a multiple of ALIGN bytes
            return torch.as_strided(typed, t.shape, t.stride(), byte // t.element_size())

        self.segments: list[Any] = []   # (ctypes node array, count, calls) or PythonCall
        pending: list[NativeCall] = []
        for call in builder.calls:
            if isinstance(call, NativeCall):
                for name, ctype in type(call.args)._fields_:
                    if ctype is ctypes.c_void_p:
                        value = getattr(call.args, name)
                        if value:
                            setattr(call.args, name, relocate(value))
                pending.append(call)
                continue
            self._flush(pending)
            pending = []
            self.segments.append(PythonCall(
                call.fn, [(k, relocate_tensor(v) if k == "tensor" else v) for k, v in call.args],
                [relocate_tensor(t) for t in call.outputs], call.label))
        self._flush(pending)
        if not isinstance(output, torch.Tensor) or builder._find(output.data_ptr()) is None:
            raise NotRecordable("the plan's output is not a tensor the program writes")
        self.output = relocate_tensor(output)
        self.native_calls = sum(len(s[2]) for s in self.segments if isinstance(s, tuple))
        self.python_calls = sum(1 for s in self.segments if isinstance(s, PythonCall))

    def _flush(self, calls: list[NativeCall]) -> None:
        if not calls:
            return
        nodes = (ProgramNode * len(calls))()
        for i, c in enumerate(calls):
            nodes[i].fn, nodes[i].args = c.team, ctypes.addressof(c.args)
        self.segments.append((nodes, len(calls), list(calls)))

    @property
    def crossings(self) -> int:
        """Native calls (segments of nodes) plus Python nodes one replay makes."""
        return len(self.segments)

    def run(self, feeds: dict[str, Any], sink: Any = None) -> torch.Tensor:
        """Replay; with a PlanProfileSink `sink`, report each kernel's time (the slowest
        thread's), the barriers after them, the crossings into native code and the Python
        nodes."""
        for seg in self.segments:
            if isinstance(seg, PythonCall):
                t0 = time.perf_counter() if sink is not None else 0.0
                args = [feeds[v] if kind == "feed" else v for kind, v in seg.args]
                result = _tensors(seg.fn(*args))
                if len(result) != len(seg.outputs):
                    raise RuntimeError(f"{seg.label}: returned {len(result)} tensors at replay, "
                                       f"{len(seg.outputs)} when recorded")
                for dst, src in zip(seg.outputs, result):
                    dst.copy_(src)
                if sink is not None:   # the torch kernel and the Python around it
                    sink.kernel(f"{seg.label.rsplit('(', 1)[-1].rstrip(')')} (Python node)",
                                time.perf_counter() - t0)
                continue
            nodes, count, calls = seg
            if sink is None:
                rc, failed = self.runner.run(nodes, count, self.threads)
            else:
                rc, failed = self._run_timed(nodes, count, calls, sink)
            if rc:
                calls[failed].raise_error(rc)
        return self.output

    def _run_timed(self, nodes: Any, count: int, calls: list[NativeCall],
                   sink: Any) -> tuple[int, int]:
        nt = self.threads
        seconds = (ctypes.c_double * (2 * count * nt))()
        t0 = time.perf_counter()
        rc, failed = self.runner.run(nodes, count, nt, seconds)
        wall = time.perf_counter() - t0
        inside = 0.0
        for i, call in enumerate(calls[:count if not rc else failed + 1]):
            per = [(seconds[2 * (i * nt + t)], seconds[2 * (i * nt + t) + 1]) for t in range(nt)]
            kernel = max(k for k, _ in per)
            total = max(k + b for k, b in per)
            sink.kernel(call.label, kernel)
            sink.host("barriers between kernels", total - kernel)
            inside += total
        sink.host("crossings into native code", max(0.0, wall - inside))
        return rc, failed


def feed_pointers(feeds: dict[str, Any]) -> tuple[int, ...]:
    """The storage addresses and shapes of every tensor a step feeds (metadata fields too)."""
    out: list[Any] = []
    for value in feeds.values():
        if isinstance(value, torch.Tensor):
            out += [value.data_ptr(), *value.shape]
        elif hasattr(value, "__slots__"):
            for f in value.__slots__:
                v = getattr(value, f)
                if isinstance(v, torch.Tensor):
                    out += [v.data_ptr(), *v.shape]
    return tuple(out)


def record_program(plan: ExecutionPlan, feeds: dict[str, Any], recorder: ProgramRecorder,
                   runner: ProgramRunner, select_rows: Callable[..., Any] | None
                   ) -> tuple[NativeProgram, Any]:
    """Run the plan once while recording it; returns the program and this step's output."""
    generation = plan.kernel_generation
    builder = ProgramBuilder(runner, feeds, select_rows, recorder)
    with recorder.recording(builder):
        output = plan.trace(feeds, builder)
    if plan.kernel_generation != generation:
        # a site bound a bucket during the recording: what it recorded is what runs now
        generation = plan.kernel_generation
    program = NativeProgram(builder, output, generation, feed_pointers(feeds))
    return program, output

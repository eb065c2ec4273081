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

Homes: recording in `program_builder.py` (ProgramBuilder, the node records, the arena
layout), the C runner and the per-device recorder in `program_runtime.py`, replay and
`record_program` here.
"""
from __future__ import annotations

import ctypes
import time
from typing import Any, Callable

import torch

from tessellm.plugin_api import ExecutionPlan
from tessellm_cpu.program_builder import NativeCall, ProgramBuilder, PythonCall, tensors_of
from tessellm_cpu.program_runtime import (ALIGN, NotRecordable, ProgramNode, ProgramRecorder,
                                          ProgramRunner)

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
                result = tensors_of(seg.fn(*args))
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

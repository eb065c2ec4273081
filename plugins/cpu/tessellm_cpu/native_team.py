"""The Python side of the C team kernels (native/team.h): one argument block per call, run
eagerly through `<stem>_run` or, while a native program is being recorded on this thread,
handed to the recording as a node (`<stem>_team`; tessellm_cpu.native_program).

A wrapper binds its arguments once for both paths: it checks them, allocates its outputs with
`empty` (the recording's buffers while recording) and fills a ctypes Structure mirroring the
C one field for field (every pointer a c_void_p, so a recording can relocate it). While
recording it must not point the block at a temporary of its own (a converted copy of an
input): it calls `decline` instead and runs eagerly, and the instruction becomes a Python node.
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable

import torch

from tessellm_cpu.native_build import NativeLibrary, entry_point

_ptr = ctypes.c_void_p


class TeamEntry:
    """The `<stem>_run` function and the address of `<stem>_team` of a loaded library, both
    taking a pointer to one `args` Structure; `<stem>_scratch`, when the library has it, the
    bytes of scratch a call needs."""

    def __init__(self, native: NativeLibrary, stem: str, args: type[ctypes.Structure],
                 scratch: bool = False) -> None:
        self.stem, self.args = stem, args
        self.run = entry_point(native, f"{stem}_run")
        self.run.argtypes, self.run.restype = [_ptr], ctypes.c_int
        self.team = ctypes.cast(entry_point(native, f"{stem}_team"), ctypes.c_void_p).value
        self.scratch = None
        if scratch:
            self.scratch = entry_point(native, f"{stem}_scratch")
            self.scratch.argtypes, self.scratch.restype = [_ptr], ctypes.c_int64


class TeamKernelC:
    """Base of the CPU plugin's C kernels that can be program nodes. `recorder` is the
    device's ProgramRecorder (set by the kernel factory; None: always eager)."""

    recorder: Any = None

    def _builder(self) -> Any:
        rec = self.recorder
        return None if rec is None else rec.active

    @staticmethod
    def _empty(builder: Any, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype
               ) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype) if builder is None \
            else builder.empty(shape, dtype)

    def replay_timer(self, *args: Any) -> Callable[[], Any] | None:
        """The call on `args` as a native program replays it (the profiler times decode
        buckets so): recorded once, then run as a one-node program; None where it would not
        be a node (it declines) or programs are unavailable."""
        rec = self.recorder
        runner = None if rec is None else rec.runner
        if runner is None:
            return None
        from tessellm_cpu.program_builder import NativeCall, ProgramBuilder
        from tessellm_cpu.program_runtime import ProgramNode
        builder = ProgramBuilder(runner, {}, None)
        with rec.recording(builder):
            self(*args)
        if builder.declined or len(builder.calls) != 1 \
                or not isinstance(builder.calls[0], NativeCall):
            return None
        call = builder.calls[0]
        nodes = (ProgramNode * 1)()
        nodes[0].fn, nodes[0].args = call.team, ctypes.addressof(call.args)
        threads = builder.threads

        def run(builder: Any = builder) -> Any:   # the builder keeps the buffers alive
            return runner.run(nodes, 1, threads)
        return run

    def _launch(self, builder: Any, entry: TeamEntry, args: ctypes.Structure, result: Any,
                raise_error: Callable[[int], None], label: str, keep: tuple = ()) -> Any:
        """Run (or record) `args`; `raise_error(code)` raises what a nonzero code means (it
        must read only scalars, `keep` and tensors outside the recording's buffers)."""
        if builder is None:
            rc = entry.run(ctypes.byref(args))
            if rc:
                raise_error(rc)
            return result
        if entry.scratch is not None and hasattr(args, "scratch"):
            args.scratch = builder.scratch(int(entry.scratch(ctypes.byref(args))))
        from tessellm_cpu.program_builder import NativeCall
        builder.node(NativeCall(entry.team, args, raise_error, label, keep))
        return result


def rows_view(t: torch.Tensor) -> torch.Tensor | None:
    """t as [rows, features] with contiguous features and no copy, or None if that needs
    one."""
    if t.dim() == 2 and t.stride(1) == 1:
        return t
    if t.dim() < 2:
        return None
    try:
        t2 = t.view(t.shape[0], -1)
    except RuntimeError:
        return None
    return t2 if t2.stride(1) == 1 else None


def last_dim_rows_view(t: torch.Tensor) -> torch.Tensor | None:
    """t as [rows, last dim] with contiguous features and no copy, or None."""
    if t.dim() == 2 and t.stride(1) == 1:
        return t
    try:
        t2 = t.view(-1, t.shape[-1])
    except RuntimeError:
        return None
    return t2 if t2.stride(1) == 1 else None

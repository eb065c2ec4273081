"""The runtime pieces of native programs (tessellm_cpu.native_program): the C runner of a
node array (native/program.c), the per-device recorder that tells a kernel whether a program
is being recorded on this thread, and the node and error types both sides share."""
from __future__ import annotations

import ctypes
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from tessellm_cpu.native_build import build_library, entry_point

if TYPE_CHECKING:
    from tessellm_cpu.program_builder import ProgramBuilder

SOURCE = Path(__file__).with_name("native") / "program.c"
ALIGN = 64   # bytes: every program buffer and the arena start on this boundary


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

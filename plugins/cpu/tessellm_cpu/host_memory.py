"""Host memory for the CPU device's allocator: large blocks (the KV pool) are anonymous
memory maps that the kernel zero-fills on first touch, committed in the background.

Why not commit at allocation, as vLLM's CPU worker does (torch.zeros): on these VMs first-touch
faults cost microseconds per 4 KiB page, and the default pool is 4 GiB, so a committed pool
made the server's start-up seconds slower. A map costs
nothing; `commit_in_background` then asks the kernel to fault every page in writable
(madvise MADV_POPULATE_WRITE, Linux >= 5.14) from a daemon thread, in chunks, through ctypes so
that the GIL is released: it never changes a byte (zero pages stay zero, a block a step already
wrote keeps its data), so it races with nothing. Until a page is committed, the step that first
writes it pays its fault. Where the call is unavailable the pool is committed by use only
(logged once). No MADV_HUGEPAGE: with THP "defrag=madvise" (these VMs) a huge-page fault
compacts memory synchronously, which made zeroing the null block take 1 s instead of 0.03.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import threading
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

LAZY_MIN_BYTES = 1 << 20       # smaller blocks: plain zeroed torch tensors
COMMIT_CHUNK_BYTES = 8 << 20   # per madvise call: the thread yields between chunks
MADV_POPULATE_WRITE = 23


@dataclass(slots=True)
class _Mapping:
    address: int
    nbytes: int
    buffer: mmap.mmap


class LazyHostMemory:
    """Zeroed host tensors; large ones lazily committed maps (see the module docstring).

    Invariant: every tensor it returns reads as zeros until written; `committed()` is True once
    every map made so far has been committed (or committing is unavailable)."""

    def __init__(self) -> None:
        self._maps: list[_Mapping] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._done.set()
        self._madvise = _Madvise()

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        if nbytes < LAZY_MIN_BYTES:
            return torch.zeros(shape, dtype=dtype)
        buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        raw = torch.frombuffer(buffer, dtype=torch.uint8)   # keeps `buffer` alive
        address = raw.data_ptr()
        with self._lock:
            self._maps.append(_Mapping(address, nbytes, buffer))
        return raw.view(dtype).view(shape)

    def commit_in_background(self) -> None:
        """Start committing every map made so far (a daemon thread); a no-op while one runs."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            pending, self._maps = self._maps, []
            if not pending:
                return
            self._done.clear()
            self._thread = threading.Thread(target=self._commit, args=(pending,),
                                            name="tessellm-host-commit", daemon=True)
            self._thread.start()

    def wait_committed(self, timeout_s: float | None = None) -> bool:
        """Block until the running commit (if any) finishes; False on timeout."""
        return self._done.wait(timeout_s)

    def _commit(self, pending: list[_Mapping]) -> None:
        try:
            for m in pending:
                for offset in range(0, m.nbytes, COMMIT_CHUNK_BYTES):
                    length = min(COMMIT_CHUNK_BYTES, m.nbytes - offset)
                    if not self._madvise(m.address + offset, length, MADV_POPULATE_WRITE):
                        log.info("host memory is committed as steps first write it "
                                 "(madvise MADV_POPULATE_WRITE unavailable)")
                        return
        finally:
            self._done.set()


class _Madvise:
    """libc's madvise through ctypes (the GIL is released during the call), loaded once."""

    def __init__(self) -> None:
        try:
            self._fn = ctypes.CDLL(None, use_errno=True).madvise
            self._fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            self._fn = None

    def __call__(self, address: int, nbytes: int, advice: int) -> bool:
        """False on failure (or where there is no madvise)."""
        return self._fn is not None and self._fn(address, nbytes, advice) == 0

"""A host buffer pool for staging and swap: memory taken from the OS in large chunks, once, and
handed out as aligned views.

Invariants: every buffer starts at a multiple of ALIGNMENT bytes from its chunk's start (chunks
themselves come from torch's allocator, which aligns them at least as much); a chunk is never
returned to the OS while the pool lives, so buffers stay valid for the pool's lifetime (the
contract of HostAllocator: buffers are allocated once, at start-up, and never freed);
`stats()` counts chunk bytes reserved and bytes handed out. With `pin_memory` the chunks are
page-locked (CUDA), so host-to-device copies from them run asynchronously on a stream; as
page-locked memory cannot be paged out, a chunk larger than the host's available memory is
refused with MemoryError rather than pinned (the engine sizes its default swap pool below
that: engine/builder.host_kv_block_count).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from tessellm.plugin_api import HostAllocator, host_memory_info

ALIGNMENT = 256
DEFAULT_CHUNK_BYTES = 64 << 20


@dataclass(slots=True, frozen=True)
class HostPoolStats:
    reserved_bytes: int   # bytes of all chunks
    used_bytes: int       # bytes handed out, alignment padding included
    buffers: int
    chunks: int
    pinned: bool


def _aligned(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


class PinnedHostPool(HostAllocator):
    """Bump allocation inside chunks of at least `chunk_bytes`; a request larger than a chunk
    gets a chunk of its own size."""

    def __init__(self, pin_memory: bool, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        super().__init__(pin_memory=pin_memory)
        if chunk_bytes <= 0 or chunk_bytes % ALIGNMENT:
            raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGNMENT}, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._lock = threading.Lock()
        self._chunks: list[torch.Tensor] = []
        self._offset = 0          # next free byte in the last chunk
        self._used = 0
        self._buffers = 0

    def _new_chunk(self, nbytes: int) -> None:
        size = max(self.chunk_bytes, _aligned(nbytes))
        if self.pin_memory:
            free = host_memory_info().free_bytes
            if size > free:
                raise MemoryError(
                    f"pinned host pool: {size} more bytes to page-lock, the host has {free} "
                    f"available ({sum(c.numel() for c in self._chunks)} pinned already); "
                    "lower swap_space_bytes or num_host_kv_blocks")
        self._chunks.append(torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory))
        self._offset = 0

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = int(torch.Size(shape).numel()) * itemsize
        with self._lock:
            if not self._chunks or self._offset + nbytes > self._chunks[-1].numel():
                self._new_chunk(nbytes)
            chunk, start = self._chunks[-1], self._offset
            self._offset = min(_aligned(start + nbytes), chunk.numel())
            self._used += self._offset - start if nbytes else 0
            self._buffers += 1
        return chunk[start:start + nbytes].view(dtype).view(shape)

    def stats(self) -> HostPoolStats:
        with self._lock:
            return HostPoolStats(sum(c.numel() for c in self._chunks), self._used,
                                 self._buffers, len(self._chunks), self.pin_memory)

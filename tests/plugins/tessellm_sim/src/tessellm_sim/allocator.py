"""Simulated device memory: an arena of byte chunks, and host buffers the device can recognise.

Layout: the arena is a list of chunks, each one `uint8` tensor. An allocation is a 256-byte
aligned byte range of one chunk, handed out as a typed view. Each chunk keeps its free ranges
sorted by offset and coalesced (no two free ranges touch). When no free range fits, a new chunk
is added (`chunk_bytes`, or the allocation's size if larger); a chunk that becomes entirely free
is released, except the first.

Accounting is the base DeviceAllocator's: `allocated_bytes` is the exact sum of the requested
sizes of live allocations and never exceeds `capacity_bytes`. Alignment padding and fragmentation
cost arena bytes (`reserved_bytes`) but not accounted bytes, as in a caching device allocator.
"""
from __future__ import annotations

import bisect
import threading
import weakref
from dataclasses import dataclass, field

import torch

from tessellm.plugin_api import DeviceAllocator, HostAllocator

ALIGNMENT = 256
DEFAULT_CHUNK_BYTES = 64 << 20


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclass(slots=True, eq=False)  # identity: chunks hold tensors
class _Chunk:
    buffer: torch.Tensor                  # uint8 [size]
    free: list[tuple[int, int]] = field(default_factory=list)  # sorted, coalesced (offset, size)

    @property
    def size(self) -> int:
        return self.buffer.numel()

    @property
    def base(self) -> int:
        return self.buffer.data_ptr()

    def take(self, size: int) -> int | None:
        """The offset of a free range of `size` bytes (first fit), now in use; None if none."""
        for i, (off, length) in enumerate(self.free):
            if length >= size:
                if length == size:
                    del self.free[i]
                else:
                    self.free[i] = (off + size, length - size)
                return off
        return None

    def give(self, off: int, size: int) -> None:
        i = bisect.bisect_left(self.free, (off, 0))
        if i < len(self.free) and self.free[i][0] == off + size:      # merge with the next range
            size += self.free.pop(i)[1]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == off:  # merge with the previous
            prev_off, prev_size = self.free.pop(i - 1)
            off, size, i = prev_off, prev_size + size, i - 1
        self.free.insert(i, (off, size))

    def is_empty(self) -> bool:
        return self.free == [(0, self.size)]


class SimAllocator(DeviceAllocator):
    """Device memory of the `sim` device (see the module docstring for the arena's layout)."""

    def __init__(self, capacity_bytes: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if capacity_bytes < 0 or chunk_bytes <= 0:
            raise ValueError(f"invalid sim allocator sizes: capacity {capacity_bytes}, chunk {chunk_bytes}")
        super().__init__("cpu", capacity_bytes)
        self.chunk_bytes = _round_up(min(chunk_bytes, max(capacity_bytes, 1)), ALIGNMENT)
        self._arena_lock = threading.Lock()
        self._chunks: list[_Chunk] = []
        self._blocks: dict[int, tuple[_Chunk, int, int]] = {}  # id(tensor) -> (chunk, offset, size)

    def raw_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Carved out of the arena (the base `allocate` has counted it against capacity)."""
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        chunk, off, size = self._carve(max(_round_up(nbytes, ALIGNMENT), ALIGNMENT))
        t = chunk.buffer[off:off + nbytes].view(dtype).view(shape)
        with self._arena_lock:
            self._blocks[id(t)] = (chunk, off, size)
        return t

    def adopt(self, tensor: torch.Tensor, tag: str) -> torch.Tensor:
        """Accounts for a tensor that is already a view into the arena; anything else is refused
        (host memory is not sim memory: upload it instead)."""
        if not self.owns(tensor):
            raise ValueError(f"cannot adopt a tensor outside sim device memory for {tag!r}; upload it")
        return super().adopt(tensor, tag)

    def free(self, tensor: torch.Tensor) -> None:
        super().free(tensor)
        with self._arena_lock:
            block = self._blocks.pop(id(tensor), None)
            if block is None:
                return  # an adopted view: its bytes belong to another allocation
            chunk, off, size = block
            chunk.give(off, size)
            if chunk.is_empty() and chunk is not self._chunks[0]:
                self._chunks.remove(chunk)

    def _carve(self, size: int) -> tuple[_Chunk, int, int]:
        with self._arena_lock:
            for chunk in self._chunks:
                off = chunk.take(size)
                if off is not None:
                    return chunk, off, size
            chunk = _Chunk(torch.empty(max(self.chunk_bytes, size), dtype=torch.uint8))
            if chunk.size > size:
                chunk.free.append((size, chunk.size - size))  # the new block takes offset 0
            self._chunks.append(chunk)
            return chunk, 0, size

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether every byte of `tensor` lies inside one arena chunk."""
        if tensor.device.type != "cpu":
            return False
        start = tensor.data_ptr()
        span = 1 + sum((n - 1) * st for n, st in zip(tensor.shape, tensor.stride())) if tensor.numel() else 0
        end = start + span * tensor.element_size()
        with self._arena_lock:
            return any(c.base <= start and end <= c.base + c.size for c in self._chunks)

    @property
    def reserved_bytes(self) -> int:
        """Bytes the arena holds (live allocations, padding, free ranges)."""
        with self._arena_lock:
            return sum(c.size for c in self._chunks)


class HostBufferRegistry:
    """The byte ranges of live host buffers made by SimHostAllocator.

    A range is dropped when its tensor object is collected (weakref finalizer), so a lookup can
    miss a view that outlives its base tensor but never flags memory that has been freed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranges: dict[int, int] = {}  # data_ptr -> nbytes

    def track(self, tensor: torch.Tensor) -> None:
        start, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        if nbytes == 0:
            return
        with self._lock:
            self._ranges[start] = nbytes
        weakref.finalize(tensor, self._forget, start)

    def _forget(self, start: int) -> None:
        with self._lock:
            self._ranges.pop(start, None)

    def contains(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type != "cpu" or tensor.numel() == 0:
            return False
        ptr = tensor.data_ptr()
        with self._lock:
            return any(start <= ptr < start + n for start, n in self._ranges.items())

    def __len__(self) -> int:
        with self._lock:
            return len(self._ranges)


class SimHostAllocator(HostAllocator):
    """Host staging buffers of the sim device; each is tracked so sim kernels can refuse it."""

    def __init__(self, registry: HostBufferRegistry) -> None:
        super().__init__(pin_memory=False)
        self._registry = registry

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(tuple(shape), dtype=dtype)
        self._registry.track(t)
        return t

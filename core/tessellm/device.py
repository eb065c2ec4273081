"""The device contract: what a device plugin supplies to the hardware-neutral core.

A device plugin owns one kind of device. The core asks it for an allocator (device memory, with
accounting: the KV pool, weights and persistent activation buffers come from it), a host
allocator (pinned where the device has pinned memory), transfer streams with events, memory
info, synchronize, and its kernels. The core never touches a device library directly.

Ordering rule: a tensor written by `TransferStream.copy` must not be read until the returned
event has completed (`Event.wait()`); on devices whose streams are synchronous the event is
already complete.
"""
from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from tessellm.errors import DeviceUnavailableError

if TYPE_CHECKING:
    from tessellm.kernels.registry import Kernel


@dataclass(slots=True, frozen=True)
class MemoryInfo:
    total_bytes: int
    free_bytes: int


@dataclass(slots=True, frozen=True)
class Availability:
    available: bool
    reason: str = ""


@dataclass(slots=True, frozen=True)
class DecodeGraphShape:
    """The shape key of `DevicePlugin.compile` for a decode graph: steps of exactly `num_seqs`
    decode sequences (real ones first, padding after: slot -1, seq_len 1, a table of block 0)
    with block tables of `max_blocks` columns."""

    num_seqs: int
    max_blocks: int


@dataclass(slots=True, frozen=True)
class StaticShapes:
    """The step shapes a device compiles once each (`DevicePlugin.static_shapes`): every step is
    padded up to the smallest token bucket >= its tokens and sequence bucket >= its sequences
    (and its logits rows to that sequence bucket); block tables always have every column.
    Each bucket list is ascending and ends at the engine's limit."""

    token_buckets: tuple[int, ...]
    seq_buckets: tuple[int, ...]

    def shapes(self) -> list[tuple[int, int]]:
        """Every (tokens, sequences) pair a step can be padded to (sequences <= tokens)."""
        return [(t, b) for t in self.token_buckets for b in self.seq_buckets if b <= t]


@dataclass(slots=True, frozen=True)
class StaticStepShape:
    """The shape key of `DevicePlugin.compile` for a padded step of a static-shape device:
    `num_tokens` token rows (rows past the real ones are padding: slot -1, outside every
    sequence), `num_seqs` sequences (past the real ones: query_len 0, seq_len 0), all treated
    as prefills (num_decodes 0), block tables of `max_blocks` columns."""

    num_tokens: int
    num_seqs: int
    max_blocks: int


@dataclass(slots=True)
class AllocatorStats:
    capacity_bytes: int
    allocated_bytes: int
    peak_bytes: int
    by_tag: dict[str, int]


def host_memory_info() -> MemoryInfo:
    """This machine's memory: total and available from /proc/meminfo (Linux), else from
    sysconf with half of it assumed free. For devices whose memory is the host's."""
    try:
        fields = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                fields[key] = int(value.split()[0]) * 1024
        return MemoryInfo(total_bytes=fields["MemTotal"], free_bytes=fields["MemAvailable"])
    except (OSError, KeyError, ValueError):
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return MemoryInfo(total_bytes=pages, free_bytes=pages // 2)


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class DeviceAllocator:
    """Device memory with accounting.

    Invariant: allocated_bytes == sum of the sizes of live allocations, each counted under the
    tag it was allocated with, and never exceeds capacity_bytes (an allocation that would is
    refused with DeviceUnavailableError naming the tag and the sizes).
    This base allocates with torch on `torch_device`; plugins with their own memory subclass it
    and override public hooks only: `raw_empty` (where a tensor's memory comes from),
    `adopt`/`free` (extended, calling the base), `commit_in_background`/`wait_committed`.
    """

    def __init__(self, torch_device: str | torch.device, capacity_bytes: int) -> None:
        self.torch_device = torch.device(torch_device)
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._live: dict[int, tuple[str, int]] = {}
        self._reservations: dict[str, torch.Tensor] = {}   # reserve()'s markers, by tag
        self._allocated = 0
        self._peak = 0

    def raw_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A new tensor (contents unspecified) for `allocate`, which has done the accounting;
        plugins with their own memory override this."""
        return torch.empty(shape, dtype=dtype, device=self.torch_device)

    def commit_in_background(self) -> None:
        """Commit memory that `raw_empty` handed out lazily, without blocking (the engine
        calls this once its kernels are chosen); nothing by default."""

    def wait_committed(self, timeout_s: float | None = None) -> bool:
        """Block until a background commit ends (benchmarks call this before timing);
        True by default."""
        return True

    def allocate(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, tag: str) -> torch.Tensor:
        """A tensor from `raw_empty`, counted under `tag` (its bytes are given back to the
        count if `raw_empty` raises)."""
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        self._reserve(nbytes, tag)
        try:
            t = self.raw_empty(tuple(shape), dtype)
        except BaseException:
            with self._lock:
                self._allocated -= nbytes
            raise
        self._register(t, tag, nbytes)
        return t

    def reserve(self, nbytes: int, tag: str) -> None:
        """Count `nbytes` under `tag` without a tensor of this allocator's (memory held
        elsewhere: CUDA's transient activations in torch's caching allocator, measured by a
        profiling forward pass); replaces an earlier reservation of the same tag."""
        previous = self._reservations.pop(tag, None)
        if previous is not None:
            self.free(previous)
        marker = torch.empty(0)   # identity only
        self._reserve(nbytes, tag)
        self._register(marker, tag, nbytes)
        self._reservations[tag] = marker

    def adopt(self, tensor: torch.Tensor, tag: str) -> torch.Tensor:
        """Account for a tensor that already lives in this device's memory (zero copy)."""
        nbytes = tensor_nbytes(tensor)
        self._reserve(nbytes, tag)
        self._register(tensor, tag, nbytes)
        return tensor

    def free(self, tensor: torch.Tensor) -> None:
        with self._lock:
            tag, nbytes = self._live.pop(id(tensor))
            self._allocated -= nbytes

    def _reserve(self, nbytes: int, tag: str) -> None:
        with self._lock:
            if self._allocated + nbytes > self.capacity_bytes:
                raise DeviceUnavailableError(
                    f"out of device memory allocating {nbytes} bytes for {tag!r}: "
                    f"{self._allocated} of {self.capacity_bytes} bytes already allocated")
            self._allocated += nbytes
            self._peak = max(self._peak, self._allocated)

    def _register(self, t: torch.Tensor, tag: str, nbytes: int) -> None:
        with self._lock:
            self._live[id(t)] = (tag, nbytes)

    def stats(self) -> AllocatorStats:
        with self._lock:
            by_tag: dict[str, int] = {}
            for tag, nbytes in self._live.values():
                by_tag[tag] = by_tag.get(tag, 0) + nbytes
            return AllocatorStats(self.capacity_bytes, self._allocated, self._peak, by_tag)

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self._allocated


class HostAllocator:
    """Host buffers used for transfers (pinned where the device supports it)."""

    def __init__(self, pin_memory: bool = False) -> None:
        self.pin_memory = pin_memory

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=self.pin_memory)


class Event(ABC):
    """Marks a point in a transfer stream. `wait()` blocks the host until it has passed."""

    @abstractmethod
    def wait(self) -> None: ...

    @abstractmethod
    def query(self) -> bool:
        """True once every operation before the event has completed."""


class CompletedEvent(Event):
    """The event of a synchronous stream: always complete."""

    def wait(self) -> None:
        return None

    def query(self) -> bool:
        return True


class TransferStream(ABC):
    """An ordered queue of copies between host and device memory."""

    @abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        """Enqueue dst.copy_(src); `dst` may not be read (nor `src` written) before the event."""

    @abstractmethod
    def record_event(self) -> Event:
        """An event that completes after everything enqueued so far."""

    def synchronize(self) -> None:
        self.record_event().wait()


class SynchronousStream(TransferStream):
    """A stream whose copies complete before `copy` returns (CPU)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        dst.copy_(src)
        return CompletedEvent()

    def record_event(self) -> Event:
        return CompletedEvent()


class Communicator(ABC):
    """Collectives among the ranks of one tensor-parallel group. Every rank calls the same
    collectives in the same order; a peer that is gone or late past the group's timeout makes
    the call raise (never hang)."""

    rank: int
    world_size: int

    @abstractmethod
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of `x` over the ranks (may reuse `x`'s memory)."""

    @abstractmethod
    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's `x` (same shape on all) concatenated along `dim` in rank order."""


class DevicePlugin(ABC):
    """One kind of device. Subclasses set the class attributes and implement the methods.

    `priority` orders plugins for `device="auto"` (highest available wins).
    """

    name: str
    torch_device_type: str
    priority: int = 0
    distributed_backend: str = "gloo"
    version: str = "0"
    # Whether kernels run asynchronously to the host (a launch only enqueues; cuda). Such a
    # device gets async scheduling by default: the host prepares step N+1 while it runs
    # step N (API 1.4).
    asynchronous: bool = False

    @abstractmethod
    def is_available(self) -> Availability: ...

    @abstractmethod
    def memory_info(self) -> MemoryInfo: ...

    def synchronize(self) -> None:
        return None

    @abstractmethod
    def allocator(self) -> DeviceAllocator:
        """The device allocator; the same object on every call."""

    def host_allocator(self) -> HostAllocator:
        return HostAllocator(pin_memory=False)

    @abstractmethod
    def new_stream(self) -> TransferStream: ...

    def wait_on_compute(self, event: Event) -> None:
        """Order everything the device computes from now on after `event` (a transfer whose
        destination the next kernels read). The default blocks the host (`event.wait()`); a
        device with a compute stream (CUDA) makes that stream wait on the event instead,
        without blocking the host."""
        event.wait()

    def kernels(self) -> list["Kernel"]:
        """Kernels this device offers; more may come from other plugins' `tessellm_kernels`."""
        return []

    def upload(self, host: torch.Tensor, tag: str) -> torch.Tensor:
        """A device copy of a host tensor (weights), allocated from the device allocator."""
        dst = self.allocator().allocate(host.shape, host.dtype, tag)
        self.new_stream().copy(dst, host).wait()
        return dst

    def decode_graph_sizes(self, max_num_seqs: int) -> list[int]:
        """Batch sizes (ascending, each <= max_num_seqs) whose pure-decode steps the engine runs
        through `compile(plan, DecodeGraphShape(size, ...))`, padding a smaller batch up to the
        next size. Empty (the default): every step runs the plan eagerly."""
        return []

    def compile(self, plan: Any, shape_key: Any) -> Any:
        """Per-shape compilation of an execution plan: returns an object with the plan's
        `run(feeds)`. For a DecodeGraphShape the engine calls it with the same input tensors
        (persistent buffers, rewritten in place) on every step of that shape, so a device may
        capture the first call and replay it (CUDA graphs). The default runs the plan as is."""
        return plan

    def static_shapes(self, max_num_batched_tokens: int, max_num_seqs: int) -> StaticShapes | None:
        """Buckets for a device that compiles per shape (XLA): the engine then pads every step
        to a StaticStepShape, runs it through `compile(plan, shape)`, pads the blocks it zeroes
        to powers of two, and compiles every shape before the first request. None (the
        default): steps run at their own sizes."""
        return None

    def prefers_int8_activations(self) -> bool:
        """Whether packed linears run faster here with int8 activations (op
        linear_packed_q8act, llama.cpp's way) than with float ones: what
        packed_activations="auto" picks (API 1.9). False (the default): float, the exact
        product."""
        return False

    def kernels_not_offered(self) -> dict[str, str]:
        """Kernels this device has but does not offer here (read after `kernels()`), name ->
        reason, e.g. a native kernel that failed to build; `tessellm plugins` shows them."""
        return {}

    def runtime_counters(self) -> dict[str, float]:
        """Device-specific counters for metrics and tests (e.g. XLA's compilations)."""
        return {}

    def kv_cache_budget(self, profile_forward: Callable[[], None], utilization: float) -> int | None:
        """Bytes the KV pool may take, measured: the device runs `profile_forward` (one forward
        pass at the largest batch, weights already loaded), accounts its activation peak, and
        returns utilization x total memory minus everything in use. None (the default): the
        engine uses its fixed default budget."""
        return None

    def communicator(self, rank: int, world_size: int, timeout_s: float) -> Communicator | None:
        """The collectives of a tensor-parallel group on this device, for a device whose
        collectives do not go through torch.distributed. None (the default): the engine uses
        torch.distributed with `distributed_backend` (gloo on cpu, nccl on cuda)."""
        return None

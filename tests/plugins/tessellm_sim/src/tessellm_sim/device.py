"""The `sim` device: a CPU-backed stand-in for an accelerator with its own memory and
asynchronous transfer streams (see the package README for what each part simulates).

Settings come from the constructor or, when not given, from the environment when first needed:
TESSELLM_SIM_MEMORY_BYTES (arena capacity, default 2 GiB) and TESSELLM_SIM_COPY_DELAY_S (the
worker's delay before each copy, default 0.002 s). Invalid values make the device unavailable
with the reason, rather than failing plugin discovery.
"""
from __future__ import annotations

import os
import threading

import torch

from tessellm.plugin_api import (
    Availability,
    DevicePlugin,
    HostAllocator,
    Kernel,
    MemoryInfo,
    TransferStream,
)

from tessellm_sim import __version__
from tessellm_sim.allocator import HostBufferRegistry, SimAllocator, SimHostAllocator
from tessellm_sim.kernels import sim_kernels
from tessellm_sim.stream import InFlight, SimStream

MEMORY_ENV = "TESSELLM_SIM_MEMORY_BYTES"
DELAY_ENV = "TESSELLM_SIM_COPY_DELAY_S"
DEFAULT_MEMORY_BYTES = 2 << 30
DEFAULT_COPY_DELAY_S = 0.002


def memory_bytes_from_env() -> int:
    raw = os.environ.get(MEMORY_ENV, "").strip()
    if not raw:
        return DEFAULT_MEMORY_BYTES
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{MEMORY_ENV}={raw!r} is not an integer byte count") from None
    if value <= 0:
        raise ValueError(f"{MEMORY_ENV}={raw!r} must be positive")
    return value


def copy_delay_from_env() -> float:
    raw = os.environ.get(DELAY_ENV, "").strip()
    if not raw:
        return DEFAULT_COPY_DELAY_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{DELAY_ENV}={raw!r} is not a number of seconds") from None
    if not value >= 0:
        raise ValueError(f"{DELAY_ENV}={raw!r} must be >= 0")
    return value


class SimDevice(DevicePlugin):
    name = "sim"
    torch_device_type = "cpu"
    priority = -10  # `auto` never prefers the simulation over a real device
    distributed_backend = "gloo"
    version = __version__

    def __init__(self, capacity_bytes: int | None = None, copy_delay_s: float | None = None) -> None:
        self._capacity_bytes = capacity_bytes
        self._copy_delay_s = copy_delay_s
        self._lock = threading.Lock()
        self._allocator: SimAllocator | None = None
        self._upload_stream: SimStream | None = None
        self._in_flight = InFlight()
        self.host_buffers = HostBufferRegistry()
        self._host_allocator = SimHostAllocator(self.host_buffers)

    def is_available(self) -> Availability:
        try:
            self._capacity()
            self._delay()
        except ValueError as exc:
            return Availability(False, str(exc))
        return Availability(True, "")

    def _capacity(self) -> int:
        return self._capacity_bytes if self._capacity_bytes is not None else memory_bytes_from_env()

    def _delay(self) -> float:
        return self._copy_delay_s if self._copy_delay_s is not None else copy_delay_from_env()

    def allocator(self) -> SimAllocator:
        with self._lock:
            if self._allocator is None:
                self._allocator = SimAllocator(self._capacity())
            return self._allocator

    def host_allocator(self) -> HostAllocator:
        return self._host_allocator

    def memory_info(self) -> MemoryInfo:
        alloc = self.allocator()
        return MemoryInfo(total_bytes=alloc.capacity_bytes, free_bytes=alloc.free_bytes)

    def new_stream(self) -> TransferStream:
        return SimStream(self._delay(), self._in_flight)

    def synchronize(self) -> None:
        """Returns once no copy is in flight on any stream of this device (including streams
        their owner has dropped)."""
        self._in_flight.wait_idle()

    def upload(self, host: torch.Tensor, tag: str) -> torch.Tensor:
        """Copies `host` into a new arena allocation through the device's own upload stream."""
        dst = self.allocator().allocate(host.shape, host.dtype, tag)
        with self._lock:
            if self._upload_stream is None:
                self._upload_stream = SimStream(self._delay(), self._in_flight)
            stream = self._upload_stream
        stream.copy(dst, host).wait()
        return dst

    def kernels(self) -> list[Kernel]:
        return sim_kernels(self.name, self.host_buffers)

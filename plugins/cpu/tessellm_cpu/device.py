"""The CPU device: host memory is device memory, transfers are synchronous copies."""
from __future__ import annotations

import os

import torch

from tessellm.plugin_api import (
    Availability,
    DeviceAllocator,
    DevicePlugin,
    Kernel,
    MemoryInfo,
    SynchronousStream,
    TransferStream,
)


def _meminfo() -> MemoryInfo:
    """Total and available memory from /proc/meminfo (Linux), else a conservative guess."""
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


class CpuDevice(DevicePlugin):
    name = "cpu"
    torch_device_type = "cpu"
    priority = 0
    distributed_backend = "gloo"

    def __init__(self) -> None:
        self._allocator: DeviceAllocator | None = None
        self._not_offered: dict[str, str] = {}

    def is_available(self) -> Availability:
        return Availability(True, "")

    def memory_info(self) -> MemoryInfo:
        return _meminfo()

    def allocator(self) -> DeviceAllocator:
        if self._allocator is None:
            self._allocator = DeviceAllocator("cpu", capacity_bytes=self.memory_info().total_bytes)
        return self._allocator

    def new_stream(self) -> TransferStream:
        return SynchronousStream()

    def upload(self, host: torch.Tensor, tag: str) -> torch.Tensor:
        # Host memory is device memory: account for the tensor, no copy.
        return self.allocator().adopt(host, tag)

    def kernels(self) -> list[Kernel]:
        from tessellm_cpu.kernels import cpu_kernels
        not_offered: dict[str, str] = {}
        kernels = cpu_kernels(self.name, not_offered)
        self._not_offered = not_offered
        return kernels

    def kernels_not_offered(self) -> dict[str, str]:
        """Kernel name -> why the last `kernels()` did not offer it (a native kernel that
        could not be built or loaded here); `tessellm plugins` shows them."""
        return dict(self._not_offered)

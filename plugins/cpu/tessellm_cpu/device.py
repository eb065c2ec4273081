"""The CPU device: host memory is device memory, transfers are synchronous copies."""
from __future__ import annotations


import torch

from tessellm.plugin_api import (
    Availability,
    DeviceAllocator,
    DevicePlugin,
    Kernel,
    MemoryInfo,
    SynchronousStream,
    TransferStream,
    host_memory_info,
)


class CommittedHostAllocator(DeviceAllocator):
    """Host memory committed when allocated: the pages are written (zeroed) now, in parallel,
    as vLLM's CPU worker does for its KV cache (torch.zeros). An untouched page costs a fault
    the first time a step writes it (about 0.65 us per 4 KiB page here: a W1 run writes 600 MB
    of fresh KV blocks, about 0.1 s of faults inside its timed steps), and a pool the machine
    cannot hold fails at start instead of in some later step (4 GiB commits in about 0.8 s on
    2 cores)."""

    def _raw_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return super()._raw_empty(shape, dtype).zero_()


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
        return host_memory_info()

    def allocator(self) -> DeviceAllocator:
        if self._allocator is None:
            self._allocator = CommittedHostAllocator(
                "cpu", capacity_bytes=self.memory_info().total_bytes)
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

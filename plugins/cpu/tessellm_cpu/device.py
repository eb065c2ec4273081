"""The CPU device: host memory is device memory, transfers are synchronous copies."""
from __future__ import annotations

import torch

from typing import Any

from tessellm_cpu.decode_programs import DecodePrograms
from tessellm_cpu.host_memory import LazyHostMemory

from tessellm.plugin_api import (
    Availability,
    DecodeGraphShape,
    DeviceAllocator,
    DevicePlugin,
    Kernel,
    MemoryInfo,
    SynchronousStream,
    TransferStream,
    host_memory_info,
)


class CpuAllocator(DeviceAllocator):
    """Host memory is device memory: zeroed tensors, large ones lazily committed maps that
    `commit_in_background` commits while the engine serves (tessellm_cpu.host_memory)."""

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__("cpu", capacity_bytes)
        self.memory = LazyHostMemory()

    def raw_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.memory.zeros(shape, dtype)

    def commit_in_background(self) -> None:
        self.memory.commit_in_background()

    def wait_committed(self, timeout_s: float | None = None) -> bool:
        return self.memory.wait_committed(timeout_s)


class CpuDevice(DevicePlugin):
    name = "cpu"
    torch_device_type = "cpu"
    priority = 0
    distributed_backend = "gloo"

    def __init__(self) -> None:
        self._allocator: DeviceAllocator | None = None
        self._not_offered: dict[str, str] = {}
        self._offered: frozenset[str] | None = None   # kernel names of the last kernels()
        self._programs = DecodePrograms()

    def is_available(self) -> Availability:
        return Availability(True, "")

    def memory_info(self) -> MemoryInfo:
        return host_memory_info()

    def allocator(self) -> DeviceAllocator:
        if self._allocator is None:
            self._allocator = CpuAllocator(capacity_bytes=self.memory_info().total_bytes)
        return self._allocator

    def new_stream(self) -> TransferStream:
        return SynchronousStream()

    def upload(self, host: torch.Tensor, tag: str) -> torch.Tensor:
        # Host memory is device memory: account for the tensor, no copy.
        return self.allocator().adopt(host, tag)

    def kernels(self) -> list[Kernel]:
        from tessellm_cpu.kernels import cpu_kernels
        not_offered: dict[str, str] = {}
        kernels = cpu_kernels(self.name, not_offered, self._programs.recorder)
        why = self._programs.build()
        if why:
            not_offered["native_program"] = why
        self._not_offered = not_offered
        self._offered = frozenset(k.name for k in kernels)
        return kernels

    def decode_graph_sizes(self, max_num_seqs: int) -> list[int]:
        """Decode steps of these batch sizes run as native programs (one C call a step,
        tessellm_cpu.native_program); none where the program runner cannot be built."""
        return self._programs.batch_sizes(max_num_seqs)

    def compile(self, plan: Any, shape_key: Any) -> Any:
        """A native program for a DecodeGraphShape (recorded on its first step); other
        shapes run the plan eagerly."""
        if not isinstance(shape_key, DecodeGraphShape):
            return plan
        return self._programs.program(plan)

    def prefers_int8_activations(self) -> bool:
        """True where the VNNI int8 linear (linear_q8act_vnni) builds: there packed linears
        stream their weights faster with int8 activations (W5's Q4_K_M 1B decode: ~35 against
        ~23 tok/s with float ones on a 2-core Zen 4)."""
        if self._offered is None:
            self.kernels()
        return "linear_q8act_vnni" in self._offered

    def kernels_not_offered(self) -> dict[str, str]:
        """Kernel name -> why the last `kernels()` did not offer it (a native kernel that
        could not be built or loaded here); `tessellm plugins` shows them."""
        return dict(self._not_offered)

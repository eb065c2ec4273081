"""The `cuda` device (one GPU per process) and the `triton-interpret` device (the same Triton
kernels on CPU tensors through Triton's interpreter, for CI without a GPU).

Which one is usable is fixed per process by TRITON_INTERPRET, because `triton.jit` reads it
when a kernel module is imported: with TRITON_INTERPRET=1 the kernels are interpreted, so
`cuda` reports itself unavailable (its kernels would not be compiled) and `triton-interpret`
is available; without it, the reverse.
"""
from __future__ import annotations

import importlib.util
import os
import threading
from typing import Any

import torch

from tessellm.plugin_api import (
    Availability,
    DecodeGraphShape,
    DeviceAllocator,
    DevicePlugin,
    Event,
    HostAllocator,
    Kernel,
    MemoryInfo,
    SynchronousStream,
    TransferStream,
    host_memory_info,
)
from tessellm_cuda import __version__
from tessellm_cuda.pinned_pool import PinnedHostPool

INTERPRET_ENV = "TRITON_INTERPRET"


def host_pool_counters(pool: PinnedHostPool | None) -> dict[str, float]:
    """The staging/swap pool's use, for metrics (tessellm:device_counter)."""
    if pool is None:
        return {}
    s = pool.stats()
    return {"host_pool_reserved_bytes": float(s.reserved_bytes),
            "host_pool_used_bytes": float(s.used_bytes), "host_pool_buffers": float(s.buffers),
            "host_pool_chunks": float(s.chunks), "host_pool_pinned": float(s.pinned)}


def interpreting() -> bool:
    return os.environ.get(INTERPRET_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def _triton_missing() -> str:
    return "" if importlib.util.find_spec("triton") is not None else \
        "triton is not installed (pip install triton)"


def local_rank() -> int:
    """This process's GPU: LOCAL_RANK from the launcher (torchrun), else 0."""
    raw = os.environ.get("LOCAL_RANK", "0")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"LOCAL_RANK={raw!r} is not an integer") from None


class CudaDevice(DevicePlugin):
    """One CUDA GPU: LOCAL_RANK's. Memory from the driver; the allocator's capacity is the
    device's total memory (the engine sizes its KV pool from what a profiling forward pass
    leaves free, times gpu_memory_utilization)."""

    name = "cuda"
    torch_device_type = "cuda"
    priority = 100
    distributed_backend = "nccl"
    asynchronous = True   # kernels are enqueued on streams: async scheduling by default
    version = __version__

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._allocator: DeviceAllocator | None = None
        self._host: PinnedHostPool | None = None
        self._upload_stream: TransferStream | None = None
        self._graph_pool: Any = None

    def is_available(self) -> Availability:
        if interpreting():
            return Availability(False, f"{INTERPRET_ENV}=1 is set: Triton kernels run in its "
                                       "interpreter in this process (device triton-interpret)")
        missing = _triton_missing()
        if missing:
            return Availability(False, missing)
        if torch.version.cuda is None:
            return Availability(False, f"this torch ({torch.__version__}) is built without CUDA")
        if not torch.cuda.is_available():
            return Availability(False, "torch sees no CUDA device")
        try:
            rank = local_rank()
        except ValueError as e:
            return Availability(False, str(e))
        if rank >= torch.cuda.device_count():
            return Availability(False, f"LOCAL_RANK {rank} but only {torch.cuda.device_count()} "
                                       "CUDA devices are visible")
        return Availability(True, "")

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", local_rank())

    def memory_info(self) -> MemoryInfo:
        free, total = torch.cuda.mem_get_info(self.torch_device)
        return MemoryInfo(total_bytes=int(total), free_bytes=int(free))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def allocator(self) -> DeviceAllocator:
        with self._lock:
            if self._allocator is None:
                torch.cuda.set_device(self.torch_device)
                # tag accounting over torch's caching allocator (which keeps freed blocks for
                # reuse: the driver's free memory is not what is left here); the engine
                # `reserve`s the measured activation peak, so the KV pool gets the rest
                self._allocator = DeviceAllocator(self.torch_device,
                                                  self.memory_info().total_bytes)
            return self._allocator

    def host_allocator(self) -> HostAllocator:
        with self._lock:
            if self._host is None:
                self._host = PinnedHostPool(pin_memory=True)
            return self._host

    def new_stream(self) -> TransferStream:
        from tessellm_cuda.streams import CudaStream
        return CudaStream(self.torch_device)

    def wait_on_compute(self, event: Event) -> None:
        from tessellm_cuda.streams import CudaEvent
        if isinstance(event, CudaEvent):
            event.make_stream_wait(torch.cuda.current_stream(self.torch_device))
        else:
            event.wait()

    def upload(self, host: torch.Tensor, tag: str) -> torch.Tensor:
        dst = self.allocator().allocate(host.shape, host.dtype, tag)
        with self._lock:
            if self._upload_stream is None:
                self._upload_stream = self.new_stream()
            stream = self._upload_stream
        stream.copy(dst, host).wait()
        return dst

    def kernels(self) -> list[Kernel]:
        if not self.is_available().available:
            return []   # never import the Triton kernels for a device that cannot run them
        from tessellm_cuda.kernels import cuda_kernels
        return cuda_kernels(self.name)

    def kv_cache_budget(self, profile_forward: Any, utilization: float) -> int:
        from tessellm_cuda.memory import kv_budget_after_profile
        return kv_budget_after_profile(self, profile_forward, utilization)

    def runtime_counters(self) -> dict[str, float]:
        """Read on every step: the host pool's counters only (cheap; no allocator walk)."""
        return host_pool_counters(self._host)

    def decode_graph_sizes(self, max_num_seqs: int) -> list[int]:
        from tessellm_cuda.graphs import graph_batch_sizes
        return graph_batch_sizes(max_num_seqs)

    def compile(self, plan: Any, shape_key: Any) -> Any:
        """A CUDA graph for a DecodeGraphShape; other shapes run eagerly."""
        from tessellm_cuda.graphs import CudaGraphPlan
        if not isinstance(shape_key, DecodeGraphShape):
            return plan
        with self._lock:
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            pool = self._graph_pool
        return CudaGraphPlan(plan, self.torch_device, pool)


class TritonInterpretDevice(DevicePlugin):
    """CPU tensors, synchronous copies, and the Triton kernels run by Triton's interpreter
    (no CUDA call anywhere): the checkable stand-in for `cuda`. Ops without a Triton kernel
    use torch on the CPU. Host buffers come from the same chunked pool as on CUDA, unpinned."""

    name = "triton-interpret"
    torch_device_type = "cpu"
    priority = -20   # device="auto" never picks an interpreter
    distributed_backend = "gloo"
    version = __version__

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._allocator: DeviceAllocator | None = None
        self._host = PinnedHostPool(pin_memory=False)

    def is_available(self) -> Availability:
        missing = _triton_missing()
        if missing:
            return Availability(False, missing)
        if not interpreting():
            return Availability(False, f"only with {INTERPRET_ENV}=1 (Triton's interpreter)")
        return Availability(True, "")

    def memory_info(self) -> MemoryInfo:
        return host_memory_info()

    def allocator(self) -> DeviceAllocator:
        with self._lock:
            if self._allocator is None:
                self._allocator = DeviceAllocator("cpu", self.memory_info().total_bytes)
            return self._allocator

    def host_allocator(self) -> HostAllocator:
        return self._host

    def new_stream(self) -> TransferStream:
        return SynchronousStream()

    def runtime_counters(self) -> dict[str, float]:
        return host_pool_counters(self._host)

    def upload(self, host: torch.Tensor, tag: str) -> torch.Tensor:
        return self.allocator().adopt(host, tag)   # CPU memory is this device's memory

    def kernels(self) -> list[Kernel]:
        if not self.is_available().available:
            return []
        from tessellm_cuda.kernels import interpreter_kernels
        return interpreter_kernels(self.name)

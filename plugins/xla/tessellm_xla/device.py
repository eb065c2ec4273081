"""The `xla` device: torch-xla's lazy tensors on the PJRT device of this process (a TPU, or
PJRT's CPU client in CI).

Every new shape is a fresh XLA compilation (seconds), a seen one replays in milliseconds, so
the engine pads each step to a StaticStepShape from `static_shapes` (powers of two of tokens
and of sequences) and `compile` wraps the plan so that each step ends in one `torch_xla.sync()`:
the forward pass is one graph per shape, sampling another per sequence bucket. Transfers are
host-synchronous (`SynchronousStream`): a copy into a device tensor becomes device data (or an
update op in the step's graph) before `copy` returns.
"""
from __future__ import annotations

import importlib.util
import threading
from typing import Any

import torch

from tessellm.plugin_api import (
    Availability,
    DeviceAllocator,
    DevicePlugin,
    Kernel,
    MemoryInfo,
    StaticShapes,
    StaticStepShape,
    SynchronousStream,
    TransferStream,
    host_memory_info,
)
from tessellm_xla import __version__

MIN_TOKEN_BUCKET = 16


def powers_of_two_up_to(limit: int, start: int = 1) -> tuple[int, ...]:
    """start, 2 start, 4 start, ... below `limit`, then `limit` itself."""
    out, b = [], max(1, min(start, limit))
    while b < limit:
        out.append(b)
        b *= 2
    return tuple(out + [limit])


class XlaStepPlan:
    """The plan of one StaticStepShape: runs it, then cuts the lazy graph there
    (`torch_xla.sync()`), so its compiled form depends on the shape alone."""

    def __init__(self, plan: Any, shape: StaticStepShape) -> None:
        self.plan = plan
        self.shape = shape

    def run(self, feeds: dict[str, Any]) -> Any:
        import torch_xla
        out = self.plan.run(feeds)
        torch_xla.sync()
        return out


class XlaDevice(DevicePlugin):
    name = "xla"
    torch_device_type = "xla"
    priority = 50
    distributed_backend = "xla"
    version = __version__

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._allocator: DeviceAllocator | None = None

    def is_available(self) -> Availability:
        if importlib.util.find_spec("torch_xla") is None:
            return Availability(False, "torch_xla is not installed (scripts/setup_xla.sh makes "
                                       ".venv-xla with torch 2.9.0 and torch-xla 2.9.0)")
        try:
            import torch_xla
            import torch_xla.runtime as xr
            torch_xla.device()
            kind = xr.device_type()
        except Exception as e:  # import or PJRT client failure: reported, never raised
            return Availability(False, f"torch_xla has no usable PJRT device: "
                                       f"{type(e).__name__}: {e}")
        return Availability(True, f"PJRT {kind}")

    @property
    def torch_device(self) -> torch.device:
        import torch_xla
        return torch_xla.device()

    def memory_info(self) -> MemoryInfo:
        """The runtime's figures where PJRT reports them (TPU); PJRT's CPU client does not
        (GetAllocatorStats is unimplemented), and its memory is the host's."""
        import torch_xla.core.xla_model as xm
        try:
            info = xm.get_memory_info(self.torch_device)
            total = int(info["bytes_limit"])
            return MemoryInfo(total_bytes=total, free_bytes=total - int(info["bytes_used"]))
        except (RuntimeError, KeyError, TypeError):
            return host_memory_info()

    def synchronize(self) -> None:
        import torch_xla
        import torch_xla.core.xla_model as xm
        torch_xla.sync()
        xm.wait_device_ops()

    def allocator(self) -> DeviceAllocator:
        with self._lock:
            if self._allocator is None:
                self._allocator = DeviceAllocator(self.torch_device,
                                                  self.memory_info().total_bytes)
            return self._allocator

    def new_stream(self) -> TransferStream:
        return SynchronousStream()

    def upload(self, host: torch.Tensor, tag: str) -> torch.Tensor:
        """Weights become device data directly (no update op in any graph)."""
        return self.allocator().adopt(host.to(self.torch_device), tag)

    def kernels(self) -> list[Kernel]:
        if not self.is_available().available:
            return []
        from tessellm_xla.kernels import xla_kernels
        return xla_kernels(self.name)

    def static_shapes(self, max_num_batched_tokens: int, max_num_seqs: int) -> StaticShapes:
        return StaticShapes(
            token_buckets=powers_of_two_up_to(max_num_batched_tokens, MIN_TOKEN_BUCKET),
            seq_buckets=powers_of_two_up_to(max_num_seqs))

    def compile(self, plan: Any, shape_key: Any) -> Any:
        if not isinstance(shape_key, StaticStepShape):
            raise TypeError(f"the xla device compiles StaticStepShapes, got {shape_key!r}")
        return XlaStepPlan(plan, shape_key)

    def runtime_counters(self) -> dict[str, float]:
        """XLA compilations so far (UncachedCompile), cache hits and graph executions."""
        import torch_xla.debug.metrics as met
        return {name: float(met.counter_value(counter) or 0) for name, counter in (
            ("xla_compilations", "UncachedCompile"), ("xla_cached_compilations", "CachedCompile"),
            ("xla_executions", "ExecuteComputation"))}

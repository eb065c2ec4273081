"""Kernels of the sim device.

- `sim_silu_and_mul`: its own silu_and_mul (torch's silu over the chunked halves), registered
  ahead of the reference so that `kernel_selection: first` picks it.
- `sim_reference`: the reference implementation of every other op, except `fused_add_rms_norm`
  which sim deliberately lacks: the engine must not apply that fusion on this device.
Every kernel first checks its tensor arguments (also inside lists, tuples and dataclasses such as
AttentionMetadata) and refuses host staging buffers of the sim host allocator.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from tessellm.plugin_api import Kernel, reference

from tessellm_sim.allocator import HostBufferRegistry

MISSING_OPS = frozenset({"fused_add_rms_norm"})


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _tensors(getattr(value, f.name))


def guarded(op: str, fn: Callable[..., Any], host_buffers: HostBufferRegistry) -> Callable[..., Any]:
    """`fn` with the same signature, refusing any argument that is a sim host buffer."""

    @functools.wraps(fn)
    def kernel(*args: Any, **kwargs: Any) -> Any:
        for t in _tensors((args, tuple(kwargs.values()))):
            if host_buffers.contains(t):
                raise RuntimeError(
                    f"host tensor passed to sim kernel for op {op!r} (shape {tuple(t.shape)}, "
                    f"{t.dtype}): copy host buffers to the device through a transfer stream first")
        return fn(*args, **kwargs)

    return kernel


def sim_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(first half) * second half of the last dim."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def sim_kernels(device_name: str, host_buffers: HostBufferRegistry) -> list[Kernel]:
    kernels = [Kernel("silu_and_mul", "sim_silu_and_mul",
                      guarded("silu_and_mul", sim_silu_and_mul, host_buffers), device_name,
                      description="torch.nn.functional.silu on the chunked halves")]
    for op, fn in reference.REFERENCE_OPS.items():
        if op in MISSING_OPS:
            continue
        kernels.append(Kernel(op, "sim_reference", guarded(op, fn, host_buffers), device_name,
                              description="the reference op, refusing sim host buffers"))
    return kernels

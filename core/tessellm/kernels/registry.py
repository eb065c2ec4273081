"""The kernel registry: which kernels each device offers for each op.

Invariant: candidates are returned in registration order (a device's own kernels first, then
those added by other plugins), so `kernel_selection: first` is deterministic. A kernel is only a
candidate for a call when its `supports` predicate accepts the call's KernelQuery.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tessellm.errors import KernelError


@dataclass(slots=True, frozen=True)
class KernelQuery:
    """A concrete call site: the op, its dtype, the token-count bucket and the model dims
    (e.g. hidden, num_heads, num_kv_heads, head_dim, block_size) that fix the other shapes."""

    op: str
    dtype: torch.dtype
    num_tokens: int
    dims: tuple[tuple[str, int], ...] = ()

    def dim(self, name: str) -> int:
        return dict(self.dims)[name]

    @property
    def bucket_key(self) -> str:
        dims = ",".join(f"{k}={v}" for k, v in self.dims)
        return f"{self.op}|{str(self.dtype).removeprefix('torch.')}|T{self.num_tokens}|{dims}"


def _always(query: KernelQuery) -> bool:
    return True


@dataclass(slots=True, frozen=True)
class WeightLayout:
    """A kernel that reads its weight (argument 1) in a layout of its own. `prepare` turns a
    plain weight into it, once per weight: the profiler prepares its example weight before it
    checks and times the kernel; an execution-plan site prepares its weight the first time a
    bucket chooses the kernel, and drops the plain weight once every bucket it can meet uses
    the layout (tessellm.graph.lowering.adopt_weight_layouts), so memory is not doubled."""

    name: str
    prepare: Callable[[Any], Any]


@dataclass(slots=True, frozen=True)
class Kernel:
    """One implementation of an op on one device; `fn` has the op's reference signature
    (with the weight in `weight_layout`'s form when it has one)."""

    op: str
    name: str
    fn: Callable[..., Any]
    device: str
    supports: Callable[[KernelQuery], bool] = field(default=_always, compare=False)
    description: str = ""
    weight_layout: WeightLayout | None = field(default=None, compare=False)


class KernelRegistry:
    def __init__(self) -> None:
        self._kernels: dict[tuple[str, str], list[Kernel]] = {}

    def register(self, kernel: Kernel) -> None:
        bucket = self._kernels.setdefault((kernel.device, kernel.op), [])
        if any(k.name == kernel.name for k in bucket):
            raise KernelError(
                f"kernel {kernel.name!r} for op {kernel.op!r} on device {kernel.device!r} "
                "is registered twice")
        bucket.append(kernel)

    def kernels(self, device: str, op: str) -> list[Kernel]:
        return list(self._kernels.get((device, op), []))

    def has_op(self, device: str, op: str) -> bool:
        return bool(self._kernels.get((device, op)))

    def candidates(self, device: str, query: KernelQuery) -> list[Kernel]:
        return [k for k in self._kernels.get((device, query.op), []) if k.supports(query)]

    def ops(self, device: str) -> list[str]:
        return sorted(op for (dev, op) in self._kernels if dev == device)

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
class Kernel:
    """One implementation of an op on one device; `fn` has the op's reference signature."""

    op: str
    name: str
    fn: Callable[..., Any]
    device: str
    supports: Callable[[KernelQuery], bool] = field(default=_always, compare=False)
    description: str = ""


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

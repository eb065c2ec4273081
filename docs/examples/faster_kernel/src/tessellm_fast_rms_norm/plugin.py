"""One more rms_norm kernel for the existing `cpu` device (the tessellm_kernels hook).

It registers under its own name beside the device's kernels: the profiler checks it against
the reference op and ranks it with them, per token bucket; it is chosen only where it is the
fastest correct one (or where `kernel_selection: {rms_norm: rms_norm_functional}` forces it).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tessellm.plugin_api import Kernel, KernelQuery, hookimpl

TESSELLM_API_VERSION = "1.3"


def rms_norm_functional(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference signature (x, weight, eps): torch's one-call rms_norm over the last dim."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def float32_only(query: KernelQuery) -> bool:
    """In half precision torch normalizes in that precision, where the reference computes in
    float32: offer the kernel only where it agrees."""
    return query.dtype == torch.float32


@hookimpl
def tessellm_kernels() -> list[Kernel]:
    return [Kernel("rms_norm", "rms_norm_functional", rms_norm_functional, "cpu",
                   supports=float32_only,
                   description="torch.nn.functional.rms_norm (one fused call)")]

"""Sizing the KV pool from measured GPU memory (vLLM's rule): after the weights are loaded, a
profiling forward pass at the largest batch gives the activation peak; the pool may take

    utilization x total  -  (torch's allocated bytes + activation peak + memory outside torch)

where memory outside torch (the CUDA context, other processes) is total - free - reserved.
The peak is accounted in the allocator under "activations"."""
from __future__ import annotations

from typing import Any, Callable

import torch


def kv_budget_after_profile(device: Any, profile_forward: Callable[[], None],
                            utilization: float) -> int:
    dev = device.torch_device
    alloc = device.allocator()
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    profile_forward()
    torch.cuda.synchronize(dev)
    peak = max(0, torch.cuda.max_memory_allocated(dev) - before)
    torch.cuda.empty_cache()
    alloc.reserve(peak, "activations")
    free, total = torch.cuda.mem_get_info(dev)
    outside_torch = max(0, total - free - torch.cuda.memory_reserved(dev))
    in_use = torch.cuda.memory_allocated(dev) + peak + outside_torch
    return max(0, int(utilization * total) - in_use)

"""Device memory accounting on CUDA over torch's caching allocator.

Tensors come from torch's caching allocator (which keeps freed blocks cached for reuse, so
the driver's free memory is not what this allocator has left); this allocator counts them by tag ("weights",
"kv_cache", "input_buffers", ...) against a capacity: `utilization` x the device's total
memory. Transient activations are not allocated here: the engine measures their peak in a
profiling forward pass and reserves it under the tag "activations" (`reserve`), so the KV pool
is sized from what is really left.
"""
from __future__ import annotations

import torch

from tessellm.plugin_api import DeviceAllocator


class CudaAllocator(DeviceAllocator):
    def __init__(self, device: torch.device, capacity_bytes: int) -> None:
        super().__init__(device, capacity_bytes)
        self._reserved: dict[str, torch.Tensor] = {}

    def reserve(self, nbytes: int, tag: str) -> None:
        """Account `nbytes` under `tag` without a tensor of ours (memory torch's caching
        allocator holds for transient buffers); replaces an earlier reservation of the tag."""
        if tag in self._reserved:
            self.free(self._reserved.pop(tag))
        marker = torch.empty(0)   # identity only: the bytes live in torch's cache
        self._reserve(nbytes, tag)
        self._register(marker, tag, nbytes)
        self._reserved[tag] = marker

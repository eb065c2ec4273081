"""Device plugins with planted defects, for showing that the conformance kit catches them.

Each attribute is a plugin object (API version + hook implementations) reached by a fake entry
point "planted_plugins:<attribute>". Every device is host memory with the reference op as its
kernel for every op; each defective one differs from `good` in exactly one part.
"""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any, Callable

import torch

from tessellm.plugin_api import (
    AllocatorStats,
    Availability,
    CompletedEvent,
    DeviceAllocator,
    DevicePlugin,
    Event,
    Kernel,
    MemoryInfo,
    SynchronousStream,
    TransferStream,
    hookimpl,
    reference,
)

CAPACITY = 1 << 30
LIE_DELAY_S = 0.05


class PlantedDevice(DevicePlugin):
    torch_device_type = "cpu"

    def __init__(self, name: str, kernels: dict[str, Callable[..., Any]] | None = None,
                 allocator: DeviceAllocator | None = None,
                 stream: Callable[[], TransferStream] = SynchronousStream) -> None:
        self.name = name
        self._kernels = {**reference.REFERENCE_OPS, **(kernels or {})}
        self._allocator = allocator or DeviceAllocator("cpu", CAPACITY)
        self._stream = stream

    def is_available(self) -> Availability:
        return Availability(True, "")

    def memory_info(self) -> MemoryInfo:
        return MemoryInfo(CAPACITY, CAPACITY - self._allocator.stats().allocated_bytes)

    def allocator(self) -> DeviceAllocator:
        return self._allocator

    def new_stream(self) -> TransferStream:
        return self._stream()

    def kernels(self) -> list[Kernel]:
        return [Kernel(op, f"{self.name}_{op}", fn, self.name) for op, fn in self._kernels.items()]


def scaled_linear(x, weight, bias=None):
    """Off by a small factor: 0.1% too large."""
    return reference.linear(x, weight, bias) * 1.001


def attention_dropping_last_token(q, kv_cache, meta, scale):
    """Attends to every cached token but the sequence's last (for seq_len > 1)."""
    out = reference.paged_attention(q, kv_cache, meta, scale)
    num_kv_heads, head_dim = kv_cache.shape[2], kv_cache.shape[4]
    qsl = meta.query_start_loc.tolist()
    for i in range(meta.num_seqs):
        s, e, seq_len = qsl[i], qsl[i + 1], meta.seq_lens_host[i]
        if seq_len < 2 or e == s:
            continue
        k, v = reference.gather_kv(kv_cache, meta.block_tables[i], seq_len - 1, meta.block_size)
        qi = q[s:e].view(e - s, -1, head_dim).float()
        group = qi.shape[1] // num_kv_heads
        k = k.float().repeat_interleave(group, dim=1)
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        q_pos = torch.arange(seq_len - (e - s), seq_len).unsqueeze(1)
        scores = scores.masked_fill(torch.arange(seq_len - 1).unsqueeze(0) > q_pos, float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).flatten(1).to(q.dtype)
    return out


class LyingStream(TransferStream):
    """Copies on a thread after a delay, but hands out events that are already complete."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        def late() -> None:
            time.sleep(LIE_DELAY_S)
            dst.copy_(src)
        threading.Thread(target=late, daemon=True).start()
        return CompletedEvent()

    def record_event(self) -> Event:
        return CompletedEvent()


class NonAccountingAllocator(DeviceAllocator):
    """Hands out memory but never counts it (nor refuses it)."""

    def allocate(self, shape, dtype, tag):
        return torch.empty(tuple(shape), dtype=dtype)

    def adopt(self, tensor, tag):
        return tensor

    def free(self, tensor):
        return None

    def stats(self) -> AllocatorStats:
        return AllocatorStats(self.capacity_bytes, 0, 0, {})


def _plugin(device: DevicePlugin) -> SimpleNamespace:
    @hookimpl
    def tessellm_devices() -> list[DevicePlugin]:
        return [device]
    return SimpleNamespace(TESSELLM_API_VERSION="1.2", tessellm_devices=tessellm_devices)


good = _plugin(PlantedDevice("planted-good"))
scaled_kernel = _plugin(PlantedDevice("planted-scaled-linear", kernels={"linear": scaled_linear}))
drops_last_token = _plugin(PlantedDevice("planted-drops-last-token", kernels={
    "attention_decode": attention_dropping_last_token}))
lying_stream = _plugin(PlantedDevice("planted-lying-stream", stream=LyingStream))
no_accounting = _plugin(PlantedDevice("planted-no-accounting",
                                      allocator=NonAccountingAllocator("cpu", CAPACITY)))

ALL = ("good", "scaled_kernel", "drops_last_token", "lying_stream", "no_accounting")

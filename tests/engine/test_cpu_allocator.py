"""The CPU device commits the memory it allocates (a KV pool, the runner's buffers): pages are
written at allocation, not at the first step that touches them, and come back zeroed."""
from __future__ import annotations

import resource

import torch
from tessellm_cpu.device import CpuDevice


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def test_cpu_allocations_are_resident_and_zeroed() -> None:
    alloc = CpuDevice().allocator()
    size = 256 << 20
    before = _resident_bytes()
    pool = alloc.allocate((size // 2,), torch.bfloat16, tag="kv_cache")
    grown = _resident_bytes() - before
    # torch.empty of this size maps pages lazily (resident growth ~0); committed: all of it
    assert grown >= 0.9 * size, f"only {grown} of {size} bytes resident after allocate"
    assert not pool.any()
    assert alloc.stats().by_tag["kv_cache"] == size
    alloc.free(pool)

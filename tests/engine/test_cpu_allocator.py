"""The CPU device's memory (tessellm_cpu.host_memory): a large block (the KV pool) is a map
that reads as zeros and costs nothing at allocation; `commit_in_background` makes every page
resident from a thread without changing a byte, so data written before or during the commit
survives it; small blocks are plain zeroed tensors."""
from __future__ import annotations

import resource

import torch
from tessellm_cpu.device import CpuDevice
from tessellm_cpu.host_memory import LAZY_MIN_BYTES


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def test_a_large_block_is_mapped_lazily_then_committed_in_the_background() -> None:
    alloc = CpuDevice().allocator()
    size = 256 << 20
    before = _resident_bytes()
    pool = alloc.allocate((size // 2,), torch.bfloat16, tag="kv_cache")
    assert _resident_bytes() - before < 0.1 * size, "allocation committed the pages"
    assert alloc.stats().by_tag["kv_cache"] == size
    pool[:1000] = 1.5                      # a step wrote a block before the commit
    pool[-7:] = -2.0
    alloc.commit_in_background()
    pool[5000:5100] = 3.0                  # and one while it runs
    assert alloc.wait_committed(timeout_s=120)
    grown = _resident_bytes() - before
    assert grown >= 0.9 * size, f"only {grown} of {size} bytes resident after the commit"
    assert torch.equal(pool[:1000], torch.full((1000,), 1.5, dtype=torch.bfloat16))
    assert torch.equal(pool[-7:], torch.full((7,), -2.0, dtype=torch.bfloat16))
    assert torch.equal(pool[5000:5100], torch.full((100,), 3.0, dtype=torch.bfloat16))
    assert not pool[1000:5000].any() and not pool[5100:-7].any()
    alloc.free(pool)


def test_small_blocks_are_zeroed_tensors() -> None:
    alloc = CpuDevice().allocator()
    t = alloc.allocate((LAZY_MIN_BYTES // 8,), torch.float32, tag="input_buffers")
    assert t.shape == (LAZY_MIN_BYTES // 8,) and not t.any()
    assert alloc.wait_committed(timeout_s=1)   # nothing to commit
    alloc.free(t)

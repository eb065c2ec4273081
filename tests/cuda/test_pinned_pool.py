"""The chunked host pool of the CUDA plugin (run unpinned here: pinning needs a CUDA driver)."""
from __future__ import annotations

import pytest
import torch

from tessellm_cuda.pinned_pool import ALIGNMENT, PinnedHostPool


def test_buffers_are_aligned_distinct_and_typed() -> None:
    pool = PinnedHostPool(pin_memory=False, chunk_bytes=4096)
    a = pool.allocate((3,), torch.int64)
    b = pool.allocate((5, 7), torch.float32)
    c = pool.allocate((1,), torch.bfloat16)
    base = pool._chunks[0].data_ptr()
    for t in (a, b, c):
        assert (t.data_ptr() - base) % ALIGNMENT == 0
    assert (a.shape, a.dtype, b.shape, b.dtype) == ((3,), torch.int64, (5, 7), torch.float32)
    a.fill_(7), b.fill_(1.5), c.fill_(2)
    assert a.tolist() == [7] * 3 and float(b.sum()) == 1.5 * 35 and float(c) == 2


def test_chunks_are_taken_once_and_large_requests_get_their_own() -> None:
    pool = PinnedHostPool(pin_memory=False, chunk_bytes=1024)
    for _ in range(4):
        pool.allocate((64,), torch.uint8)       # 4 x 256 aligned bytes: one chunk
    assert pool.stats().chunks == 1
    big = pool.allocate((5000,), torch.uint8)   # larger than a chunk
    assert big.numel() == 5000
    s = pool.stats()
    assert s.chunks == 2 and s.buffers == 5 and not s.pinned
    assert s.used_bytes == 4 * 256 + 5120 and s.reserved_bytes == 1024 + 5120  # padding counts


def test_chunk_size_must_be_aligned() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        PinnedHostPool(pin_memory=False, chunk_bytes=1000)


def test_a_pinned_chunk_past_the_hosts_available_memory_is_refused(monkeypatch) -> None:
    """Checked before pinning (so it runs without a CUDA driver): page-locked memory cannot be
    paged out, so the pool refuses rather than exhausting the host."""
    from tessellm.plugin_api import MemoryInfo
    from tessellm_cuda import pinned_pool
    monkeypatch.setattr(pinned_pool, "host_memory_info",
                        lambda: MemoryInfo(total_bytes=1 << 30, free_bytes=1 << 20))
    pool = PinnedHostPool(pin_memory=True, chunk_bytes=4096)
    with pytest.raises(MemoryError, match="num_host_kv_blocks"):
        pool.allocate((1 << 19,), torch.float32)    # 2 MiB
    assert pool.stats().chunks == 0

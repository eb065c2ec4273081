"""The sim device's own behaviour: arena allocator, poisoning streams, guarded kernels."""
from __future__ import annotations

import ast
import gc
import threading
import time
from pathlib import Path

import pytest
import torch

from tessellm.kernels.attention_metadata import AttentionMetadata
from tessellm_sim import plugin
from tessellm_sim.allocator import ALIGNMENT, SimAllocator
from tessellm_sim.device import DELAY_ENV, MEMORY_ENV, SimDevice
from tessellm_sim.stream import SimStream, poison

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "src" / "tessellm_sim"


# -- allocator -----------------------------------------------------------------------------

def test_allocations_are_views_into_the_arena() -> None:
    alloc = SimAllocator(1 << 16, chunk_bytes=4096)
    a = alloc.allocate((10,), torch.float32, "a")
    b = alloc.allocate((3, 3), torch.int64, "b")
    assert alloc.owns(a) and alloc.owns(b) and alloc.owns(b[1:, 1:])
    assert not alloc.owns(torch.empty(10)) and not alloc.owns(torch.empty(0))
    assert b.data_ptr() - a.data_ptr() == ALIGNMENT  # 40 bytes padded to one alignment unit
    assert alloc.stats().allocated_bytes == 40 + 72 and alloc.reserved_bytes == 4096


def test_freed_ranges_coalesce_and_are_reused() -> None:
    alloc = SimAllocator(1 << 16, chunk_bytes=4096)
    a, b, c = (alloc.allocate((ALIGNMENT,), torch.uint8, t) for t in "abc")
    alloc.free(b)
    alloc.free(a)
    ab = alloc.allocate((2 * ALIGNMENT,), torch.uint8, "ab")  # fits only if a and b merged
    assert ab.data_ptr() == a.data_ptr()
    alloc.free(ab)
    alloc.free(c)
    assert alloc.stats().allocated_bytes == 0


def test_arena_grows_by_chunks_and_releases_empty_ones() -> None:
    alloc = SimAllocator(1 << 20, chunk_bytes=4096)
    first = alloc.allocate((4096,), torch.uint8, "first")
    big = alloc.allocate((10000,), torch.uint8, "big")  # larger than a chunk: a chunk of its own
    assert alloc.reserved_bytes == 4096 + 10240 and alloc.owns(big)
    alloc.free(big)
    assert alloc.reserved_bytes == 4096
    alloc.free(first)
    assert alloc.reserved_bytes == 4096  # the first chunk is kept


def test_adopt_accepts_arena_views_only() -> None:
    alloc = SimAllocator(1 << 16, chunk_bytes=4096)
    base = alloc.allocate((64,), torch.float32, "base")
    with pytest.raises(ValueError, match="upload"):
        alloc.adopt(torch.zeros(4), "host")
    view = alloc.adopt(base[:16], "view")
    assert alloc.stats().by_tag == {"base": 256, "view": 64}
    alloc.free(view)  # releases accounting only, not the base block
    again = alloc.allocate((64,), torch.float32, "again")
    assert again.data_ptr() != base.data_ptr()


def test_capacity_and_delay_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MEMORY_ENV, "12345")
    monkeypatch.setenv(DELAY_ENV, "0")
    dev = SimDevice()
    assert dev.is_available().available
    assert dev.memory_info().total_bytes == 12345
    monkeypatch.setenv(MEMORY_ENV, "lots")
    availability = SimDevice().is_available()
    assert not availability.available and MEMORY_ENV in availability.reason
    monkeypatch.setenv(MEMORY_ENV, "100")
    monkeypatch.setenv(DELAY_ENV, "-1")
    assert DELAY_ENV in SimDevice().is_available().reason


# -- streams -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,value", [
    (torch.float32, None), (torch.bfloat16, None), (torch.int32, -(2 ** 31)),
    (torch.int64, -(2 ** 63)), (torch.uint8, 255), (torch.bool, True),
])
def test_poison_values(dtype: torch.dtype, value: object) -> None:
    t = torch.zeros(4, dtype=dtype)
    poison(t)
    if value is None:
        assert torch.isnan(t.float()).all()
    else:
        assert t.tolist() == [value] * 4


def test_copy_checks_shapes_synchronously() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        SimStream(0.0).copy(torch.empty(3), torch.empty(4))


def test_copy_failure_surfaces_at_wait() -> None:
    event = SimStream(0.0).copy(torch.empty(3), torch.empty(3, device="meta"))
    with pytest.raises(RuntimeError, match="sim transfer failed"):
        event.wait()


def test_device_synchronize_drains_every_stream() -> None:
    dev = SimDevice(capacity_bytes=1 << 20, copy_delay_s=0.05)
    dsts = [torch.empty(4) for _ in range(3)]
    events = [dev.new_stream().copy(d, torch.ones(4)) for d in dsts]
    dev.synchronize()
    assert all(e.query() for e in events) and all(d.tolist() == [1.0] * 4 for d in dsts)


def test_stream_worker_ends_with_the_stream() -> None:
    stream = SimStream(0.0)
    thread = stream._thread
    stream.copy(torch.empty(2), torch.ones(2)).wait()
    del stream
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_upload_waits_for_its_own_stream() -> None:
    dev = SimDevice(capacity_bytes=1 << 20, copy_delay_s=0.05)
    host = torch.arange(12, dtype=torch.float32).view(3, 4)
    start = time.monotonic()
    up = dev.upload(host, "w")
    assert time.monotonic() - start >= 0.05
    assert dev.allocator().owns(up) and torch.equal(up, host)
    assert threading.active_count() >= 2


# -- kernels -------------------------------------------------------------------------------

def test_kernel_set() -> None:
    kernels = SimDevice().kernels()
    by_op: dict[str, list[str]] = {}
    for k in kernels:
        by_op.setdefault(k.op, []).append(k.name)
    assert by_op["silu_and_mul"] == ["sim_silu_and_mul", "sim_reference"]
    assert "fused_add_rms_norm" not in by_op and "rms_norm" in by_op and "add" in by_op


def test_kernels_refuse_host_staging_buffers() -> None:
    dev = SimDevice(capacity_bytes=1 << 20, copy_delay_s=0.0)
    add = next(k for k in dev.kernels() if k.op == "add").fn
    staging = dev.host_allocator().allocate((2, 4), torch.float32)
    staging.fill_(1.0)
    on_device = dev.upload(staging, "x")
    assert torch.equal(add(on_device, on_device), torch.full((2, 4), 2.0))
    with pytest.raises(RuntimeError, match="host tensor passed to sim kernel for op 'add'"):
        add(on_device, staging)
    with pytest.raises(RuntimeError, match="host tensor"):
        add(on_device, b=staging[1])  # a view, passed by keyword
    del staging
    gc.collect()
    assert len(dev.host_buffers) == 0


def test_kernels_look_inside_attention_metadata() -> None:
    dev = SimDevice(capacity_bytes=1 << 20, copy_delay_s=0.0)
    attn = next(k for k in dev.kernels() if k.op == "attention_decode").fn
    slots = dev.host_allocator().allocate((1,), torch.int64)
    meta = AttentionMetadata(
        num_decodes=1, num_prefills=0, num_decode_tokens=1, num_prefill_tokens=0, block_size=4,
        slot_mapping=slots, block_tables=torch.zeros(1, 1, dtype=torch.int32),
        seq_lens=torch.ones(1, dtype=torch.int32), query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens_host=[1], query_lens_host=[1], max_seq_len=1, max_query_len=1)
    with pytest.raises(RuntimeError, match="attention_decode"):
        attn(torch.zeros(1, 8), torch.zeros(2, 1, 4, 1, 8), meta, 1.0)


def test_sim_silu_and_mul_matches_reference() -> None:
    from tessellm.kernels.reference import silu_and_mul
    from tessellm_sim.kernels import sim_silu_and_mul
    x = torch.randn(3, 10, dtype=torch.float64)
    torch.testing.assert_close(sim_silu_and_mul(x), silu_and_mul(x))


# -- packaging -----------------------------------------------------------------------------

def test_plugin_imports_tessellm_only_through_the_plugin_api() -> None:
    assert plugin.TESSELLM_API_VERSION == "1.0"
    for path in PACKAGE_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                if name == "tessellm" or name.startswith("tessellm."):
                    assert name == "tessellm.plugin_api", f"{path.name} imports {name}"

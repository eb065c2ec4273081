"""Conformance suite every device plugin must pass: allocator accounting, transfer-stream
ordering, upload, memory info and kernels against the reference ops.

Devices come from the installed plugins (PluginManager over the real entry points). The cpu
device is skipped, with the reason, only when its plugin fails to load; sim must be installed
(`pip install -e tests/plugins/tessellm_sim`).
"""
from __future__ import annotations

import os
from typing import Callable

import pytest
import torch

from tessellm.device import DeviceAllocator, DevicePlugin, Event
from tessellm.errors import DeviceUnavailableError
from tessellm.kernels import reference
from tessellm.plugins import PluginManager

# scripts/gpu_check.sh sets TESSELLM_TEST_DEVICES=cuda on a GPU machine
DEVICE_NAMES = os.environ.get("TESSELLM_TEST_DEVICES", "cpu,sim,triton-interpret").split(",")
ELEMENTWISE_OPS = {"add": 2, "mul": 2, "silu": 1, "silu_and_mul": 1, "gelu_tanh": 1}  # op -> inputs


def _small_allocator(name: str) -> Callable[[int], DeviceAllocator]:
    """A fresh allocator of the device's kind with a small capacity."""
    if name == "sim":
        from tessellm_sim.allocator import SimAllocator
        return SimAllocator
    if name == "xla":
        import torch_xla
        return lambda capacity: DeviceAllocator(torch_xla.device(), capacity)
    if name == "cuda":
        from tessellm_cuda.allocator import CudaAllocator
        return lambda capacity: CudaAllocator(torch.device("cuda"), capacity)
    return lambda capacity: DeviceAllocator("cpu", capacity)


@pytest.fixture(scope="module")
def manager() -> PluginManager:
    return PluginManager().load()


@pytest.fixture(params=DEVICE_NAMES)
def device(request: pytest.FixtureRequest, manager: PluginManager) -> DevicePlugin:
    name = request.param
    if name not in manager.devices():
        why = "; ".join(f"{r.name}: [{r.status}] {r.error}" for r in manager.records
                        if r.status != "loaded") or "no plugin provides it"
        if name == "cpu":
            print(f"cpu plugin did not load: {why}")
            pytest.skip(f"cpu plugin did not load: {why}")
        pytest.fail(f"device {name!r} missing ({why}); install: pip install -e tests/plugins/tessellm_sim")
    return manager.select_device(name)


def _poisoned(t: torch.Tensor) -> bool:
    if t.dtype.is_floating_point:
        return bool(torch.isnan(t).all())
    return bool((t == torch.iinfo(t.dtype).min).all())


# -- allocator ---------------------------------------------------------------------------

def test_allocator_is_one_object(device: DevicePlugin) -> None:
    assert device.allocator() is device.allocator()


def test_allocate_and_free_update_accounting(device: DevicePlugin) -> None:
    alloc = device.allocator()
    before = alloc.stats()
    a = alloc.allocate((4, 8), torch.float32, "conformance_a")
    b = alloc.allocate((16,), torch.int64, "conformance_b")
    assert a.shape == (4, 8) and a.dtype == torch.float32 and b.dtype == torch.int64
    assert a.device.type == device.torch_device_type
    stats = alloc.stats()
    assert stats.allocated_bytes == before.allocated_bytes + 128 + 128
    assert stats.by_tag["conformance_a"] == 128 and stats.by_tag["conformance_b"] == 128
    assert stats.peak_bytes >= stats.allocated_bytes
    alloc.free(a)
    assert alloc.stats().allocated_bytes == before.allocated_bytes + 128
    assert "conformance_a" not in alloc.stats().by_tag
    alloc.free(b)
    assert alloc.stats().allocated_bytes == before.allocated_bytes


def test_allocation_over_capacity_is_refused(device: DevicePlugin) -> None:
    alloc = device.allocator()
    with pytest.raises(DeviceUnavailableError, match="too_big"):
        alloc.allocate((alloc.capacity_bytes + 1,), torch.uint8, "too_big")

    small = _small_allocator(device.name)(4096)
    x = small.allocate((1000,), torch.float32, "fill")  # 4000 bytes
    with pytest.raises(DeviceUnavailableError, match="overflow"):
        small.allocate((25,), torch.float32, "overflow")
    assert small.stats().allocated_bytes == 4000 and small.free_bytes == 96
    y = small.allocate((24,), torch.float32, "exact")  # fits exactly
    small.free(x)
    small.free(y)
    assert small.stats().allocated_bytes == 0 and small.stats().peak_bytes == 4096


def test_host_allocator_gives_host_tensors(device: DevicePlugin) -> None:
    t = device.host_allocator().allocate((3, 5), torch.float16)
    assert t.shape == (3, 5) and t.dtype == torch.float16 and t.device.type == "cpu"


# -- streams -----------------------------------------------------------------------------

def test_copy_then_wait_gives_the_data(device: DevicePlugin) -> None:
    alloc, stream = device.allocator(), device.new_stream()
    host = device.host_allocator().allocate((64,), torch.float32)
    host.copy_(torch.arange(64, dtype=torch.float32))
    dst = alloc.allocate((64,), torch.float32, "conformance_copy")
    event = stream.copy(dst, host)
    assert isinstance(event, Event)
    event.wait()
    assert event.query()
    torch.testing.assert_close(dst.cpu(), torch.arange(64, dtype=torch.float32))
    back = device.host_allocator().allocate((64,), torch.float32)
    stream.copy(back, dst).wait()
    torch.testing.assert_close(back, host)
    alloc.free(dst)


def test_record_event_waits_for_every_earlier_copy(device: DevicePlugin) -> None:
    alloc, stream = device.allocator(), device.new_stream()
    sources = [torch.full((32,), float(i)) for i in range(5)]
    dsts = [alloc.allocate((32,), torch.float32, "conformance_record") for _ in sources]
    events = [stream.copy(d, s) for d, s in zip(dsts, sources)]
    stream.record_event().wait()
    assert all(e.query() for e in events)
    for d, s in zip(dsts, sources):
        torch.testing.assert_close(d.cpu(), s.cpu())
        alloc.free(d)


def test_synchronize_drains_streams(device: DevicePlugin) -> None:
    alloc, stream = device.allocator(), device.new_stream()
    dst = alloc.allocate((16,), torch.int32, "conformance_sync")
    event = stream.copy(dst, torch.arange(16, dtype=torch.int32))
    device.synchronize()
    assert event.query()
    assert dst.tolist() == list(range(16))
    alloc.free(dst)


def test_sim_poisons_a_copy_destination_until_the_event(manager: PluginManager) -> None:
    """Specific to sim, whose streams are asynchronous: a read before the wait sees poison."""
    sim_type = type(manager.select_device("sim"))
    slow = sim_type(capacity_bytes=1 << 20, copy_delay_s=0.3)
    stream, alloc = slow.new_stream(), slow.allocator()
    floats = alloc.allocate((8,), torch.float32, "poison_f")
    ints = alloc.allocate((8,), torch.int64, "poison_i")
    ev_f = stream.copy(floats, torch.ones(8))
    ev_i = stream.copy(ints, torch.arange(8))
    assert _poisoned(floats) and _poisoned(ints)  # read before the wait: poison, not data
    assert not ev_i.query()
    stream.record_event().wait()
    assert ev_f.query() and ev_i.query()
    assert floats.tolist() == [1.0] * 8 and ints.tolist() == list(range(8))


# -- upload and memory info ----------------------------------------------------------------

def test_upload_returns_equal_data_accounted_under_its_tag(device: DevicePlugin) -> None:
    alloc = device.allocator()
    before = alloc.stats().allocated_bytes
    host = torch.randn(8, 16)
    up = device.upload(host, "conformance_weights")
    torch.testing.assert_close(up.cpu(), host)
    assert alloc.stats().by_tag["conformance_weights"] == host.numel() * 4
    alloc.free(up)
    assert alloc.stats().allocated_bytes == before


def test_memory_info_is_sane(device: DevicePlugin) -> None:
    info = device.memory_info()
    assert info.total_bytes > 0 and 0 <= info.free_bytes <= info.total_bytes
    if device.name == "sim":
        alloc = device.allocator()
        assert info.total_bytes == alloc.capacity_bytes
        assert info.free_bytes == alloc.capacity_bytes - alloc.stats().allocated_bytes


# -- kernels -------------------------------------------------------------------------------

def test_kernels_are_for_known_ops_on_this_device(device: DevicePlugin, manager: PluginManager) -> None:
    registry = manager.kernel_registry()
    ops = registry.ops(device.name)
    assert ops, f"device {device.name!r} registers no kernels"
    assert set(ops) <= set(reference.REFERENCE_OPS)
    for op in ops:
        assert all(k.device == device.name and k.op == op for k in registry.kernels(device.name, op))


def test_elementwise_kernels_match_the_reference(device: DevicePlugin, manager: PluginManager) -> None:
    registry = manager.kernel_registry()
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for op, arity in ELEMENTWISE_OPS.items():
        ref = reference.REFERENCE_OPS[op]
        for kernel in registry.kernels(device.name, op):
            hosts = [torch.randn(4, 8, generator=gen) for _ in range(arity)]
            inputs = [device.upload(h, "conformance_kernel_input") for h in hosts]
            try:
                torch.testing.assert_close(kernel.fn(*inputs).cpu(), ref(*hosts), msg=lambda m: f"{kernel.name}: {m}")
            finally:
                for t in inputs:
                    device.allocator().free(t)
            checked += 1
    assert checked > 0

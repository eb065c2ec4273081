"""What the kit cannot check through the device contract alone: allocators of a small
capacity built by their own constructors (exact fit, peak), and sim's poisoning of copy
destinations until their events."""
from __future__ import annotations

import os
from typing import Callable

import pytest
import torch

from tessellm.device import DeviceAllocator
from tessellm.errors import DeviceUnavailableError
from tessellm.plugins import PluginManager

DEVICE_NAMES = os.environ.get("TESSELLM_TEST_DEVICES", "cpu,sim,triton-interpret").split(",")


def _small_allocator(name: str) -> Callable[[int], DeviceAllocator]:
    """A fresh allocator of the device's kind with a small capacity."""
    if name == "sim":
        from tessellm_sim.allocator import SimAllocator
        return SimAllocator
    if name == "xla":
        import torch_xla
        return lambda capacity: DeviceAllocator(torch_xla.device(), capacity)
    if name == "cuda":
        return lambda capacity: DeviceAllocator(torch.device("cuda"), capacity)
    return lambda capacity: DeviceAllocator("cpu", capacity)


@pytest.mark.parametrize("name", DEVICE_NAMES)
def test_small_allocator_refuses_past_capacity_and_fits_exactly(name: str) -> None:
    small = _small_allocator(name)(4096)
    x = small.allocate((1000,), torch.float32, "fill")  # 4000 bytes
    with pytest.raises(DeviceUnavailableError, match="overflow"):
        small.allocate((25,), torch.float32, "overflow")
    assert small.stats().allocated_bytes == 4000 and small.free_bytes == 96
    y = small.allocate((24,), torch.float32, "exact")  # fits exactly
    small.free(x)
    small.free(y)
    assert small.stats().allocated_bytes == 0 and small.stats().peak_bytes == 4096


def _poisoned(t: torch.Tensor) -> bool:
    if t.dtype.is_floating_point:
        return bool(torch.isnan(t).all())
    return bool((t == torch.iinfo(t.dtype).min).all())


def test_sim_poisons_a_copy_destination_until_the_event() -> None:
    """sim's streams are asynchronous: a read before the wait sees poison, not data."""
    sim_type = type(PluginManager().load().select_device("sim"))
    slow = sim_type(capacity_bytes=1 << 20, copy_delay_s=0.3)
    stream, alloc = slow.new_stream(), slow.allocator()
    floats = alloc.allocate((8,), torch.float32, "poison_f")
    ints = alloc.allocate((8,), torch.int64, "poison_i")
    ev_f = stream.copy(floats, torch.ones(8))
    ev_i = stream.copy(ints, torch.arange(8))
    assert _poisoned(floats) and _poisoned(ints)
    assert not ev_i.query()
    stream.record_event().wait()
    assert ev_f.query() and ev_i.query()
    assert floats.tolist() == [1.0] * 8 and ints.tolist() == list(range(8))


def test_sim_memory_info_is_its_arena() -> None:
    sim = PluginManager().load().select_device("sim")
    info, alloc = sim.memory_info(), sim.allocator()
    assert info.total_bytes == alloc.capacity_bytes
    assert info.free_bytes == alloc.capacity_bytes - alloc.stats().allocated_bytes

"""Checks of a device's availability answer, memory info, allocator and host allocator.

Each check returns its pass detail or raises CheckFailed with what was wrong. They allocate
only a few KiB under tags of their own ("conformance_*") and free everything they allocate,
so they can run on a device an engine is using.
"""
from __future__ import annotations

import torch

from tessellm.device import Availability, DevicePlugin
from tessellm.errors import DeviceUnavailableError
from tessellm.testing.kernel_checks import CheckFailed


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def check_availability(device: DevicePlugin) -> str:
    a = device.is_available()
    _require(isinstance(a, Availability),
             f"is_available() returned {type(a).__name__}, not an Availability")
    _require(isinstance(a.reason, str), f"is_available().reason is {type(a.reason).__name__}")
    if not a.available:
        _require(bool(a.reason.strip()), "unavailable without a reason")
        raise CheckFailed(f"device is not available: {a.reason}")
    return "available" + (f" ({a.reason})" if a.reason else "")


def check_memory_info(device: DevicePlugin) -> str:
    info = device.memory_info()
    _require(info.total_bytes > 0, f"total_bytes {info.total_bytes} is not positive")
    _require(0 <= info.free_bytes <= info.total_bytes,
             f"free_bytes {info.free_bytes} is outside [0, total {info.total_bytes}]")
    return f"{info.free_bytes / 2**30:.2f} of {info.total_bytes / 2**30:.2f} GiB free"


def check_allocator_accounting(device: DevicePlugin) -> str:
    """allocate -> counted under its tag (exact bytes), peak >= allocated, free -> uncounted."""
    alloc = device.allocator()
    _require(alloc is device.allocator(), "allocator() returns a new object on each call")
    before = alloc.stats()
    a = alloc.allocate((4, 8), torch.float32, "conformance_a")
    b = alloc.allocate((16,), torch.int64, "conformance_b")
    try:
        _require(tuple(a.shape) == (4, 8) and a.dtype == torch.float32,
                 f"allocate((4, 8), float32) gave {tuple(a.shape)} {a.dtype}")
        _require(b.dtype == torch.int64, f"allocate(int64) gave {b.dtype}")
        _require(a.device.type == device.torch_device_type,
                 f"allocation on {a.device}, the device says {device.torch_device_type!r}")
        s = alloc.stats()
        _require(s.allocated_bytes == before.allocated_bytes + 256,
                 f"allocated_bytes went {before.allocated_bytes} -> {s.allocated_bytes} for "
                 "256 bytes allocated")
        for tag in ("conformance_a", "conformance_b"):
            _require(s.by_tag.get(tag, 0) - before.by_tag.get(tag, 0) == 128,
                     f"by_tag[{tag!r}] is {s.by_tag.get(tag)} after allocating 128 bytes")
        _require(s.peak_bytes >= s.allocated_bytes,
                 f"peak_bytes {s.peak_bytes} < allocated_bytes {s.allocated_bytes}")
    finally:
        alloc.free(a)
        mid = alloc.stats()
        alloc.free(b)
    _require(mid.allocated_bytes == before.allocated_bytes + 128,
             f"freeing 128 bytes left allocated_bytes at {mid.allocated_bytes} "
             f"(expected {before.allocated_bytes + 128})")
    after = alloc.stats()
    _require(after.allocated_bytes == before.allocated_bytes,
             f"after freeing everything allocated_bytes is {after.allocated_bytes}, "
             f"was {before.allocated_bytes}")
    _require(after.by_tag.get("conformance_a", 0) == before.by_tag.get("conformance_a", 0),
             "a freed allocation is still counted under its tag")
    return "allocate/free counted exactly under their tags"


def check_allocator_capacity(device: DevicePlugin) -> str:
    """An allocation past the free capacity is refused with DeviceUnavailableError naming its
    tag, before any memory is taken: the accounting is unchanged afterwards."""
    alloc = device.allocator()
    before = alloc.stats()
    _require(before.capacity_bytes >= before.allocated_bytes,
             f"allocated_bytes {before.allocated_bytes} exceeds capacity {before.capacity_bytes}")
    over = before.capacity_bytes - before.allocated_bytes + 1
    try:
        t = alloc.allocate((over,), torch.uint8, "conformance_over_capacity")
    except DeviceUnavailableError as exc:
        _require("conformance_over_capacity" in str(exc),
                 f"the refusal does not name the tag: {exc}")
    except Exception as exc:
        raise CheckFailed(f"over capacity raised {type(exc).__name__} (not "
                          f"DeviceUnavailableError): {exc}") from exc
    else:
        alloc.free(t)
        raise CheckFailed(f"allocating {over} bytes with {before.capacity_bytes - before.allocated_bytes} "
                          "free was not refused")
    after = alloc.stats()
    _require(after.allocated_bytes == before.allocated_bytes,
             f"a refused allocation changed allocated_bytes {before.allocated_bytes} -> "
             f"{after.allocated_bytes}")
    return f"{over} bytes past {before.capacity_bytes - before.allocated_bytes} free: refused"


def check_upload(device: DevicePlugin) -> str:
    alloc = device.allocator()
    before = alloc.stats()
    host = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    up = device.upload(host, "conformance_upload")
    try:
        _require(up.device.type == device.torch_device_type,
                 f"upload() gave a tensor on {up.device}")
        _require(torch.equal(up.cpu(), host), "upload() data differs from the host tensor")
        counted = alloc.stats().by_tag.get("conformance_upload", 0)
        _require(counted == host.numel() * 4, f"upload counted {counted} bytes under its tag, "
                 f"not {host.numel() * 4}")
    finally:
        alloc.free(up)
    _require(alloc.stats().allocated_bytes == before.allocated_bytes,
             "freeing the upload did not restore allocated_bytes")
    return "equal data, counted under its tag"


def check_host_allocator(device: DevicePlugin) -> str:
    host = device.host_allocator()
    t = host.allocate((3, 5), torch.float16)
    _require(tuple(t.shape) == (3, 5) and t.dtype == torch.float16,
             f"allocate((3, 5), float16) gave {tuple(t.shape)} {t.dtype}")
    _require(t.device.type == "cpu", f"host buffer on {t.device}, not the host")
    t.copy_(torch.arange(15, dtype=torch.float16).view(3, 5))   # writable host memory
    _require(t.flatten().tolist() == list(range(15)), "host buffer does not hold what was written")
    pinned = bool(getattr(host, "pin_memory", False))
    if pinned:
        _require(t.is_pinned(), "the host allocator says pin_memory but its buffer is not pinned")
    return "host buffers" + (" (pinned)" if pinned else "")

"""Checks of transfer streams and events: a copy is visible once its event has completed, and
the checks never read a destination before then.

Every destination is first filled with a sentinel unlike the data (on the device, and waited
for with `synchronize()`), so a stream whose event completes before the copy has landed is
seen: its reader finds the sentinel (or the poison of a stream that poisons), not the data.
The copies are large enough (1 MiB) that an asynchronous copy is still in flight when a lying
event answers.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tessellm.device import DevicePlugin, Event, TransferStream
from tessellm.testing.kernel_checks import CheckFailed

NUMEL = 1 << 18                 # float32 elements per copy: 1 MiB
SENTINEL = -7.0
QUERY_TIMEOUT_S = 30.0


def _data(seed: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))


def _device_buffer(device: DevicePlugin, tag: str) -> torch.Tensor:
    t = device.allocator().allocate((NUMEL,), torch.float32, tag)
    t.fill_(SENTINEL)
    device.synchronize()
    return t


def _host_buffer(device: DevicePlugin, src: torch.Tensor) -> torch.Tensor:
    h = device.host_allocator().allocate((NUMEL,), torch.float32)
    h.copy_(src)
    return h


def _landed(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if not torch.equal(got.cpu(), want):
        stale = int((got.cpu() == SENTINEL).sum())
        raise CheckFailed(f"{what}: the data had not landed ({stale} of {NUMEL} elements still "
                          "the sentinel, others differ): the event completed before the copy")


def _event(e: object, what: str) -> Event:
    if not isinstance(e, Event):
        raise CheckFailed(f"{what} returned {type(e).__name__}, not an Event")
    return e


@contextmanager
def _one_copy(device: DevicePlugin, seed: int, tag: str
              ) -> Iterator[tuple[TransferStream, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(stream, host source, sentinel-filled device destination, the data), the destination
    freed afterwards."""
    want = _data(seed)
    src = _host_buffer(device, want)
    dst = _device_buffer(device, tag)
    try:
        yield device.new_stream(), src, dst, want
    finally:
        device.allocator().free(dst)


def check_copy_event(device: DevicePlugin) -> str:
    """host -> device and back: each destination equals its source right after event.wait(),
    and the event's query() is True then."""
    with _one_copy(device, 1, "conformance_stream") as (stream, src, dst, want):
        ev = _event(stream.copy(dst, src), "copy()")
        ev.wait()
        _landed("host -> device after wait()", dst, want)
        if not ev.query():
            raise CheckFailed("query() is False after wait() returned")
        back = device.host_allocator().allocate((NUMEL,), torch.float32)
        back.fill_(SENTINEL)
        _event(stream.copy(back, dst), "copy()").wait()
        _landed("device -> host after wait()", back, want)
    return "host->device and device->host copies complete at their events"


def check_record_event(device: DevicePlugin) -> str:
    """record_event() completes after every copy enqueued before it."""
    stream, alloc = device.new_stream(), device.allocator()
    wants = [_data(10 + i) for i in range(4)]
    srcs = [_host_buffer(device, w) for w in wants]
    dsts = [_device_buffer(device, "conformance_record") for _ in wants]
    try:
        events = [_event(stream.copy(d, s), "copy()") for d, s in zip(dsts, srcs)]
        _event(stream.record_event(), "record_event()").wait()
        for i, (d, w) in enumerate(zip(dsts, wants)):
            _landed(f"copy {i} after record_event().wait()", d, w)
        if not all(e.query() for e in events):
            raise CheckFailed("an earlier copy's query() is False after a later record_event() "
                              "completed")
    finally:
        for d in dsts:
            alloc.free(d)
    return "an event completes after every earlier copy"


def check_query(device: DevicePlugin) -> str:
    """Polling query() until True (never wait()) must also mean the data is there."""
    with _one_copy(device, 20, "conformance_query") as (stream, src, dst, want):
        ev = _event(stream.copy(dst, src), "copy()")
        deadline = time.monotonic() + QUERY_TIMEOUT_S
        while not ev.query():
            if time.monotonic() > deadline:
                raise CheckFailed(f"query() still False after {QUERY_TIMEOUT_S:.0f} s")
            time.sleep(0.001)
        _landed("once query() is True", dst, want)
    return "query() turns True only once the data is there"


def check_synchronize(device: DevicePlugin) -> str:
    """device.synchronize() drains every stream of the device."""
    with _one_copy(device, 30, "conformance_sync") as (stream, src, dst, want):
        ev = _event(stream.copy(dst, src), "copy()")
        device.synchronize()
        if not ev.query():
            raise CheckFailed("a copy's event is incomplete after device.synchronize()")
        _landed("after device.synchronize()", dst, want)
    return "synchronize() waits for copies in flight"


def check_wait_on_compute(device: DevicePlugin) -> str:
    """After wait_on_compute(event), device work reads the copied data (the engine's order)."""
    with _one_copy(device, 40, "conformance_compute") as (stream, src, dst, want):
        device.wait_on_compute(_event(stream.copy(dst, src), "copy()"))
        doubled = dst * 2          # device compute ordered after the copy
        _landed("compute after wait_on_compute()", doubled / 2, want)
    return "compute ordered after wait_on_compute(event) sees the data"

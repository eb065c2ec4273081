"""Asynchronous transfer streams of the sim device, built to expose missed waits.

Each SimStream owns a FIFO queue and one daemon worker thread. `copy(dst, src)`:
  1. checks the shapes (an error is raised here, not lost on the worker),
  2. poisons `dst` synchronously (see `poison`), so a reader that skips the wait sees garbage
     that fails loudly (NaN logits, out-of-range token ids / slots), never plausible stale data,
  3. enqueues the copy and returns its SimEvent.
The worker takes items in order: sleeps the copy delay, does `dst.copy_(src)`, sets the event.
`record_event()` enqueues a marker, so its event completes after every copy queued before it.
Streams of one device share an InFlight counter, which `SimDevice.synchronize` waits on.
The worker ends when the stream object is collected (a finalizer enqueues a stop marker after
the pending copies).
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
import weakref
from typing import Any

import torch

from tessellm.plugin_api import Event, TransferStream

_STOP = object()
_stream_ids = itertools.count()


def poison(t: torch.Tensor) -> None:
    """Fill `t` with a value no correct computation produces: NaN for floating and complex
    dtypes, the minimum of signed integers, the maximum of unsigned ones, True for bool."""
    if t.numel() == 0:
        return
    dtype = t.dtype
    if dtype == torch.bool:
        t.fill_(True)
    elif dtype.is_floating_point or dtype.is_complex:
        try:
            t.fill_(float("nan"))
        except RuntimeError:  # a float8 format without NaN
            t.fill_(torch.finfo(dtype).max)
    else:
        info = torch.iinfo(dtype)
        t.fill_(info.min if info.min < 0 else info.max)


class SimEvent(Event):
    """Set by the stream's worker once every operation queued before it has completed."""

    __slots__ = ("_done", "_error")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise RuntimeError(f"sim transfer failed: {type(self._error).__name__}: {self._error}") \
                from self._error

    def query(self) -> bool:
        return self._done.is_set()

    def _complete(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()


class InFlight:
    """Counts copies enqueued but not yet completed across a device's streams, so the device
    can drain them all, including those of streams already dropped by their owner."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._count = 0

    def add(self) -> None:
        with self._cond:
            self._count += 1

    def done(self) -> None:
        with self._cond:
            self._count -= 1
            if self._count == 0:
                self._cond.notify_all()

    def wait_idle(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._count == 0)


def _worker(q: "queue.SimpleQueue[Any]", delay_s: float, in_flight: InFlight) -> None:
    while True:
        item = q.get()
        if item is _STOP:
            return
        dst, src, event = item
        del item
        if dst is None:
            event._complete()
            continue
        try:
            if delay_s > 0:
                time.sleep(delay_s)
            dst.copy_(src)
        except Exception as exc:  # reported to whoever waits on the event
            event._complete(exc)
        else:
            event._complete()
        finally:
            in_flight.done()
        # Drop the tensors now: an idle worker must not keep a staging buffer alive.
        del dst, src, event


class SimStream(TransferStream):
    """An ordered copy queue served by one worker thread (see the module docstring)."""

    def __init__(self, delay_s: float, in_flight: InFlight | None = None) -> None:
        if delay_s < 0:
            raise ValueError(f"sim copy delay must be >= 0, got {delay_s}")
        self.delay_s = delay_s
        self._in_flight = in_flight if in_flight is not None else InFlight()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # The thread holds the queue, not the stream, so the stream can be collected.
        self._thread = threading.Thread(target=_worker, args=(self._queue, delay_s, self._in_flight),
                                        name=f"tessellm-sim-stream-{next(_stream_ids)}", daemon=True)
        self._thread.start()
        weakref.finalize(self, self._queue.put, _STOP)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        try:
            fits = torch.broadcast_shapes(dst.shape, src.shape) == dst.shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"sim copy: source of shape {tuple(src.shape)} does not fit "
                             f"destination of shape {tuple(dst.shape)}")
        poison(dst)
        event = SimEvent()
        self._in_flight.add()
        self._queue.put((dst, src, event))
        return event

    def record_event(self) -> Event:
        event = SimEvent()
        self._queue.put((None, None, event))
        return event

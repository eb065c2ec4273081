"""Asynchronous transfer streams: every copy runs on the device's one worker thread, in the
order it was enqueued.

Invariant: an event completes only after every copy enqueued before it has landed, so the
engine may read a destination once its event's `wait()` returns, and never before. (One worker
for all streams keeps each stream's order and starts no thread per stream.)
"""
from __future__ import annotations

import queue
import threading

import torch

from tessellm.plugin_api import Event, TransferStream


class ThreadEvent(Event):
    """Set by the worker once it has reached this point of its queue."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def set(self) -> None:
        self._done.set()

    def wait(self) -> None:
        self._done.wait()

    def query(self) -> bool:
        return self._done.is_set()


class CopyWorker:
    """One daemon thread running queued copies, each followed by its event."""

    def __init__(self) -> None:
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="hostchip-copies", daemon=True).start()

    def _run(self) -> None:
        while True:
            dst, src, event = self._work.get()
            if dst is not None:
                dst.copy_(src)
            event.set()

    def enqueue(self, dst: torch.Tensor | None, src: torch.Tensor | None) -> Event:
        event = ThreadEvent()
        self._work.put((dst, src, event))
        return event


class ThreadStream(TransferStream):
    def __init__(self, worker: CopyWorker) -> None:
        self._worker = worker

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        return self._worker.enqueue(dst, src)

    def record_event(self) -> Event:
        return self._worker.enqueue(None, None)

"""CUDA transfer streams and events over torch.cuda.

A copy is enqueued on the stream with `non_blocking=True` (asynchronous when the host side is
pinned) and an event is recorded after it; the destination may be read, and the source
rewritten, only after that event. The compute stream is ordered after a copy with
`CudaEvent.make_stream_wait` (the device waits, the host does not).
"""
from __future__ import annotations

import torch

from tessellm.plugin_api import Event, TransferStream


class CudaEvent(Event):
    def __init__(self, event: "torch.cuda.Event") -> None:
        self.event = event

    def wait(self) -> None:
        self.event.synchronize()

    def query(self) -> bool:
        return bool(self.event.query())

    def make_stream_wait(self, stream: "torch.cuda.Stream") -> None:
        stream.wait_event(self.event)


class CudaStream(TransferStream):
    """A dedicated stream of the current device for host<->device copies."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        # the copy must not start before compute already enqueued has finished with dst/src
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        for t in (dst, src):  # the caching allocator must not reuse them before the copy ran
            if t.is_cuda:
                t.record_stream(self.stream)
        return self.record_event()

    def record_event(self) -> Event:
        event = torch.cuda.Event()
        event.record(self.stream)
        return CudaEvent(event)

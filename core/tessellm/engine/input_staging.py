"""InputStaging: a step's small inputs staged in host buffers (the device's host allocator:
pinned where it has pinned memory) and copied through a transfer stream into persistent device
buffers (the device allocator).

Invariants: compute is ordered after each copy with the device's `wait_on_compute` (a stream
wait on CUDA: the host goes on); the device buffers are the same tensors on every step, so a
captured decode graph replays over them; with overlapping steps the host buffers (and the
sampled ids' readback buffer) come in two sets used by alternate launches, and a set is
written again only after the step that used it was collected.
"""
from __future__ import annotations

import torch

from tessellm.device import DevicePlugin, Event

BufferShapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


class InputStaging:
    def __init__(self, device: DevicePlugin, shapes: BufferShapes, readback_rows: int,
                 sets: int = 1) -> None:
        alloc, host = device.allocator(), device.host_allocator()
        self.device = device
        self.stream = device.new_stream()
        self._host_sets = [{k: host.allocate(shape, dt) for k, (shape, dt) in shapes.items()}
                           for _ in range(sets)]
        self._readback_sets = [host.allocate((readback_rows,), torch.int64)
                               for _ in self._host_sets]
        self._launches = 0
        self.host_bufs, self.host_sampled = self._host_sets[0], self._readback_sets[0]
        self.dev_bufs = {k: alloc.allocate(shape, dt, tag="input_buffers")
                         for k, (shape, dt) in shapes.items()}

    def next_launch(self) -> None:
        """Switch to the other set of host buffers (with two sets)."""
        self._launches += 1
        k = self._launches % len(self._host_sets)
        self.host_bufs, self.host_sampled = self._host_sets[k], self._readback_sets[k]

    def upload(self, values: dict[str, list | tuple[int, int]]
               ) -> tuple[dict[str, torch.Tensor], Event]:
        """Stage host values, enqueue their copies and order compute after them; returns
        device views and the copies' event. A (rows, cols) tuple names a 2-D buffer already
        filled on the host."""
        views = {}
        for name, vals in values.items():
            if isinstance(vals, tuple):
                h = self.host_bufs[name][:vals[0], :vals[1]]
                d = self.dev_bufs[name][:vals[0], :vals[1]]
            else:
                src = torch.as_tensor(vals, dtype=self.host_bufs[name].dtype)
                h, d = self.host_bufs[name][:src.shape[0]], self.dev_bufs[name][:src.shape[0]]
                h.copy_(src)
            self.stream.copy(d, h)
            views[name] = d
        landed = self.stream.record_event()
        self.device.wait_on_compute(landed)
        return views, landed

    def stage_small(self, name: str, values: torch.Tensor) -> torch.Tensor:
        """Small host values (the sampler's tables, the blocks to zero) on the device through
        this launch's set: the compute stream waits for the copy, the host does not (a
        pageable copy on CUDA would wait for every queued kernel)."""
        views, _ = self.upload({name: values.reshape(-1)})
        return views[name].view(values.shape)

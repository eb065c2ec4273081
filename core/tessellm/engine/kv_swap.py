"""Block copies of the KV cache through the device contract: swap out (device -> host), swap in
(host -> device) and copy-on-write (device -> device).

Host KV caches mirror the device ones: one tensor per layer, [2, num_host_blocks, num_kv_heads,
block_size, head_dim], from the device plugin's host allocator (pinned where it has pinned
memory). Swaps go through one transfer stream of their own (FIFO, so copies touching the same
host block are ordered across steps) and are waited on only where the ordering rule of
tessellm.device requires it:

  swap_out   enqueued; its event is kept with the set of device blocks it reads. Those blocks
             were freed by the scheduler and may be handed out again: `before_reuse(blocks)`
             waits on every pending swap-out that reads one of them, before they are zeroed or
             written (and drops completed events). No wait otherwise.
  swap_in    enqueued after fresh-block zeroing; `wait_for_compute(event)` before the step's
             compute reads the blocks (the device's `wait_on_compute`: the host blocks on CPU
             and sim; a stream wait on CUDA).
  copy-on-write  a device-side copy of whole blocks (index_copy_ on the compute path), after
             zeroing: the destination is a fresh block, the source a shared one.

A run of consecutive block pairs is copied as one slice per layer.
"""
from __future__ import annotations

from typing import Iterable

import torch

from tessellm.device import DevicePlugin, Event


def block_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst, length) runs: consecutive pairs whose src and dst both advance by one."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in pairs:
        if runs:
            s, d, n = runs[-1]
            if src == s + n and dst == d + n:
                runs[-1] = (s, d, n + 1)
                continue
        runs.append((src, dst, 1))
    return runs


class KVSwapper:
    __slots__ = ("device", "kv_caches", "host_caches", "stream", "_pending_out")

    def __init__(self, device: DevicePlugin, kv_caches: list[torch.Tensor],
                 host_caches: list[torch.Tensor]) -> None:
        self.device = device
        self.kv_caches = kv_caches
        self.host_caches = host_caches
        self.stream = device.new_stream()
        self._pending_out: list[tuple[Event, frozenset[int]]] = []

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Enqueue device -> host copies of (device block, host block) pairs."""
        if not pairs:
            return
        self._copy(self.host_caches, self.kv_caches, pairs)
        self._pending_out.append((self.stream.record_event(), frozenset(d for d, _ in pairs)))

    def before_reuse(self, blocks: Iterable[int]) -> None:
        """Wait on the pending swap-outs that read any of `blocks` (about to be written)."""
        if not self._pending_out:
            return
        wanted = set(blocks)
        kept = []
        for event, sources in self._pending_out:
            if wanted and not sources.isdisjoint(wanted):
                self.wait(event)
            elif not event.query():
                kept.append((event, sources))
        self._pending_out = kept

    def swap_in(self, pairs: list[tuple[int, int]]) -> Event | None:
        """Enqueue host -> device copies of (host block, device block) pairs; the event to wait
        on before compute reads them (None when there are none)."""
        if not pairs:
            return None
        self._copy(self.kv_caches, self.host_caches, pairs)
        return self.stream.record_event()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Device-side copy of (source block, destination block) pairs (copy-on-write)."""
        if not pairs:
            return
        dev = self.kv_caches[0].device
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64).to(dev)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64).to(dev)
        for cache in self.kv_caches:
            cache.index_copy_(1, dst, cache.index_select(1, src))

    def wait(self, event: Event) -> None:
        """Block the host until a swap-out has landed (its device blocks may be reused)."""
        event.wait()

    def wait_for_compute(self, event: Event) -> None:
        """Order the step's compute after the swap-in copies."""
        self.device.wait_on_compute(event)

    def _copy(self, dst_caches: list[torch.Tensor], src_caches: list[torch.Tensor],
              pairs: list[tuple[int, int]]) -> None:
        """Enqueue copies of (src block, dst block) pairs, one slice per run and layer."""
        runs = block_runs(pairs)
        for dst_cache, src_cache in zip(dst_caches, src_caches):
            for s, d, n in runs:
                self.stream.copy(dst_cache[:, d:d + n], src_cache[:, s:s + n])

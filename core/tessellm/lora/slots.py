"""The device slot table: max_loras entries, each holding one adapter's weights at every
site (tessellm.lora.sites states the layout).

`assign(adapters)` gives every adapter of a step a slot before the step runs: one already
resident keeps its slot; a new one takes a free slot, else the least recently used slot whose
adapter is not in the step, and is written there (each site's slot zeroed, then its parts'
A and B copied in). The scheduler admits at most max_loras distinct adapters among running
requests, so a step never needs more slots than exist (`assign` raises if it does). Loading
is a copy of the adapter's few MB into the table: a step pays it only when it has a new
adapter, and the rows of other adapters read their own slots, untouched by it.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch

from tessellm.errors import TessellmError
from tessellm.lora.adapter import LoRAAdapter
from tessellm.lora.sites import LoRASite


class LoRASlotTable:
    def __init__(self, sites: list[LoRASite], weights: dict[str, torch.Tensor],
                 max_loras: int, max_rank: int,
                 synchronize: Callable[[], None] = lambda: None) -> None:
        """`synchronize`: the device's; called after each write, so a lazy device (xla) runs
        the write as a graph of its own (the same every time) instead of in a step's."""
        self.sites = sites
        self.max_rank = max_rank
        self.num_slots = max_loras
        self._tables = [(s, weights[s.a_name], weights[s.b_name]) for s in sites]
        self._synchronize = synchronize
        self._resident: OrderedDict[int, int] = OrderedDict()   # adapter id -> slot, LRU first
        self.num_loads = 0
        # every slot written once (zeros) at start-up: a device that compiles in-place
        # updates (xla) compiles the write's graph now, not at a step
        empty = LoRAAdapter("", 0, 0, 1.0, {})
        for slot in range(max_loras):
            self.write(slot, empty)
        self.num_loads = 0

    def assign(self, adapters: Iterable[LoRAAdapter],
               written: list[tuple[int, LoRAAdapter]] | None = None) -> dict[int, int]:
        """Slots for the step's adapters (adapter id -> slot), loading the missing ones;
        each (slot, adapter) written is appended to `written` when given."""
        wanted = {a.int_id: a for a in adapters}
        if len(wanted) > self.num_slots:
            raise TessellmError(f"a step has {len(wanted)} adapters, the slot table holds "
                                f"{self.num_slots} (max_loras)")
        for adapter_id in wanted:
            if adapter_id in self._resident:
                self._resident.move_to_end(adapter_id)
        for adapter_id, adapter in wanted.items():
            if adapter_id not in self._resident:   # resident only once written in full
                slot = self._free_slot(wanted)
                self.write(slot, adapter)
                self._resident[adapter_id] = slot
                if written is not None:
                    written.append((slot, adapter))
        return {i: self._resident[i] for i in wanted}

    def _free_slot(self, keep: dict[int, LoRAAdapter]) -> int:
        used = set(self._resident.values())
        for slot in range(self.num_slots):
            if slot not in used:
                return slot
        victim = next(i for i in self._resident if i not in keep)   # LRU first
        return self._resident.pop(victim)

    def evict(self, adapter_id: int) -> None:
        """Forget a resident adapter (unloaded): its slot is free for the next one."""
        self._resident.pop(adapter_id, None)

    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put `adapter` in `slot` (a tensor-parallel worker: as its leader said). Each site's
        slot is built whole on the host (zeros where the adapter has no part or a smaller
        rank) and copied in with one index_copy_ per table whose index is a tensor, so every
        write has the same shapes whatever the adapter and slot (one compiled graph on a
        static-shape device)."""
        R = self.max_rank
        for site, a_table, b_table in self._tables:
            a_block = torch.zeros(a_table.shape[1:], dtype=a_table.dtype)
            b_block = torch.zeros(b_table.shape[1:], dtype=b_table.dtype)
            for p, part in enumerate(site.parts):
                ab = adapter.weights.get((site.layer, part.module))
                if ab is None:
                    continue
                a, b = ab
                r = a.shape[0]
                a_block[p * R:p * R + r] = a
                b_block[p * R:p * R + r, part.out_offset:part.out_offset + part.out_features] \
                    = b.T
            index = torch.tensor([slot], dtype=torch.int64, device=a_table.device)
            a_table.index_copy_(0, index, a_block.unsqueeze(0).to(a_table.device))
            b_table.index_copy_(0, index, b_block.unsqueeze(0).to(b_table.device))
        self._synchronize()
        self.num_loads += 1

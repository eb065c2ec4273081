"""LoRAManager: the engine core's part of multi-LoRA serving.

- `adapter_for(lora_request)` at admission: the adapter from the host cache, else read from
  its path and checked against the base model (a LoRAError becomes an InvalidRequestError, so
  nothing is queued); the Request keeps a reference to it, so the cache (an LRU of
  max_cpu_loras adapters) may drop it while the request lives without a reload.
- `assign(scheduled)` before each step: every scheduled request's adapter gets a slot of the
  device table (tessellm.lora.slots) and `request.lora_slot` says which (-1: base model).
- per-adapter counters (requests, prompt and generated tokens) for /metrics.

Tensor parallelism: adapters are checked against the whole model's shapes and each rank
holds its split of them (tessellm.models.sharding.shard_lora_weights); the leader's `assign`
sends a LoRALoad per slot it wrote, and its workers load the adapter into the same slot
(`load_into`, from the adapter's path).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from tessellm.errors import InvalidRequestError
from tessellm.lora.adapter import LoRAAdapter, LoRAError, load_adapter
from tessellm.lora.request import LoRARequest
from tessellm.lora.sites import LoRASite, module_shapes
from tessellm.lora.slots import LoRASlotTable


@dataclass(slots=True)
class AdapterCounts:
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0


class LoRAManager:
    def __init__(self, sites: list[LoRASite], weights: dict[str, torch.Tensor],
                 max_loras: int, max_rank: int, max_cpu_loras: int, shard: Any = None,
                 synchronize: Callable[[], None] = lambda: None) -> None:
        """`shard`: this rank's tessellm.models.sharding.Shard (None: one rank);
        `synchronize`: the device's (LoRASlotTable)."""
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.shard = shard
        self.shapes = module_shapes(sites, None if shard is None else shard.spec)
        self.slots = LoRASlotTable(sites, weights, max_loras, max_rank, synchronize)
        self._cache: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.counts: dict[str, AdapterCounts] = {}

    def adapter_for(self, request: LoRARequest) -> LoRAAdapter:
        """The loaded adapter of `request` (read and checked if not cached); raises
        InvalidRequestError (param "lora_request") when it cannot be used."""
        if not isinstance(request, LoRARequest):
            raise InvalidRequestError(f"lora_request must be a LoRARequest, got "
                                      f"{type(request).__name__}", "lora_request")
        cached = self._cache.get(request.lora_int_id)
        if cached is not None:
            if cached.name != request.lora_name:
                raise InvalidRequestError(
                    f"lora_int_id {request.lora_int_id} is adapter {cached.name!r}, not "
                    f"{request.lora_name!r}: give new adapters new ids", "lora_request")
            self._cache.move_to_end(request.lora_int_id)
            return cached
        try:
            adapter = load_adapter(request, self.shapes, self.max_rank)
        except LoRAError as e:
            raise InvalidRequestError(str(e), "lora_request") from None
        if self.shard is not None:
            from tessellm.models.sharding import shard_lora_weights
            adapter = replace(adapter, weights=shard_lora_weights(adapter.weights, self.shard))
        self._cache[adapter.int_id] = adapter
        while len(self._cache) > self.max_cpu_loras:
            self._cache.popitem(last=False)
        return adapter

    def preload(self, requests: Iterable[LoRARequest]) -> None:
        for request in requests:
            self.adapter_for(request)

    def unload(self, lora_int_id: int) -> None:
        """Drop an adapter from the host cache and the slot table (requests that hold it
        keep their reference and reload it into a slot when scheduled)."""
        self._cache.pop(lora_int_id, None)
        self.slots.evict(lora_int_id)

    def assign(self, requests: list, send: Callable[[object], None]) -> None:
        """Slots for the adapters of a step's requests (`request.adapter`, None: base); each
        slot written is announced through `send` (a LoRALoad for tensor-parallel workers)."""
        from tessellm.parallel.messages import LoRALoad
        written: list[tuple[int, LoRAAdapter]] = []
        slot_of = self.slots.assign({r.adapter.int_id: r.adapter for r in requests
                                     if r.adapter is not None}.values(), written)
        for r in requests:
            r.lora_slot = -1 if r.adapter is None else slot_of[r.adapter.int_id]
        for slot, adapter in written:
            send(LoRALoad(slot, adapter.name, adapter.int_id, adapter.path))

    def load_into(self, slot: int, request: LoRARequest) -> None:
        """A tensor-parallel worker: put the adapter in `slot`, as the leader did."""
        self.slots.write(slot, self.adapter_for(request))

    @classmethod
    def of(cls, parts: Any) -> LoRAManager | None:
        """The manager of an engine's (or tensor-parallel rank's) EngineParts; None when
        enable_lora is off."""
        c = parts.config
        if not c.enable_lora:
            return None
        shard = None
        if parts.parallel is not None:
            from tessellm.models.sharding import Shard
            shard = Shard(parts.parallel.rank, parts.parallel.world_size, parts.spec)
        return cls(parts.lora_sites, parts.weights, c.max_loras, c.max_lora_rank,
                   c.max_cpu_loras or c.max_loras, shard, parts.device.synchronize)

    def count_queued(self, requests: list) -> None:
        """A queued group's samples and (once) its prompt tokens, under its adapter."""
        adapter = requests[0].adapter
        if adapter is not None:
            c = self.counts.setdefault(adapter.name, AdapterCounts())
            c.requests += len(requests)
            c.prompt_tokens += requests[0].num_prompt_tokens

    def count_finished(self, requests: list) -> None:
        """Finished requests' generated tokens, under their adapters."""
        for r in requests:
            if r.adapter is not None:
                c = self.counts.setdefault(r.adapter.name, AdapterCounts())
                c.generated_tokens += len(r.output_token_ids)

    @staticmethod
    def adapter_of(manager: LoRAManager | None, request: LoRARequest | None
                   ) -> LoRAAdapter | None:
        """The loaded adapter of a request to an engine whose manager is `manager` (None:
        LoRA off); None for the base model; InvalidRequestError when it cannot be used."""
        if request is None:
            return None
        if manager is None:
            raise InvalidRequestError("this engine serves no LoRA adapters (enable_lora is "
                                      "off)", "lora_request")
        return manager.adapter_for(request)

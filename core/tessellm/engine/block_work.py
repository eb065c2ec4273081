"""BlockWork: a step's KV block work on one rank, before its inputs are built: swap-outs
enqueued, the swap-outs reading blocks about to be reused waited on, fresh blocks zeroed,
copy-on-write and swap-in copies (tessellm.engine.kv_swap); compute is ordered after the
swap-ins by the caller.

Blocks are zeroed when first handed out (and the null block at start): attention kernels read
whole blocks through padded block tables and rely on every such slot being finite. A fresh
block whose every slot the step itself writes (a prefill covering it) is not zeroed: each
layer writes the step's K/V before it attends. On a static-shape device the ids to zero are
padded to a power of two with the null block (few shapes to compile) and the zeroing runs as
a graph of its own.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from tessellm.cache.kv_manager import KVCacheManager
from tessellm.device import DevicePlugin, Event
from tessellm.engine.kv_swap import KVSwapper
from tessellm.parallel.messages import BlockOps

StageIds = Callable[[torch.Tensor], torch.Tensor]   # block ids -> on the device, staged


class BlockWork:
    def __init__(self, device: DevicePlugin, kv_caches: list[torch.Tensor],
                 swapper: KVSwapper, static_shapes: bool, max_staged: int,
                 stage_ids: StageIds | None) -> None:
        """`stage_ids`: how block ids reach the device when at most `max_staged` are zeroed
        (the runner's staging buffers), None to copy them directly."""
        self.device, self.kv_caches, self.swapper = device, kv_caches, swapper
        self.static_shapes, self.max_staged, self.stage_ids = static_shapes, max_staged, stage_ids

    def zero(self, block_ids: list[int]) -> None:
        if not block_ids:
            return
        if self.static_shapes:
            block_ids = block_ids + [KVCacheManager.NULL_BLOCK] * (
                (1 << (len(block_ids) - 1).bit_length()) - len(block_ids))
        ids = torch.tensor(block_ids, dtype=torch.int64)
        if self.stage_ids is not None and len(block_ids) <= self.max_staged:
            idx = self.stage_ids(ids)
        else:
            idx = ids.to(self.kv_caches[0].device)
        for cache in self.kv_caches:
            cache.index_fill_(1, idx, 0)
        if self.static_shapes:   # its own graph, not merged into the step's
            self.device.synchronize()

    def run(self, ops: BlockOps) -> Event | None:
        """Do `ops` in order; returns the swap-in event compute must wait on (None: none)."""
        self.swapper.swap_out(ops.swap_out)
        self.swapper.before_reuse(ops.fresh)
        written = set(ops.written_in_full)
        self.zero([b for b in ops.fresh if b not in written])
        self.swapper.copy_blocks(ops.copies)
        return self.swapper.swap_in(ops.swap_in)

"""Block-table groups of a hybrid model: one KVCacheManager per group, over one shared pool.

A hybrid model (Gemma 2 / 3: sliding-window layers and full-attention layers) needs the
whole context in its full layers but only the window in its windowed ones. One table per
request would hold the whole context for every layer; so the layers are split into groups
by attention kind, and each group has its own table per request (its manager releases the
blocks out of its window, tessellm.cache.sliding_window).

Memory (vLLM's hybrid allocator): every group draws block ids from ONE BlockPool, and the
KV tensors are shared between groups. With P = the layer count of the smallest kind, each
kind's layers are cut into groups of (at most) P layers, and layer j of every group reads and
writes KV tensor j, so a block id is a page of P tensors that belongs to exactly one group
(`KVCacheLayout`):

    Gemma 2, 4 layers (0, 2 windowed; 1, 3 full), P = 2
    group 0 (full):   layers 1, 3 -> tensors 0, 1      block 17 in group 0's tables
    group 1 (W = 8):  layers 0, 2 -> tensors 0, 1      block 5 in group 1's tables

A block costs P layers' worth of bytes and a sequence of c tokens holds about c / bs blocks in
each full group and at most the window's bound in each windowed one, so the pool needs no
split between the groups: whatever a windowed group releases, any group reuses. Trade-off:
when the kinds' layer counts are not multiples of P, the last group of a kind has fewer
layers than tensors, and its blocks' pages in the tensors it does not use are wasted (Gemma
3 1B: 4 full and 22 windowed layers, P = 4, six windowed groups, the last of 2 layers).

Block work stays global: fresh blocks are zeroed, copied (copy-on-write) and swapped in
every tensor, so BlockOps, the swap pools and tensor-parallel replay are those of one
group. What differs per group is what attention reads: each group's block tables and slot
mapping (its attention metadata; AttentionMetadata per group, fed to the layers of that
group).

Invariants: a request holds tables in all groups or in none; allocation is all-or-nothing
across groups (every group's need is checked against the shared free queue first, and every
group's prefix hits are held before any group allocates, so one group's allocation cannot
evict another's hit); a prefix hit is the longest run of blocks cached in every group (each
group hashes under its own chain root); fork, free, trim and prefix caching apply to every
group. A model with one kind of layer uses a plain KVCacheManager (no coordinator).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tessellm.cache.block_pool import BlockPool
from tessellm.cache.kv_manager import KVCacheError, KVCacheManager, SequenceState
from tessellm.errors import ConfigError


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """Which block-table group and which KV tensor each layer uses (module docstring)."""

    windows: tuple[int, ...]         # per group: its sliding window (0: full attention)
    layer_groups: tuple[int, ...]    # per layer: its group
    layer_tensors: tuple[int, ...]   # per layer: the KV tensor it reads and writes

    @classmethod
    def of(cls, layer_windows: Sequence[int], grouped: bool = True) -> KVCacheLayout:
        """The layout of layers with these windows (0: full attention). One group when every
        layer has the same window, or when not `grouped` (then a window only where every
        layer has it: mixed layers hold their whole context); else full-attention groups
        first, then each window's, in layer order."""
        n = len(layer_windows)
        kinds = sorted(set(layer_windows))
        if len(kinds) <= 1 or not grouped:
            window = kinds[0] if len(kinds) == 1 else 0
            return cls((window,), (0,) * n, tuple(range(n)))
        by_kind = [[i for i, w in enumerate(layer_windows) if w == k] for k in kinds]
        width = min(len(layers) for layers in by_kind)
        windows: list[int] = []
        groups, tensors = [0] * n, [0] * n
        for kind, layers in zip(kinds, by_kind):
            for start in range(0, len(layers), width):
                for j, layer in enumerate(layers[start:start + width]):
                    groups[layer], tensors[layer] = len(windows), j
                windows.append(kind)
        return cls(tuple(windows), tuple(groups), tuple(tensors))

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_tensors(self) -> int:
        """KV tensors to allocate (layers share them across groups)."""
        return max(self.layer_tensors, default=-1) + 1


class KVCacheGroups:
    """The KVCacheManager interface the scheduler and the engine use, over one manager per
    group of a KVCacheLayout. Prefix hits travel as one flat list: each group's hits in group
    order, the same count per group."""

    __slots__ = ("_pool", "_groups", "_caching")

    NULL_BLOCK = KVCacheManager.NULL_BLOCK

    def __init__(self, num_blocks: int, block_size: int, windows: Sequence[int],
                 enable_prefix_caching: bool = True) -> None:
        if len(windows) < 2:
            raise KVCacheError(f"KVCacheGroups needs at least two groups, got {len(windows)} "
                               f"(one group is a KVCacheManager)")
        self._groups: tuple[KVCacheManager, ...] = (
            KVCacheManager(num_blocks, block_size, enable_prefix_caching, windows[0]),)
        self._pool: BlockPool = self._groups[0].pool
        self._groups += tuple(
            KVCacheManager(num_blocks, block_size, enable_prefix_caching, w, pool=self._pool,
                           group=g) for g, w in enumerate(windows) if g)
        self._caching = bool(enable_prefix_caching)

    groups = property(lambda self: self._groups, doc="The groups' managers, in group order.")
    pool = property(lambda self: self._pool)
    enable_prefix_caching = property(lambda self: self._caching)
    block_size = property(lambda self: self._groups[0].block_size)
    num_blocks = property(lambda self: self._groups[0].num_blocks)
    num_physical_blocks = property(lambda self: self._groups[0].num_physical_blocks)
    num_free_blocks = property(lambda self: self._pool.num_free_blocks)
    usage = property(lambda self: self._groups[0].usage)

    def max_held_blocks(self, num_tokens: int, step_tokens: int) -> int:
        """The most blocks a lone sequence holds at once, all groups together."""
        return sum(m.max_held_blocks(num_tokens, step_tokens) for m in self._groups)

    def held_blocks(self, request_id: str) -> list[int]:
        return [b for m in self._groups for b in m.held_blocks(request_id)]

    def num_held_blocks(self, request_id: str) -> int:
        return sum(m.num_held_blocks(request_id) for m in self._groups)

    def _split(self, hits: Sequence[int]) -> list[Sequence[int]]:
        k, rest = divmod(len(hits), len(self._groups))
        if rest:
            raise KVCacheError(f"{len(hits)} prefix hits do not split over "
                               f"{len(self._groups)} groups")
        return [hits[g * k:(g + 1) * k] for g in range(len(self._groups))]

    def get_computed_blocks(self, request: SequenceState) -> tuple[list[int], int]:
        """The longest run of leading blocks cached in every group (flat, group by group)
        and the tokens it covers."""
        found = [m.get_computed_blocks(request)[0] for m in self._groups]
        k = min(len(blocks) for blocks in found)
        return [b for blocks in found for b in blocks[:k]], k * self.block_size

    def growth(self, request: SequenceState, num_new_tokens: int,
               computed_blocks: Sequence[int] = ()) -> tuple[list[int], int]:
        plans = [m.growth(request, num_new_tokens, hits)
                 for m, hits in zip(self._groups, self._split(computed_blocks))]
        return [b for held, _ in plans for b in held], sum(take for _, take in plans)

    def allocate_slots(self, request: SequenceState, num_new_tokens: int,
                       computed_blocks: Sequence[int] = ()) -> bool:
        """Every group's allocate_slots, or none (False: nothing changed but the release of
        blocks out of the windows)."""
        per_group = self._split(computed_blocks)
        held, take = self.growth(request, num_new_tokens, computed_blocks)
        pool = self._pool
        if take + sum(pool.ref_count(b) == 0 for b in held) > pool.num_free_blocks:
            return False
        pool.incref(held)   # first: no group's allocation may evict another group's hit
        try:
            for m, hits in zip(self._groups, per_group):
                if not m.allocate_slots(request, num_new_tokens, hits):
                    raise KVCacheError(f"request {request.request_id!r}: a group could not "
                                       f"allocate what the shared pool was checked to hold")
        finally:
            pool.free(held)     # the tables hold them now (or the error stands)
        return True

    def cache_full_blocks(self, request: SequenceState, num_computed: int | None = None
                          ) -> None:
        for m in self._groups:
            m.cache_full_blocks(request, num_computed)

    def fork(self, parent: SequenceState, child: SequenceState) -> None:
        for m in self._groups:
            m.fork(parent, child)

    def free(self, request: SequenceState) -> None:
        for m in self._groups:
            m.free(request)

    def trim(self, request: SequenceState, num_tokens: int) -> None:
        for m in self._groups:
            m.trim(request, num_tokens)

    def take_block_copies(self) -> list[tuple[int, int]]:
        return [pair for m in self._groups for pair in m.take_block_copies()]

    def take_fresh_blocks(self) -> list[int]:
        return [b for m in self._groups for b in m.take_fresh_blocks()]

    def __repr__(self) -> str:
        return (f"KVCacheGroups(groups={[m.sliding_window for m in self._groups]}, "
                f"num_blocks={self.num_blocks}, free={self.num_free_blocks})")


KVCache = KVCacheManager | KVCacheGroups


def make_kv_cache(num_blocks: int, block_size: int, windows: Sequence[int],
                  enable_prefix_caching: bool = True) -> KVCache:
    """The manager of a pool whose block-table groups have these windows (0: full attention):
    a KVCacheManager for one group (no coordinator on the hot path), else KVCacheGroups."""
    if len(windows) == 1:
        return KVCacheManager(num_blocks, block_size, enable_prefix_caching, windows[0])
    return KVCacheGroups(num_blocks, block_size, windows, enable_prefix_caching)


def check_pool_holds_a_window(kv: KVCache, max_model_len: int) -> None:
    """Raise ConfigError when the pool cannot hold one sequence decoding a block past the
    longest window (in every group at once): no windowed request could ever get there."""
    longest = max(m.sliding_window for m in kv.groups)
    if not longest:
        return
    num_tokens = min(max_model_len, longest + kv.block_size)
    need = kv.max_held_blocks(num_tokens, 1)
    if need > kv.num_blocks:
        raise ConfigError(
            f"the KV pool has {kv.num_blocks} blocks of {kv.block_size} tokens; one sequence "
            f"past its sliding window of {longest} tokens needs {need} "
            f"({len(kv.groups)} block-table group(s)): raise num_kv_blocks or kv_cache_bytes")

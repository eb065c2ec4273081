"""Copy-on-write bookkeeping of a KV manager: the (shared source, fresh destination) pairs
the model runner copies before the step, and the references that keep each source alive
until then.

A source's reference is dropped only by `take` (until then the source is held for the copy,
which reads it before the step): otherwise a preemption later in the same schedule() could
free the source, hand it out as a fresh block and have it zeroed before the copy read it.
The copy-on-write test counts table references only (`extra_refs`: a held source whose last
table writes into it writes in place, after the copy has read it).
"""
from __future__ import annotations

from tessellm.cache.block_pool import BlockPool


class BlockCopies:
    __slots__ = ("_pairs", "_holds")

    def __init__(self) -> None:
        self._pairs: list[tuple[int, int]] = []   # (source, destination), in order
        self._holds: dict[int, int] = {}           # source -> references kept for its copies

    def record(self, shared: int, private: int) -> None:
        """Copy `shared` into `private` before the step; the caller's table reference to
        `shared` is now held for the copy."""
        self._pairs.append((shared, private))
        self._holds[shared] = self._holds.get(shared, 0) + 1

    def extra_refs(self, block_id: int) -> int:
        """References to `block_id` held for copies (not by tables)."""
        return self._holds.get(block_id, 0)

    def take(self, pool: BlockPool) -> list[tuple[int, int]]:
        """The pairs since the previous call; drops the references held for them."""
        pairs, self._pairs = self._pairs, []
        if self._holds:
            holds, self._holds = self._holds, {}
            pool.free([b for b, n in holds.items() for _ in range(n)])
        return pairs

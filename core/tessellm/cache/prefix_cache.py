"""Prefix caching: content hashes of full KV blocks, the hash <-> block map, and its counters.

A full block (block_size tokens) of a sequence is named by a chained hash:

    h(-1) = root(cache_salt, lora_int_id)         (the salt and adapter seed the chain)
    h(i)  = sha256(h(i-1) || token ids of block i as little-endian int64)

so h(i) names the whole prefix 0 .. (i+1)*block_size - 1, not just the block, and two
sequences with equal token prefixes but different salts (or LoRA adapters) never share a
hash. Partial blocks
are never hashed or cached: their KV is still being written.

Collision stance: digests are full sha256 (32 bytes). A collision would make one sequence read
another's KV; with sha256 that needs 2**128 work, so it is treated as impossible (Python's
`hash()` of a tuple is not used: 64 bits, and attacker-steerable through chosen prompts).

`CachedBlockMap` holds the cached blocks: hash -> block id and back. Invariants: the two maps
are inverse bijections (one block per hash, one hash per block); what a block's reference
count is, and when it is evicted, is the BlockPool's business (it owns one of these maps).
Once `record_changes()` is called it also keeps the net change since the last
`take_changes()` (hashes stored, hashes removed): an engine core that publishes its cache for
prefix-aware routing (tessellm.ray) sends these, so a front end can mirror the hash set.
"""
from __future__ import annotations

import hashlib
import sys
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from tessellm.cache.sequence_state import KVCacheError, SequenceState

if TYPE_CHECKING:   # block_pool imports this module
    from tessellm.cache.block_pool import BlockPool

BlockHash = bytes

_NATIVE_LE = sys.byteorder == "little"  # array("q") is 8 bytes on every supported platform


def root_hash(cache_salt: str | None, lora_int_id: int = 0, group: int = 0) -> BlockHash:
    """The chain's seed: distinct for no salt, each salt string (including ""), each LoRA
    adapter id (0: the base model; KV computed through an adapter is its own) and each
    block-table group (0: the first; another group's blocks hold other layers' KV)."""
    seed = b"tessellm-prefix-v1\x00" if cache_salt is None else (
        b"tessellm-prefix-v1\x01" + cache_salt.encode("utf-8", "surrogatepass"))
    if lora_int_id:
        seed = b"lora\x00" + str(lora_int_id).encode() + b"\x00" + seed
    if group:
        seed = b"group\x00" + str(group).encode() + b"\x00" + seed
    return hashlib.sha256(seed).digest()


def hash_block(parent: BlockHash, token_ids: list[int]) -> BlockHash:
    """The hash of a full block whose prefix before it hashes to `parent`."""
    tokens = array("q", token_ids)
    if not _NATIVE_LE:
        tokens.byteswap()
    return hashlib.sha256(parent + tokens.tobytes()).digest()


def check_hits(pool: BlockPool, block_size: int, request: SequenceState, has_table: bool,
               hits: list[int], num_dead: int = 0) -> None:
    """Raise KVCacheError unless `hits` can start the request's table: it has no blocks and
    no computed tokens, they are distinct blocks of `pool`, cached but for the first
    `num_dead` (out of a window, never held: another block-table group's allocation may
    have evicted them since), and they leave its last token to compute."""
    rid = request.request_id
    if has_table or request.num_computed_tokens != 0:
        raise KVCacheError(f"request {rid!r} has blocks or computed tokens already; cached "
                           f"blocks can only start a table")
    if len(set(hits)) != len(hits) or any(pool.block_hash(b) is None for b in hits[num_dead:]):
        raise KVCacheError(f"computed blocks {hits} for request {rid!r} are not distinct "
                           f"cached blocks")
    if len(hits) * block_size >= request.num_tokens:
        raise KVCacheError(f"computed blocks {hits} cover all {request.num_tokens} tokens "
                           f"of request {rid!r}; the last one must be computed")


def extend_block_hashes(hashes: list[BlockHash], num_full_blocks: int, block_size: int,
                        cache_salt: str | None,
                        token_ids_slice: Callable[[int, int], list[int]],
                        lora_int_id: int = 0, group: int = 0) -> None:
    """Append hashes to `hashes` (the chain of a sequence's first len(hashes) blocks) until it
    covers `num_full_blocks` blocks. Token ids only ever get appended to a sequence, so
    hashes already in the list stay valid."""
    parent = hashes[-1] if hashes else root_hash(cache_salt, lora_int_id, group)
    for i in range(len(hashes), num_full_blocks):
        parent = hash_block(parent, token_ids_slice(i * block_size, (i + 1) * block_size))
        hashes.append(parent)


class CachedBlockMap:
    """hash -> block id and block id -> hash, kept inverse to each other."""

    __slots__ = ("_by_hash", "_by_block", "_changes")

    def __init__(self) -> None:
        self._by_hash: dict[BlockHash, int] = {}
        self._by_block: dict[int, BlockHash] = {}
        self._changes: dict[BlockHash, bool] | None = None   # hash -> cached now (net)

    def record_changes(self) -> list[BlockHash]:
        """Start keeping the net change of the hash set; returns the hashes cached now."""
        self._changes = {}
        return list(self._by_hash)

    def take_changes(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """(stored, removed) since the previous call: applied to the set as of that call they
        give the set now. Empty lists when changes are not recorded."""
        if not self._changes:
            return [], []
        changes, self._changes = self._changes, {}
        return ([h for h, cached in changes.items() if cached],
                [h for h, cached in changes.items() if not cached])

    def __len__(self) -> int:
        return len(self._by_hash)

    def get(self, block_hash: BlockHash) -> int | None:
        return self._by_hash.get(block_hash)

    def hash_of(self, block_id: int) -> BlockHash | None:
        return self._by_block.get(block_id)

    def insert(self, block_hash: BlockHash, block_id: int) -> bool:
        """Map the hash to the block. False (nothing changes) when the hash names another block
        already (two sequences computed the same prefix: the first one stays the cached copy)
        or the block has a hash already (then it is this one: a block is filled only once)."""
        if block_hash in self._by_hash or block_id in self._by_block:
            return False
        self._by_hash[block_hash] = block_id
        self._by_block[block_id] = block_hash
        if self._changes is not None:
            self._changes[block_hash] = True
        return True

    def evict(self, block_id: int) -> bool:
        """Forget the block's hash (it is about to hold other tokens). False if uncached."""
        block_hash = self._by_block.pop(block_id, None)
        if block_hash is None:
            return False
        del self._by_hash[block_hash]
        if self._changes is not None:
            self._changes[block_hash] = False
        return True


@dataclass(slots=True)
class PrefixCacheStats:
    """Counters in tokens: `queries` sums the sequence lengths looked up when requests are
    admitted (a request resumed after preemption counts again: its hit is saved work too),
    `hits` the tokens found computed in the cache. Lookups of a request that is then not
    admitted in that step are not counted (it is looked up again when it is)."""

    queries: int = 0
    hits: int = 0
    num_requests: int = 0
    num_hit_requests: int = 0

    def record(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.queries += num_query_tokens
        self.hits += num_hit_tokens
        self.num_requests += 1
        self.num_hit_requests += num_hit_tokens > 0

    @property
    def hit_rate(self) -> float:
        """hits / queries in [0, 1]; 0.0 before any query."""
        return self.hits / self.queries if self.queries else 0.0

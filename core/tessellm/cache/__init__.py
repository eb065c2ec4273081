"""The paged KV cache: a pool of fixed-size blocks, the per-request block tables over it, and
the prefix cache of computed full blocks."""
from tessellm.cache.block_pool import BlockPool, BlockPoolError, NoFreeBlocksError
from tessellm.cache.kv_manager import KVCacheError, KVCacheManager, SequenceState
from tessellm.cache.prefix_cache import (
    BlockHash, CachedBlockMap, PrefixCacheStats, extend_block_hashes, hash_block, root_hash)

__all__ = [
    "BlockPool", "BlockPoolError", "NoFreeBlocksError",
    "KVCacheError", "KVCacheManager", "SequenceState",
    "BlockHash", "CachedBlockMap", "PrefixCacheStats", "extend_block_hashes", "hash_block",
    "root_hash",
]

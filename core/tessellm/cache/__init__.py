"""The paged KV cache: a pool of fixed-size blocks and the per-request block tables over it."""
from tessellm.cache.block_pool import BlockPool, BlockPoolError, NoFreeBlocksError
from tessellm.cache.kv_manager import KVCacheError, KVCacheManager, SequenceState

__all__ = [
    "BlockPool", "BlockPoolError", "NoFreeBlocksError",
    "KVCacheError", "KVCacheManager", "SequenceState",
]

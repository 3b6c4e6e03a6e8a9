"""Copy-on-write radix cache over MLA pages and KDA checkpoints (docs/architecture.md, "The radix cache")."""
from k3core.cache.node import TreeNode
from k3core.cache.radix_cache import RadixCache
from k3core.cache.types import CacheStats, EvictResult, InsertResult, PrefixHit

__all__ = ["RadixCache", "PrefixHit", "InsertResult", "EvictResult", "CacheStats", "TreeNode"]

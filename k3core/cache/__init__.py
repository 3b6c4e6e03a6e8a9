"""Copy-on-write radix cache over MLA pages and KDA checkpoints (see DESIGN.md "Radix cache")."""
from k3core.cache.node import TreeNode
from k3core.cache.radix_cache import RadixCache
from k3core.cache.types import CacheStats, EvictResult, InsertResult, PrefixHit

__all__ = ["RadixCache", "PrefixHit", "InsertResult", "EvictResult", "CacheStats", "TreeNode"]

"""Typed results at the boundary between the radix cache and its callers (scheduler, engine, tests).

Handles are the pool's stable ids (plain ints at run time), so the cache works with any object that obeys the
k3core.memory pool API (the tests also drive it with a small fake).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from k3core.memory.layout import PageHandle, SlotHandle

if TYPE_CHECKING:
    from k3core.cache.node import TreeNode

__all__ = ["PrefixHit", "InsertResult", "EvictResult", "CacheStats", "PageHandle", "SlotHandle"]


@dataclass(frozen=True)
class PrefixHit:
    """The longest cached prefix of a query that ends at a KDA checkpoint.

    The caller must `lock(node)` before using the handles and `unlock(node)` when it no longer reads them.
    `shared_pages` are tree-owned full pages of [0, num_tokens): read them, never write them.
    `partial_page` (when num_tokens is not a multiple of page_size) holds tokens [floor(num_tokens / page_size) *
    page_size, num_tokens): COPY it into a page of your own before appending to it.
    `checkpoint` is the state after num_tokens tokens: COPY it into your working slot; never run the model on it.
    """
    num_tokens: int
    shared_pages: list[PageHandle]
    partial_page: Optional[PageHandle]
    checkpoint: Optional[SlotHandle]
    node: "TreeNode"


@dataclass(frozen=True)
class InsertResult:
    """What an insert or a donation changed in ownership.

    `adopted_pages` are request pages the tree now owns: the request must neither free nor write them (it may keep
    reading them while it holds a lock on `node`). `slot_adopted` is False when a checkpoint already existed at that
    exact prefix (or no room was left for its partial page): the cache has then FREED the slot it was given.
    A request that goes on running after a snapshot still reads the adopted pages: it must `lock(node)` (then
    unlock the node it held before, an ancestor of this one) or the pages may be evicted under it.
    """
    num_tokens: int
    adopted_pages: list[PageHandle]
    slot_adopted: bool
    node: "TreeNode"


@dataclass(frozen=True)
class EvictResult:
    num_slots_freed: int
    num_pages_freed: int     # full pages and checkpoint partial-page copies


@dataclass(frozen=True)
class CacheStats:
    queried_tokens: int      # sum of len(token_ids) over match() calls
    hit_tokens: int          # sum of PrefixHit.num_tokens over the same calls
    evicted_checkpoints: int
    evicted_pages: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

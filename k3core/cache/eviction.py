"""LRU eviction for the radix cache, separately for checkpoint slots and for pages.

Dropping a checkpoint keeps its node's pages: the pages above every shallower checkpoint stay whole, so a later
match falls back to the shallower checkpoint instead of to zero. Pages are only ever taken from unlocked LEAVES (a
page in the middle of a path would cut every deeper prefix), and a leaf that loses its pages loses its checkpoint.
"""
from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING

from k3core.cache.node import TreeNode

if TYPE_CHECKING:
    from k3core.cache.radix_cache import RadixCache


def _checkpoint_order(node: TreeNode) -> tuple[int, int]:
    # Least recently used first; among nodes touched together, the deepest first (the shallow one serves more).
    return (node.last_access, -node.end)


def _leaf_order(node: TreeNode) -> tuple[bool, int, int]:
    # Leaves without a checkpoint hold pages no match can return: reclaim those before any that can still hit.
    return (node.checkpoint is not None, node.last_access, -node.end)


def _all_nodes(root: TreeNode) -> list[TreeNode]:
    nodes, stack = [], [root]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children.values())
    return nodes


def drop_checkpoint(cache: "RadixCache", node: TreeNode) -> tuple[int, int]:
    """Free node's checkpoint slot and its partial-page copy; returns (slots freed, pages freed)."""
    ckpt = node.checkpoint
    assert ckpt is not None
    node.checkpoint = None
    cache._tree_slots.discard(ckpt.slot)
    cache.pool.free_slot(ckpt.slot)
    cache.evicted_checkpoints += 1
    if ckpt.partial_page is None:
        return 1, 0
    cache._tree_pages.discard(ckpt.partial_page)
    cache.pool.free_pages([ckpt.partial_page])
    cache.evicted_pages += 1
    return 1, 1


def evict_checkpoints(cache: "RadixCache", num_slots: int) -> tuple[int, int]:
    """Drop at least num_slots unpinned checkpoints (fewer if not enough exist); returns (slots, pages) freed.

    A lock protects what running requests READ, the pages. A checkpoint is only read while a request copies it
    into its working slot (it is pinned then), so checkpoints on locked paths may go too, after every unlocked
    one: otherwise a request that hit a checkpoint would keep it alive for its whole run and could starve itself."""
    if num_slots <= 0:
        return 0, 0
    candidates = [node for node in _all_nodes(cache.root)
                  if node.checkpoint is not None and node.checkpoint.pins == 0]
    candidates.sort(key=lambda node: (node.path_lock_count > 0, *_checkpoint_order(node)))
    slots_freed = pages_freed = 0
    for node in candidates[:num_slots]:
        slots, pages = drop_checkpoint(cache, node)
        slots_freed += slots
        pages_freed += pages
    return slots_freed, pages_freed


def remove_leaf(cache: "RadixCache", node: TreeNode) -> tuple[int, int]:
    """Detach an unlocked leaf and free everything it owns; returns (slots, pages) freed."""
    assert node.is_leaf and not node.is_root and node.path_lock_count == 0
    slots_freed = pages_freed = 0
    if node.checkpoint is not None:
        slots_freed, pages_freed = drop_checkpoint(cache, node)
    if node.pages:
        cache._tree_pages.difference_update(node.pages)
        cache.pool.free_pages(list(node.pages))
        cache.evicted_pages += len(node.pages)
        pages_freed += len(node.pages)
        node.pages = []
    parent = node.parent
    assert parent is not None
    del parent.children[node.key[0]]
    node.parent = None
    return slots_freed, pages_freed


def evict_leaves(cache: "RadixCache", num_pages: int) -> tuple[int, int]:
    """Remove unlocked leaves until at least num_pages pages are freed (or none is left); a parent that becomes an
    unlocked leaf joins the candidates. Returns (slots, pages) freed."""
    if num_pages <= 0:
        return 0, 0
    tie = itertools.count()
    heap = [(_leaf_order(node), next(tie), node) for node in _all_nodes(cache.root)
            if node.is_leaf and not node.is_root and node.path_lock_count == 0]
    heapq.heapify(heap)
    slots_freed = pages_freed = 0
    while heap and pages_freed < num_pages:
        _, _, node = heapq.heappop(heap)
        parent = node.parent
        assert parent is not None
        slots, pages = remove_leaf(cache, node)
        slots_freed += slots
        pages_freed += pages
        if parent.is_leaf and not parent.is_root and parent.path_lock_count == 0:
            heapq.heappush(heap, (_leaf_order(parent), next(tie), parent))
    return slots_freed, pages_freed

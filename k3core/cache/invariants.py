"""Structural checks of the radix cache; `RadixCache.check_invariants()` runs them and tests call it after every
operation. Each failure raises AssertionError naming the node and the rule it broke."""
from __future__ import annotations

from typing import TYPE_CHECKING

from k3core.cache.node import TreeNode, prefix_hash

if TYPE_CHECKING:
    from k3core.cache.radix_cache import RadixCache


def _fail(node: TreeNode, rule: str) -> None:
    raise AssertionError(f"radix cache invariant broken at {node!r}: {rule}")


def _check_node(cache: "RadixCache", node: TreeNode, path_tokens: list[int],
                seen_pages: set[int], seen_slots: set[int]) -> None:
    ps = cache.page_size
    if node.lock_count < 0 or node.path_lock_count < 0:
        _fail(node, "negative lock count")
    below = sum(child.path_lock_count for child in node.children.values())
    if node.path_lock_count != node.lock_count + below:
        _fail(node, f"path_lock_count {node.path_lock_count} != own {node.lock_count} + children {below}")
    for first, child in node.children.items():
        if child.parent is not node:
            _fail(child, "child does not point back to its parent")
        if not child.key or child.key[0] != first:
            _fail(child, f"empty edge or edge not keyed by its first token {first}")
        if child.start != node.end:
            _fail(child, f"edge starts at {child.start} but its parent ends at {node.end}")
        if child.last_access > node.last_access and not node.is_root:
            _fail(child, "a child was used more recently than its parent (LRU would evict the shared prefix first)")
    expected_pages = node.end // ps - node.start // ps
    if len(node.pages) != expected_pages:
        _fail(node, f"owns {len(node.pages)} pages, expected floor(end/ps) - floor(start/ps) = {expected_pages}")
    for page in node.pages:
        if page in seen_pages:
            _fail(node, f"page {page} is owned twice")
        seen_pages.add(page)
    ckpt = node.checkpoint
    if ckpt is None:
        return
    if node.is_root:
        _fail(node, "the root holds a checkpoint (an empty prefix needs none)")
    if ckpt.num_tokens != node.end:
        _fail(node, f"checkpoint for {ckpt.num_tokens} tokens attached to a node ending at {node.end}")
    if ckpt.tokens_hash != prefix_hash(path_tokens):
        _fail(node, "checkpoint was taken for a different prefix than the path from the root spells")
    if ckpt.slot in seen_slots:
        _fail(node, f"slot {ckpt.slot} is owned twice")
    seen_slots.add(ckpt.slot)
    if (ckpt.partial_page is None) != (node.end % ps == 0):
        _fail(node, "a partial-page copy must exist exactly when the checkpoint is not page-aligned")
    if ckpt.partial_page is not None:
        if ckpt.partial_page in seen_pages:
            _fail(node, f"partial page {ckpt.partial_page} is owned twice")
        seen_pages.add(ckpt.partial_page)


def check_tree(cache: "RadixCache") -> None:
    root = cache.root
    if root.key or root.pages or root.start != 0:
        _fail(root, "the root must have an empty edge and no pages")
    seen_pages: set[int] = set()
    seen_slots: set[int] = set()
    stack: list[tuple[TreeNode, list[int]]] = [(root, [])]
    while stack:
        node, above = stack.pop()
        path_tokens = above + list(node.key)
        _check_node(cache, node, path_tokens, seen_pages, seen_slots)
        stack.extend((child, path_tokens) for child in node.children.values())
    if seen_pages != cache._tree_pages:
        raise AssertionError(f"radix cache page registry out of sync: {len(seen_pages)} pages on nodes, "
                             f"{len(cache._tree_pages)} registered")
    if seen_slots != cache._tree_slots:
        raise AssertionError(f"radix cache slot registry out of sync: {len(seen_slots)} slots on nodes, "
                             f"{len(cache._tree_slots)} registered")

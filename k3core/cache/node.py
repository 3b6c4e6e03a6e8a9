"""One node of the radix tree: an edge of token ids, the full MLA pages whose last token lies on that edge, and at
most one read-only KDA checkpoint holding the state after the edge's last token.

Page rule (what `check_invariants` enforces): page p covers tokens [p * page_size, (p + 1) * page_size) and belongs
to the node whose edge holds its LAST token, so a node spanning [start, end) owns exactly the pages
range(start // page_size, end // page_size). A page that straddles a node boundary therefore sits on the lower node,
and each branch below a mid-page divergence owns its own copy of that page (the tokens after the split differ).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from k3core.memory.layout import PageHandle, SlotHandle


def prefix_hash(token_ids: Sequence[int]) -> int:
    """Fingerprint of a prefix, kept on each checkpoint so invariant checks can prove it sits on the right node."""
    return hash(tuple(token_ids))


@dataclass
class Checkpoint:
    slot: SlotHandle                      # state after `num_tokens` tokens; tree-owned and never written
    partial_page: Optional[PageHandle]    # private copy of the last, partial page (None when page-aligned)
    num_tokens: int
    tokens_hash: int                      # prefix_hash of the prefix it was taken for
    pins: int = 0                         # callers copying it right now; a pinned checkpoint is never evicted


class TreeNode:
    """A radix-tree node. `lock_count` counts locks taken on this node; `path_lock_count` counts locks on this node
    or any descendant, so a node is evictable exactly when `path_lock_count == 0`."""

    __slots__ = ("parent", "key", "start", "children", "pages", "checkpoint", "lock_count", "path_lock_count",
                 "last_access")

    def __init__(self, parent: Optional["TreeNode"], key: tuple[int, ...], start: int,
                 pages: list[PageHandle], last_access: int) -> None:
        self.parent = parent
        self.key = key                                   # edge tokens [start, end)
        self.start = start                               # number of tokens on the path above this edge
        self.children: dict[int, TreeNode] = {}          # keyed by the child's first edge token
        self.pages = pages
        self.checkpoint: Optional[Checkpoint] = None
        self.lock_count = 0
        self.path_lock_count = 0
        self.last_access = last_access

    @property
    def end(self) -> int:
        return self.start + len(self.key)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def path_tokens(self) -> list[int]:
        """Tokens spelled by the path from the root to the end of this node (O(depth); for checks and tests)."""
        parts: list[tuple[int, ...]] = []
        node: Optional[TreeNode] = self
        while node is not None:
            parts.append(node.key)
            node = node.parent
        return [token for part in reversed(parts) for token in part]

    def __repr__(self) -> str:
        ckpt = f", ckpt@{self.checkpoint.num_tokens}" if self.checkpoint else ""
        return f"TreeNode([{self.start}, {self.end}), pages={len(self.pages)}{ckpt}, locks={self.path_lock_count})"


def common_prefix_len(edge: tuple[int, ...], token_ids: Sequence[int], offset: int, limit: int) -> int:
    """Length of the common prefix of `edge` and token_ids[offset:limit]."""
    n = min(len(edge), limit - offset)
    i = 0
    while i < n and edge[i] == token_ids[offset + i]:
        i += 1
    return i

"""The copy-on-write radix cache over MLA pages and KDA checkpoints.

Ownership rule: every page and slot is owned exactly once, by a tree node or by one request. Tree-owned pages and
checkpoint slots are read-only; a request that hits a checkpoint copies it (and the partial last page, if any) into
memory of its own before running the model. Checkpoints sit at node ends, so a match only ever returns a prefix that
ends at a node boundary.

A hit always leaves at least one prompt token to compute (the sampler needs its logits), so `match` considers at
most len(token_ids) - 1 tokens and the end-of-prompt checkpoint is taken at n - 1.
"""
from __future__ import annotations

import itertools
from typing import Any, Optional, Sequence

from k3core.cache import eviction, invariants
from k3core.cache.node import Checkpoint, TreeNode, common_prefix_len, prefix_hash
from k3core.cache.types import CacheStats, EvictResult, InsertResult, PageHandle, PrefixHit, SlotHandle


class RadixCache:
    """Prefix cache for hybrid KDA + MLA models.

    Callers keep these rules:
    * `lock(hit.node)` before reading anything a hit returned, `unlock(hit.node)` exactly once afterwards;
      a locked node and its ancestors are never evicted.
    * Never write a tree-owned page or slot (hits, adopted pages, slots handed over by insert/donate).
    * Evicting 0 slots / 0 pages is always safe; eviction never touches locked nodes.
    """

    def __init__(self, pool: Any, page_size: int, checkpoint_interval: int,
                 kda_chunk_size: Optional[int] = None) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}; use e.g. 16 or 64.")
        if checkpoint_interval <= 0 or checkpoint_interval % page_size:
            raise ValueError(f"checkpoint_interval={checkpoint_interval} must be a positive multiple of "
                             f"page_size={page_size}; choose e.g. {page_size * max(1, 64 // page_size)}.")
        if kda_chunk_size is not None and (kda_chunk_size <= 0 or checkpoint_interval % kda_chunk_size):
            raise ValueError(f"checkpoint_interval={checkpoint_interval} must be a multiple of the KDA chunk size "
                             f"{kda_chunk_size} so snapshots fall on chunk boundaries; pick a common multiple.")
        self.pool = pool
        self.page_size = page_size
        self.checkpoint_interval = checkpoint_interval
        self._clock = itertools.count(1)
        self.root = TreeNode(parent=None, key=(), start=0, pages=[], last_access=0)
        self._tree_pages: set[int] = set()     # every page a node owns (full pages and partial copies)
        self._tree_slots: set[int] = set()     # every checkpoint slot
        self._queried_tokens = 0
        self._hit_tokens = 0
        self.evicted_checkpoints = 0
        self.evicted_pages = 0

    # ---------------------------------------------------------------- queries
    @property
    def stats(self) -> CacheStats:
        return CacheStats(self._queried_tokens, self._hit_tokens, self.evicted_checkpoints, self.evicted_pages)

    @property
    def num_cached_slots(self) -> int:
        return len(self._tree_slots)

    @property
    def num_cached_pages(self) -> int:
        return len(self._tree_pages)

    def owns_page(self, page: PageHandle) -> bool:
        return page in self._tree_pages

    def owns_slot(self, slot: SlotHandle) -> bool:
        return slot in self._tree_slots

    def match(self, token_ids: Sequence[int]) -> PrefixHit:
        """Longest cached prefix of token_ids[:n-1] that ends at a checkpoint (a miss returns num_tokens=0 and the
        root as node). Refreshes the LRU time of the path up to the hit and counts the query in `stats`."""
        path, _ = self._walk(token_ids, max(len(token_ids) - 1, 0))
        hit_depth = 0
        for depth, node in enumerate(path):
            if node.checkpoint is not None:
                hit_depth = depth + 1
        path = path[:hit_depth]
        self._touch(path)
        self._queried_tokens += len(token_ids)
        if not path:
            return PrefixHit(0, [], None, None, self.root)
        node = path[-1]
        ckpt = node.checkpoint
        assert ckpt is not None
        self._hit_tokens += node.end
        shared_pages = [page for n in path for page in n.pages]   # exactly pages 0 .. end // page_size - 1
        return PrefixHit(node.end, shared_pages, ckpt.partial_page, ckpt.slot, node)

    def checkpoint_positions(self, token_ids: Sequence[int], cached_len: int) -> list[int]:
        """Where a request running token_ids (its prompt) from cached_len should snapshot its state: every multiple
        of the interval in (cached_len, n-1], the point where it leaves the existing tree (so the next request of
        the same family reuses the whole shared prefix), and n-1 (so an identical prompt hits). Sorted, unique."""
        last = len(token_ids) - 1
        if last <= cached_len:
            return []
        first_multiple = (cached_len // self.checkpoint_interval + 1) * self.checkpoint_interval
        positions = set(range(first_multiple, last + 1, self.checkpoint_interval))
        positions.add(last)
        diverge = self._common_len(token_ids, last)
        if cached_len < diverge < last:
            positions.add(diverge)
        return sorted(positions)

    # ---------------------------------------------------------------- locking
    def lock(self, node: TreeNode) -> None:
        node.lock_count += 1
        current: Optional[TreeNode] = node
        while current is not None:
            current.path_lock_count += 1
            current = current.parent

    def unlock(self, node: TreeNode) -> None:
        if node.lock_count <= 0:
            raise ValueError(f"unlock({node!r}) without a matching lock(); unlock each hit exactly once.")
        node.lock_count -= 1
        current: Optional[TreeNode] = node
        while current is not None:
            current.path_lock_count -= 1
            current = current.parent

    def pin_checkpoint(self, node: TreeNode) -> None:
        """Keep node's checkpoint from eviction while the caller copies it (locks protect pages only)."""
        if node.checkpoint is None:
            raise ValueError(f"pin_checkpoint({node!r}): the node has no checkpoint")
        node.checkpoint.pins += 1

    def unpin_checkpoint(self, node: TreeNode) -> None:
        if node.checkpoint is None or node.checkpoint.pins <= 0:
            raise ValueError(f"unpin_checkpoint({node!r}) without a matching pin_checkpoint()")
        node.checkpoint.pins -= 1

    # ---------------------------------------------------------------- inserts
    def insert_checkpoint(self, token_ids: Sequence[int], request_pages: Sequence[PageHandle],
                          slot: SlotHandle) -> InsertResult:
        """Cache the state after token_ids (a prefix the request has computed). `slot` is a fresh slot the caller
        filled with a copy of that state; the tree owns it from now on (and frees it if the prefix already has a
        checkpoint). The tree adopts the request's full pages it does not hold yet and copies a partial last page."""
        return self._insert(token_ids, request_pages, slot)

    def donate(self, token_ids: Sequence[int], request_pages: Sequence[PageHandle],
               working_slot: SlotHandle) -> InsertResult:
        """At finish: hand the request's working slot (the state after every token it fed: prompt plus all but the
        last sampled token) to the tree without copying it; freed instead when that prefix is already cached."""
        return self._insert(token_ids, request_pages, working_slot)

    def _insert(self, token_ids: Sequence[int], request_pages: Sequence[PageHandle],
                slot: SlotHandle) -> InsertResult:
        num_tokens = len(token_ids)
        ps = self.page_size
        if num_tokens == 0:
            raise ValueError("cannot cache a checkpoint of an empty prefix; pass at least one token.")
        if len(request_pages) < -(-num_tokens // ps):
            raise ValueError(f"{len(request_pages)} request pages cannot hold {num_tokens} tokens at page_size={ps};"
                             " pass the request's page list covering the whole prefix.")
        if slot in self._tree_slots:
            raise ValueError(f"slot {slot} already belongs to the cache; give the cache a slot the request owns.")
        node, adopted = self._extend_path(token_ids, request_pages)
        self.lock(node)     # nothing on this path may be evicted while we find room for the partial page
        try:
            slot_adopted = self._attach_checkpoint(node, token_ids, request_pages, slot)
        finally:
            self.unlock(node)
        self._touch(self._path_to(node))
        return InsertResult(num_tokens, adopted, slot_adopted, node)

    def _extend_path(self, token_ids: Sequence[int],
                     request_pages: Sequence[PageHandle]) -> tuple[TreeNode, list[PageHandle]]:
        """Walk token_ids down the tree, splitting an edge where they diverge inside it and adding one new leaf for
        the remainder; returns the node ending exactly at len(token_ids) and the request pages now tree-owned."""
        ps, num_tokens = self.page_size, len(token_ids)
        node, offset = self.root, 0
        while offset < num_tokens:
            child = node.children.get(token_ids[offset])
            if child is None:
                pages = list(request_pages[offset // ps: num_tokens // ps])   # last token in [offset, num_tokens)
                clash = [page for page in pages if page in self._tree_pages]
                if clash:
                    raise ValueError(f"pages {clash} are already owned by the cache; a request must pass its own "
                                     "pages beyond the prefix it matched (was its hit unlocked too early?).")
                leaf = TreeNode(node, tuple(token_ids[offset:]), offset, pages, next(self._clock))
                node.children[leaf.key[0]] = leaf
                self._tree_pages.update(pages)
                return leaf, pages
            common = common_prefix_len(child.key, token_ids, offset, num_tokens)
            if common < len(child.key):
                child = self._split(child, common)
            node, offset = child, offset + common
        return node, []

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut node's edge after `at` tokens; the new upper node takes the pages whose last token lies above the
        cut, the lower (original) node keeps the rest and its checkpoint, which belongs to the edge's end."""
        parent = node.parent
        assert parent is not None and 0 < at < len(node.key)
        ps = self.page_size
        num_upper_pages = (node.start + at) // ps - node.start // ps
        upper = TreeNode(parent, node.key[:at], node.start, node.pages[:num_upper_pages], node.last_access)
        upper.path_lock_count = node.path_lock_count     # every lock through the lower half passes through here
        node.pages = node.pages[num_upper_pages:]
        node.key = node.key[at:]
        node.start += at
        node.parent = upper
        upper.children[node.key[0]] = node
        parent.children[upper.key[0]] = upper
        return upper

    def _attach_checkpoint(self, node: TreeNode, token_ids: Sequence[int], request_pages: Sequence[PageHandle],
                           slot: SlotHandle) -> bool:
        if node.checkpoint is not None:
            self.pool.free_slot(slot)
            return False
        num_tokens, ps = len(token_ids), self.page_size
        partial: Optional[PageHandle] = None
        if num_tokens % ps:
            fresh = self.pool.alloc_pages(1)
            if fresh is None:     # make room from unlocked cache entries, cheapest loss first
                eviction.evict_leaves(self, 1)
                fresh = self.pool.alloc_pages(1)
            if fresh is None:     # in a unified pool a freed slot also makes room for pages
                eviction.evict_checkpoints(self, 1)
                fresh = self.pool.alloc_pages(1)
            if fresh is None:
                self.pool.free_slot(slot)     # no room for the partial page: a checkpoint without it is useless
                return False
            partial = fresh[0]
            self.pool.copy_page(request_pages[num_tokens // ps], partial)
            self._tree_pages.add(partial)
        node.checkpoint = Checkpoint(slot, partial, num_tokens, prefix_hash(token_ids))
        self._tree_slots.add(slot)
        return True

    # ---------------------------------------------------------------- eviction
    def evict(self, num_slots: int = 0, num_pages: int = 0) -> EvictResult:
        """Free at least num_slots checkpoint slots and num_pages pages from unlocked nodes, least recently used
        first (fewer when not enough is unlocked). Slots: drop checkpoints, deepest first among equally recent
        ones, keeping the node's pages so shallower checkpoints stay whole. Pages: remove unlocked leaves, those
        without a checkpoint first (their pages can no longer produce a hit); a removed leaf loses its checkpoint."""
        slots_a, pages_a = eviction.evict_checkpoints(self, num_slots)
        slots_b, pages_b = eviction.evict_leaves(self, num_pages)
        return EvictResult(slots_a + slots_b, pages_a + pages_b)

    def flush(self) -> EvictResult:
        """Free everything that no lock protects."""
        slots_a, pages_a = eviction.evict_checkpoints(self, len(self._tree_slots))
        slots_b, pages_b = eviction.evict_leaves(self, len(self._tree_pages) + 1)
        return EvictResult(slots_a + slots_b, pages_a + pages_b)

    def check_invariants(self) -> None:
        invariants.check_tree(self)

    # ---------------------------------------------------------------- helpers
    def _walk(self, token_ids: Sequence[int], limit: int) -> tuple[list[TreeNode], int]:
        """Nodes whose whole edge matches token_ids[:limit], and the matched length including a partial edge."""
        path: list[TreeNode] = []
        node, offset = self.root, 0
        while offset < limit:
            child = node.children.get(token_ids[offset])
            if child is None:
                break
            common = common_prefix_len(child.key, token_ids, offset, limit)
            offset += common
            if common < len(child.key):
                break
            path.append(child)
            node = child
        return path, offset

    def _common_len(self, token_ids: Sequence[int], limit: int) -> int:
        return self._walk(token_ids, limit)[1]

    def _path_to(self, node: TreeNode) -> list[TreeNode]:
        path = []
        current: Optional[TreeNode] = node
        while current is not None and not current.is_root:
            path.append(current)
            current = current.parent
        return path

    def _touch(self, path: Sequence[TreeNode]) -> None:
        # One timestamp for the whole path: ancestors are never older than descendants, so LRU eviction walks
        # from the leaves up and a shared prefix outlives the branches that hang off it.
        now = next(self._clock)
        for node in path:
            node.last_access = now

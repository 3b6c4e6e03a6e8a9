"""The unified two-ended pool: KDA slots from the left end of one arena, MLA pages from the right end.

    byte 0                                                                    capacity
    | slot 0 | slot 1 | ... | slot n-1 |      free      | page P-m | ... | page P-1 |
                                      ^ left            ^ right

KDA demand follows the number of concurrent requests, MLA demand the number of cached tokens; a split fixed
at start-up starves one while the other sits idle. Here both grow into the same free middle, so either kind
can take every free byte. Freeing a block in the middle of its side moves the innermost block of that side
into the hole (a copy of its bytes plus an indirection-table update), so the free region stays one
contiguous range and the ends stay packed. A slot of 54 MB and a page of 27 KB come from the same bytes
without a common block size.

Positions: slot i at byte i * slot_bytes; page position p at byte p * page_bytes, pages laid from the right,
so the first page allocated gets the highest position P-1. Occupied positions are always exactly slots
0..num_slots-1 and pages P-num_pages..P-1.
"""
from __future__ import annotations

from typing import Iterable

import torch

from k3core.memory.arena import ArenaPool
from k3core.memory.layout import PageHandle, PoolLayout, SlotHandle
from k3core.transfer import index_tables


class UnifiedPool(ArenaPool):

    def __init__(self, layout: PoolLayout, capacity_bytes: int, device: torch.device | str = "cpu") -> None:
        slot_bytes, page_bytes = layout.slot_bytes, layout.page_bytes
        # A whole number of pages, so pages tile the arena from the right end with no slack to account for.
        arena_bytes = (int(capacity_bytes) // page_bytes) * page_bytes
        if arena_bytes < slot_bytes + page_bytes:
            raise ValueError(
                f"capacity_bytes={capacity_bytes} cannot hold one KDA slot ({slot_bytes} B) and one MLA page "
                f"({page_bytes} B); give the pool more memory or use a smaller page_size")
        super().__init__(layout, arena_bytes, device, page_base=0,
                         num_slot_positions=arena_bytes // slot_bytes,
                         num_page_positions=arena_bytes // page_bytes)
        self._slot_at: list[int] = []   # _slot_at[i]: handle at slot position i (dense: positions 0..n-1)
        self._page_at: list[int] = []   # _page_at[k]: handle at page position P-1-k (dense from the right)

    # ---- boundaries -------------------------------------------------------------------------------
    @property
    def left_boundary(self) -> int:
        """First byte after the last slot."""
        return len(self._slot_at) * self.layout.slot_bytes

    @property
    def right_boundary(self) -> int:
        """First byte of the innermost page."""
        return self.page_base + (self.num_page_positions - len(self._page_at)) * self.layout.page_bytes

    def _free_bytes(self) -> int:
        return self.right_boundary - self.left_boundary

    def can_allocate(self, num_slots: int, num_pages: int) -> bool:
        left = self.left_boundary + num_slots * self.layout.slot_bytes
        right = self.right_boundary - num_pages * self.layout.page_bytes
        return left <= right

    # ---- slots ------------------------------------------------------------------------------------
    def alloc_slot(self) -> SlotHandle | None:
        if not self.can_allocate(1, 0):
            return None
        handle = self._new_slot_handle(len(self._slot_at))
        self._slot_at.append(handle)
        return handle

    def free_slot(self, handle: SlotHandle) -> None:
        hole = self._slot_position[self._live_slot(handle)]
        last = len(self._slot_at) - 1
        if hole != last:
            moved = self._slot_at[last]
            self._slot_rows[hole].copy_(self._slot_rows[last])
            self.bytes_moved += self.layout.slot_bytes
            self._slot_at[hole] = moved
            self._slot_position[moved] = hole
        self._slot_at.pop()
        del self._slot_position[handle]

    # ---- pages ------------------------------------------------------------------------------------
    def _page_depth_to_position(self, depth: int) -> int:
        return self.num_page_positions - 1 - depth

    def alloc_pages(self, n: int) -> list[PageHandle] | None:
        if n < 0:
            raise ValueError(f"alloc_pages(n={n}): n must be non-negative")
        if not self.can_allocate(0, n):
            return None
        handles = []
        for _ in range(n):
            handle = self._new_page_handle(self._page_depth_to_position(len(self._page_at)))
            self._page_at.append(handle)
            handles.append(handle)
        return handles

    def free_pages(self, handles: Iterable[PageHandle]) -> None:
        """Frees all `handles` at once, moving only the pages that survive: the new innermost boundary is
        known, so each surviving page beyond it moves into one hole inside it (the fewest bytes possible)."""
        freed = self._live_distinct_pages(handles)
        if not freed:
            return
        freed_depths = {self._page_at_depth(handle) for handle in freed}
        new_count = len(self._page_at) - len(freed)
        holes = sorted(depth for depth in freed_depths if depth < new_count)
        movers = [depth for depth in range(new_count, len(self._page_at)) if depth not in freed_depths]
        assert len(holes) == len(movers)
        if holes:
            dst, src = index_tables([[self._page_depth_to_position(d) for d in holes],       # no wait for the GPU
                                     [self._page_depth_to_position(d) for d in movers]], self.device, torch.int64)
            self._page_rows[dst] = self._page_rows[src]        # [num_moved, page_bytes]; src and dst disjoint
            self.bytes_moved += len(holes) * self.layout.page_bytes
            for hole, mover in zip(holes, movers):
                moved = self._page_at[mover]
                self._page_at[hole] = moved
                self._page_position[moved] = self._page_depth_to_position(hole)
        for handle in freed:
            del self._page_position[handle]
        del self._page_at[new_count:]

    def _page_at_depth(self, handle: int) -> int:
        return self.num_page_positions - 1 - self._page_position[handle]

    # ---- integrity --------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        self._check_handles()
        num_slots, num_pages = len(self._slot_at), len(self._page_at)
        assert num_slots == len(self._slot_position), \
            f"slot table has {num_slots} positions but {len(self._slot_position)} live handles"
        assert num_pages == len(self._page_position), \
            f"page table has {num_pages} positions but {len(self._page_position)} live handles"
        for position, handle in enumerate(self._slot_at):
            assert self._slot_position.get(handle) == position, \
                f"slot handle {handle} sits at position {position} but maps to {self._slot_position.get(handle)}"
        assert sorted(self._slot_position.values()) == list(range(num_slots)), \
            f"slots must occupy exactly positions 0..{num_slots - 1}"
        for depth, handle in enumerate(self._page_at):
            position = self._page_depth_to_position(depth)
            assert self._page_position.get(handle) == position, \
                f"page handle {handle} sits at position {position} but maps to {self._page_position.get(handle)}"
        top = self.num_page_positions
        assert sorted(self._page_position.values()) == list(range(top - num_pages, top)), \
            f"pages must occupy exactly the top {num_pages} positions {top - num_pages}..{top - 1}"
        assert self.left_boundary <= self.right_boundary, \
            f"slots end at byte {self.left_boundary} but pages start at byte {self.right_boundary}: they overlap"

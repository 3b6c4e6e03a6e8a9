"""The static dual pool: two partitions fixed at start-up, the baseline the unified pool replaces.

    byte 0                       page_base                                       capacity
    | KDA partition: num_slot_positions slots | MLA partition: num_page_positions pages |

Each partition hands out free positions from its own free list and never lends to the other: when the MLA
partition is full a request is refused even if the KDA partition sits mostly empty (and the other way round).
Nothing ever moves, so `bytes_moved` stays 0.
"""
from __future__ import annotations

from typing import Iterable

import torch

from k3core.memory.arena import ArenaPool
from k3core.memory.layout import PageHandle, PoolLayout, SlotHandle


class StaticDualPool(ArenaPool):

    def __init__(self, layout: PoolLayout, capacity_bytes: int, device: torch.device | str = "cpu", *,
                 kda_fraction: float = 0.5, num_slots: int | None = None) -> None:
        """The KDA partition holds `num_slots` slots, or (when None) as many as fit in `kda_fraction` of the
        capacity; the MLA partition takes the rest in whole pages."""
        slot_bytes, page_bytes = layout.slot_bytes, layout.page_bytes
        capacity_bytes = int(capacity_bytes)
        if num_slots is None:
            if not 0.0 < kda_fraction < 1.0:
                raise ValueError(f"kda_fraction={kda_fraction} must be in (0, 1): both partitions need room")
            num_slots = int(capacity_bytes * kda_fraction) // slot_bytes
        page_base = num_slots * slot_bytes
        num_page_positions = max(capacity_bytes - page_base, 0) // page_bytes
        if num_slots < 1 or num_page_positions < 1:
            raise ValueError(
                f"capacity_bytes={capacity_bytes} split as {num_slots} KDA slots ({slot_bytes} B each) leaves "
                f"{num_page_positions} MLA pages ({page_bytes} B each); each partition needs at least one block, "
                "so give the pool more memory or move the split")
        super().__init__(layout, page_base + num_page_positions * page_bytes, device, page_base=page_base,
                         num_slot_positions=num_slots, num_page_positions=num_page_positions)
        # Free lists popped from the end; reversed so the lowest positions are handed out first.
        self._free_slot_positions = list(range(num_slots - 1, -1, -1))
        self._free_page_positions = list(range(num_page_positions - 1, -1, -1))

    @property
    def kda_partition_bytes(self) -> int:
        return self.page_base

    @property
    def mla_partition_bytes(self) -> int:
        return self.capacity_bytes - self.page_base

    def _free_bytes(self) -> int:
        return (len(self._free_slot_positions) * self.layout.slot_bytes
                + len(self._free_page_positions) * self.layout.page_bytes)

    def can_allocate(self, num_slots: int, num_pages: int) -> bool:
        return num_slots <= len(self._free_slot_positions) and num_pages <= len(self._free_page_positions)

    def alloc_slot(self) -> SlotHandle | None:
        if not self._free_slot_positions:
            return None
        return self._new_slot_handle(self._free_slot_positions.pop())

    def free_slot(self, handle: SlotHandle) -> None:
        position = self._slot_position[self._live_slot(handle)]
        del self._slot_position[handle]
        self._free_slot_positions.append(position)

    def alloc_pages(self, n: int) -> list[PageHandle] | None:
        if n < 0:
            raise ValueError(f"alloc_pages(n={n}): n must be non-negative")
        if n > len(self._free_page_positions):
            return None
        return [self._new_page_handle(self._free_page_positions.pop()) for _ in range(n)]

    def free_pages(self, handles: Iterable[PageHandle]) -> None:
        for handle in self._live_distinct_pages(handles):
            self._free_page_positions.append(self._page_position.pop(handle))

    def check_invariants(self) -> None:
        self._check_handles()
        for kind, table, free, num_positions in (
                ("slot", self._slot_position, self._free_slot_positions, self.num_slot_positions),
                ("page", self._page_position, self._free_page_positions, self.num_page_positions)):
            used = list(table.values())
            assert len(set(free)) == len(free), f"a free {kind} position is listed twice: {sorted(free)[:10]}"
            assert not set(used) & set(free), \
                f"{kind} positions {sorted(set(used) & set(free))[:5]} are both live and free"
            assert sorted(used + free) == list(range(num_positions)), \
                f"live + free {kind} positions do not cover the partition's {num_positions} positions exactly once"
        assert self.bytes_moved == 0, f"the static pool never moves bytes, yet bytes_moved={self.bytes_moved}"

"""The byte arena both pools share, the strided state views into it, and the handle -> position tables.

Views: slot position i starts at byte `i * slot_bytes` (from the arena's left end); page position p starts at
`page_base + p * page_bytes`. The views of all positions cover the arena and may overlap each other in bytes
(a slot position and a page position can name the same bytes); the allocator, not the views, guarantees that
live blocks never overlap. Views are built once and never change: compaction moves bytes and rewrites the
indirection tables, never the views.

Handles are stable ids, never reused; a position is valid until the next free (a free may compact).
"""
from __future__ import annotations

import abc
from typing import Iterable, TypeVar

import torch

from k3core.memory.layout import (ALIGN_BYTES, PageHandle, PoolError, PoolLayout, PoolUsage, SlotHandle,
                                  free_device_bytes)

PoolT = TypeVar("PoolT", bound="ArenaPool")


class ArenaPool(abc.ABC):
    """Interface of a KDA-slot + MLA-page pool (rules every implementation keeps):

    * `alloc_*` returns None when the request does not fit (never a sentinel id); `alloc_pages` is all or nothing.
    * positions never change on allocation; a free may move other blocks (their handles stay valid, their
      positions change, their bytes are preserved), so re-read positions after every free.
    * freeing a handle that is not live raises `PoolError` and leaves the pool unchanged.
    * `check_invariants()` raises AssertionError naming the broken rule.
    """

    def __init__(self, layout: PoolLayout, arena_bytes: int, device: torch.device | str,
                 page_base: int, num_slot_positions: int, num_page_positions: int) -> None:
        assert arena_bytes % ALIGN_BYTES == 0 and page_base % ALIGN_BYTES == 0
        self.layout = layout
        self.device = torch.device(device)
        self.capacity_bytes = arena_bytes
        self.page_base = page_base
        self.num_slot_positions = num_slot_positions
        self.num_page_positions = num_page_positions
        self.arena = torch.zeros(arena_bytes, dtype=torch.uint8, device=self.device)   # [capacity] bytes
        self.bytes_moved = 0                                                           # by compaction only
        self._slot_position: dict[int, int] = {}
        self._page_position: dict[int, int] = {}
        self._next_slot_handle = 0
        self._next_page_handle = 0
        slot_bytes, page_bytes = layout.slot_bytes, layout.page_bytes
        # Whole blocks as rows of bytes: compaction and copy-on-write copy rows, whatever the dtypes inside.
        self._slot_rows = self.arena[:num_slot_positions * slot_bytes].view(num_slot_positions, slot_bytes)
        self._page_rows = self.arena[page_base:page_base + num_page_positions * page_bytes].view(
            num_page_positions, page_bytes)
        self._kda_state_views = [
            self._strided(layout.state_dtype, layer * layout.state_layer_bytes, slot_bytes,
                          num_slot_positions, layout.state_shape)
            for layer in range(layout.num_kda_layers)]
        self._conv_state_views = [
            self._strided(layout.conv_dtype, layout.conv_offset + layer * layout.conv_layer_bytes, slot_bytes,
                          num_slot_positions, layout.conv_shape)
            for layer in range(layout.num_kda_layers)]
        self._mla_kv_views = [
            self._strided(layout.kv_dtype, page_base + layer * layout.page_layer_bytes, page_bytes,
                          num_page_positions, layout.page_shape)
            for layer in range(layout.num_mla_layers)]

    @classmethod
    def from_free_memory(cls: type[PoolT], layout: PoolLayout, fraction: float,
                         device: torch.device | str = "cuda", **kwargs) -> PoolT:
        """A pool taking `fraction` of the memory free on `device` now (call after the weights are loaded)."""
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction={fraction} must be in (0, 1]; it is the share of free memory to take")
        return cls(layout, int(free_device_bytes(device) * fraction), device, **kwargs)

    def _strided(self, dtype: torch.dtype, byte_offset: int, position_bytes: int, num_positions: int,
                 inner_shape: tuple[int, ...]) -> torch.Tensor:
        itemsize = dtype.itemsize
        assert byte_offset % itemsize == 0 and position_bytes % itemsize == 0
        inner_strides, stride = [], 1
        for size in reversed(inner_shape):
            inner_strides.insert(0, stride)
            stride *= size
        typed = self.arena.view(dtype)                                   # [capacity / itemsize]
        return typed.as_strided((num_positions, *inner_shape), (position_bytes // itemsize, *inner_strides),
                                byte_offset // itemsize)

    # ---- views ------------------------------------------------------------------------------------
    def kda_state(self, kda_layer: int) -> torch.Tensor:
        """[num_slot_positions, H, V, K] state-dtype view; index with `slot_position`."""
        return self._kda_state_views[kda_layer]

    def conv_state(self, kda_layer: int) -> torch.Tensor:
        """[num_slot_positions, window, C] conv-dtype view; index with `slot_position`."""
        return self._conv_state_views[kda_layer]

    def mla_kv(self, mla_layer: int) -> torch.Tensor:
        """[num_page_positions, page_size, D_latent] kv-dtype view; index with `page_positions`."""
        return self._mla_kv_views[mla_layer]

    # ---- handles ----------------------------------------------------------------------------------
    def slot_position(self, handle: SlotHandle) -> int:
        """Index into `kda_state`/`conv_state`; valid until the next free."""
        return self._slot_position[self._live_slot(handle)]

    def page_positions(self, handles: Iterable[PageHandle]) -> torch.Tensor:
        """int32 [len(handles)] indices into `mla_kv`, on the CPU (the scheduler builds a batch's page
        table on the host and moves it once); valid until the next free."""
        positions = [self._page_position[self._live_page(handle)] for handle in handles]
        return torch.tensor(positions, dtype=torch.int32)

    def _live_slot(self, handle: SlotHandle) -> int:
        if handle not in self._slot_position:
            raise PoolError(f"slot handle {handle} is not live in this pool (already freed, or never allocated "
                            "here); free each slot exactly once and only in the pool that allocated it")
        return handle

    def _live_page(self, handle: PageHandle) -> int:
        if handle not in self._page_position:
            raise PoolError(f"page handle {handle} is not live in this pool (already freed, or never allocated "
                            "here); free each page exactly once and only in the pool that allocated it")
        return handle

    def _live_distinct_pages(self, handles: Iterable[PageHandle]) -> list[int]:
        handles = [self._live_page(handle) for handle in handles]
        if len(set(handles)) != len(handles):
            raise PoolError(f"free_pages got a page handle more than once ({sorted(handles)}); "
                            "pass each page once")
        return handles

    def _new_slot_handle(self, position: int) -> SlotHandle:
        handle = self._next_slot_handle
        self._next_slot_handle += 1
        self._slot_position[handle] = position
        return SlotHandle(handle)

    def _new_page_handle(self, position: int) -> PageHandle:
        handle = self._next_page_handle
        self._next_page_handle += 1
        self._page_position[handle] = position
        return PageHandle(handle)

    # ---- data -------------------------------------------------------------------------------------
    def copy_slot(self, src: SlotHandle, dst: SlotHandle) -> None:
        """Copy-on-write: a read-only checkpoint's state (every KDA layer, recurrent and conv) into a working slot."""
        src_position, dst_position = self.slot_position(src), self.slot_position(dst)
        if src_position != dst_position:
            self._slot_rows[dst_position].copy_(self._slot_rows[src_position])

    def copy_page(self, src: PageHandle, dst: PageHandle) -> None:
        src_position, dst_position = self.page_positions([src, dst]).tolist()
        if src_position != dst_position:
            self._page_rows[dst_position].copy_(self._page_rows[src_position])

    def zero_slot(self, handle: SlotHandle) -> None:
        """A fresh request's state: zero recurrent state and zero conv history."""
        self._slot_rows[self.slot_position(handle)].zero_()

    # ---- accounting -------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return len(self._slot_position)

    @property
    def num_pages(self) -> int:
        return len(self._page_position)

    def usage(self) -> PoolUsage:
        kda_bytes = self.num_slots * self.layout.slot_bytes
        mla_bytes = self.num_pages * self.layout.page_bytes
        return PoolUsage(kda_bytes=kda_bytes, mla_bytes=mla_bytes, free_bytes=self._free_bytes(),
                         capacity_bytes=self.capacity_bytes, num_slots=self.num_slots, num_pages=self.num_pages)

    def _check_handles(self) -> None:
        """Rules common to both pools: live handles were issued here, and no two share a position."""
        for kind, table, next_handle in (("slot", self._slot_position, self._next_slot_handle),
                                         ("page", self._page_position, self._next_page_handle)):
            stray = [handle for handle in table if not 0 <= handle < next_handle]
            assert not stray, f"{kind} handles {stray[:5]} were never issued by this pool"
            positions = list(table.values())
            assert len(set(positions)) == len(positions), \
                f"two live {kind}s share a position: {sorted(positions)[:10]}..."
        usage = self.usage()
        used = usage.kda_bytes + usage.mla_bytes
        assert used + usage.free_bytes == self.capacity_bytes, \
            f"free ({usage.free_bytes}) + used ({used}) != capacity ({self.capacity_bytes})"
        assert self.bytes_moved >= 0, f"bytes_moved is negative ({self.bytes_moved})"

    # ---- what each pool decides -------------------------------------------------------------------
    @abc.abstractmethod
    def alloc_slot(self) -> SlotHandle | None: ...

    @abc.abstractmethod
    def free_slot(self, handle: SlotHandle) -> None: ...

    @abc.abstractmethod
    def alloc_pages(self, n: int) -> list[PageHandle] | None: ...

    @abc.abstractmethod
    def free_pages(self, handles: Iterable[PageHandle]) -> None: ...

    @abc.abstractmethod
    def can_allocate(self, num_slots: int, num_pages: int) -> bool: ...

    @abc.abstractmethod
    def check_invariants(self) -> None: ...

    @abc.abstractmethod
    def _free_bytes(self) -> int: ...

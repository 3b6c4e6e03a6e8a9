"""k3core.memory: layout sizes, views into the arena, two-ended allocation, compaction, the static baseline.

Data checks are exact (torch.equal): the pools only copy bytes, so any difference is a bug, not rounding.
"""
from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3core.config import ModelConfig
from k3core.memory import (ALIGN_BYTES, PoolError, PoolLayout, StaticDualPool, UnifiedPool)

POOLS = (UnifiedPool, StaticDualPool)
DEVICE = os.environ.get("K3CORE_TEST_DEVICE", "cpu")   # the pools are device-agnostic; CI runs them on the CPU


def small_layout(conv_dtype: torch.dtype = torch.bfloat16, kv_dtype: torch.dtype = torch.bfloat16) -> PoolLayout:
    # Awkward sizes on purpose: no piece is a multiple of 256 bytes before padding.
    return PoolLayout(num_kda_layers=3, kda_heads=2, kda_head_dim=5, conv_channels=30, conv_window=3,
                      state_dtype=torch.float32, conv_dtype=conv_dtype, num_mla_layers=2, page_size=3,
                      latent_width=7, kv_dtype=kv_dtype)


def make_pool(cls, layout: PoolLayout, num_slot_blocks: int, num_page_blocks: int):
    """A pool with room for about this many slots and pages (the static pool split exactly so)."""
    capacity = num_slot_blocks * layout.slot_bytes + num_page_blocks * layout.page_bytes
    if cls is StaticDualPool:
        return StaticDualPool(layout, capacity, DEVICE, num_slots=num_slot_blocks)
    return UnifiedPool(layout, capacity, DEVICE)


class Shadow:
    """Random contents written through the public views at allocation, and the copy every handle must keep."""

    def __init__(self, pool, seed: int) -> None:
        self.pool, self.generator = pool, torch.Generator().manual_seed(seed)
        self.slots: dict[int, list[torch.Tensor]] = {}
        self.pages: dict[int, list[torch.Tensor]] = {}

    def _random(self, like: torch.Tensor) -> torch.Tensor:
        return torch.randn(like.shape, generator=self.generator, dtype=torch.float32).to(like.device, like.dtype)

    def write_slot(self, handle) -> None:
        position, layout, data = self.pool.slot_position(handle), self.pool.layout, []
        for layer in range(layout.num_kda_layers):
            for view in (self.pool.kda_state(layer), self.pool.conv_state(layer)):
                value = self._random(view[position])
                view[position] = value
                data.append(value)
        self.slots[handle] = data

    def write_pages(self, handles) -> None:
        positions = self.pool.page_positions(handles).long()
        for index, handle in enumerate(handles):
            data = []
            for layer in range(self.pool.layout.num_mla_layers):
                view = self.pool.mla_kv(layer)
                value = self._random(view[positions[index]])
                view[positions[index]] = value
                data.append(value)
            self.pages[handle] = data

    def check(self) -> None:
        layout = self.pool.layout
        for handle, data in self.slots.items():
            position = self.pool.slot_position(handle)
            views = [view for layer in range(layout.num_kda_layers)
                     for view in (self.pool.kda_state(layer), self.pool.conv_state(layer))]
            for view, value in zip(views, data):
                assert torch.equal(view[position], value), f"slot {handle} lost its bytes"
        if self.pages:
            positions = self.pool.page_positions(list(self.pages)).long()
            for index, (handle, data) in enumerate(self.pages.items()):
                for layer, value in enumerate(data):
                    assert torch.equal(self.pool.mla_kv(layer)[positions[index]], value), \
                        f"page {handle} lost its bytes"


# ---- layout ---------------------------------------------------------------------------------------
def test_k3_layout_sizes_match_the_architecture():
    layout = PoolLayout.from_config(ModelConfig.preset("k3"), page_size=1)
    # K3_ARCHITECTURE.md 5.1/5.2: 69 x (96*128*128*4 + 3*36864*2) B per request; 24 x 576 x 2 B per token.
    assert layout.slot_bytes == 69 * (96 * 128 * 128 * 4 + 3 * 36864 * 2)
    assert layout.page_bytes == 24 * 576 * 2
    tp8 = PoolLayout.from_config(ModelConfig.preset("k3"), page_size=64, tp_size=8)
    assert tp8.kda_heads == 12 and tp8.conv_channels == 36864 // 8 and tp8.latent_width == 576
    with pytest.raises(ValueError, match="tp_size=5"):
        PoolLayout.from_config(ModelConfig.preset("k3"), page_size=1, tp_size=5)


def test_layout_pads_blocks_and_conv_offset_to_alignment():
    layout = small_layout()
    state = 3 * 2 * 5 * 5 * 4
    assert layout.conv_offset == -(-state // ALIGN_BYTES) * ALIGN_BYTES
    assert layout.slot_bytes % ALIGN_BYTES == 0 and layout.slot_bytes >= layout.conv_offset + 3 * 3 * 30 * 2
    assert layout.page_bytes % ALIGN_BYTES == 0 and layout.page_bytes >= 2 * 3 * 7 * 2


# ---- views ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", POOLS)
def test_views_are_strided_windows_on_the_arena_bytes(cls):
    layout = small_layout(kv_dtype=torch.float32)
    pool = make_pool(cls, layout, 4, 6)
    slot, pages = pool.alloc_slot(), pool.alloc_pages(2)
    for layer in range(layout.num_kda_layers):
        state, conv = pool.kda_state(layer), pool.conv_state(layer)
        assert state.shape == (pool.num_slot_positions, 2, 5, 5) and state.dtype == torch.float32
        assert conv.shape == (pool.num_slot_positions, 3, 30) and conv.dtype == torch.bfloat16
        assert state[0].is_contiguous() and conv[0].is_contiguous()
    for layer in range(layout.num_mla_layers):
        kv = pool.mla_kv(layer)
        assert kv.shape == (pool.num_page_positions, 3, 7) and kv[0].is_contiguous()
    # Writing through a view lands at the documented byte offsets.
    slot_position = pool.slot_position(slot)
    value = torch.randn(2, 5, 5, device=DEVICE)
    pool.kda_state(2)[slot_position] = value                                         # [H, V, K]
    start = slot_position * layout.slot_bytes + 2 * layout.state_layer_bytes
    assert torch.equal(pool.arena[start:start + layout.state_layer_bytes].view(torch.float32).view(2, 5, 5), value)
    conv_value = torch.randn(3, 30, device=DEVICE).to(torch.bfloat16)
    pool.conv_state(1)[slot_position] = conv_value                                   # [window, C]
    start = slot_position * layout.slot_bytes + layout.conv_offset + layout.conv_layer_bytes
    assert torch.equal(pool.arena[start:start + layout.conv_layer_bytes].view(torch.bfloat16).view(3, 30),
                       conv_value)
    page_position = int(pool.page_positions(pages[1:])[0])
    kv_value = torch.randn(3, 7, device=DEVICE)
    pool.mla_kv(1)[page_position] = kv_value                                         # [page_size, D_latent]
    start = pool.page_base + page_position * layout.page_bytes + layout.page_layer_bytes
    assert torch.equal(pool.arena[start:start + layout.page_layer_bytes].view(torch.float32).view(3, 7), kv_value)
    # Block starts are 256-byte aligned, so a float32 or bf16 view of any block is legal.
    assert (pool.page_base + page_position * layout.page_bytes) % ALIGN_BYTES == 0


def test_unified_pool_fills_from_both_ends_and_positions_hold_on_allocation():
    layout = small_layout()
    pool = make_pool(UnifiedPool, layout, 3, 5)
    top = pool.num_page_positions
    first = pool.alloc_pages(2)
    assert pool.page_positions(first).tolist() == [top - 1, top - 2]   # the first page gets the highest position
    slots = [pool.alloc_slot() for _ in range(2)]
    assert [pool.slot_position(s) for s in slots] == [0, 1]
    more = pool.alloc_pages(1)
    assert pool.page_positions(first + more).tolist() == [top - 1, top - 2, top - 3]
    assert [pool.slot_position(s) for s in slots] == [0, 1]
    pool.check_invariants()


# ---- allocation limits ----------------------------------------------------------------------------
@pytest.mark.parametrize("cls", POOLS)
def test_allocation_returns_none_when_full_and_pages_are_all_or_nothing(cls):
    pool = make_pool(cls, small_layout(), 2, 4)
    assert pool.alloc_pages(0) == []
    assert pool.alloc_slot() is not None and pool.alloc_slot() is not None
    assert pool.alloc_pages(3) is not None
    before = pool.usage()
    assert not pool.can_allocate(0, 2) and pool.alloc_pages(2) is None
    assert pool.usage() == before and pool.num_pages == 3
    assert pool.alloc_pages(1) is not None
    assert pool.alloc_slot() is None and pool.alloc_pages(1) is None and pool.usage().free_bytes == 0
    with pytest.raises(ValueError, match="non-negative"):
        pool.alloc_pages(-1)
    pool.check_invariants()


def test_unified_pool_lends_free_bytes_to_either_kind_where_static_refuses():
    layout = PoolLayout(num_kda_layers=1, kda_heads=1, kda_head_dim=8, conv_channels=128, conv_window=2,
                        state_dtype=torch.float32, conv_dtype=torch.bfloat16, num_mla_layers=1, page_size=1,
                        latent_width=128, kv_dtype=torch.bfloat16)
    assert layout.slot_bytes == 3 * layout.page_bytes                 # the launch write-up's toy: slot = 3 pages
    unified = UnifiedPool(layout, 12 * layout.page_bytes, DEVICE)
    static = StaticDualPool(layout, 12 * layout.page_bytes, DEVICE, num_slots=2)   # 6 pages KDA | 6 pages MLA
    for pool in (unified, static):
        assert pool.alloc_slot() is not None
    assert unified.alloc_pages(9) is not None                         # takes the KDA side's idle bytes
    assert static.alloc_pages(9) is None and static.usage().free_bytes == 9 * layout.page_bytes
    assert unified.alloc_slot() is None and unified.usage().free_bytes == 0
    for pool in (unified, static):
        pool.check_invariants()


@pytest.mark.parametrize("cls", POOLS)
def test_capacity_too_small_is_refused_with_a_reason(cls):
    layout = small_layout()
    with pytest.raises(ValueError, match="capacity_bytes"):
        cls(layout, layout.slot_bytes, DEVICE)


@pytest.mark.parametrize("cls", POOLS)
def test_from_free_memory_takes_a_fraction_of_free_host_memory(cls):
    pool = cls.from_free_memory(small_layout(), 1e-6, DEVICE)
    assert pool.arena.device.type == torch.device(DEVICE).type and pool.capacity_bytes > 0
    with pytest.raises(ValueError, match="fraction"):
        cls.from_free_memory(small_layout(), 1.5, DEVICE)


# ---- frees and compaction -------------------------------------------------------------------------
def test_freeing_a_middle_slot_moves_the_last_slot_and_keeps_its_bytes():
    pool = make_pool(UnifiedPool, small_layout(), 4, 2)
    shadow = Shadow(pool, seed=random.randrange(1 << 30))
    slots = [pool.alloc_slot() for _ in range(4)]
    for slot in slots:
        shadow.write_slot(slot)
    pool.free_slot(slots[1])
    del shadow.slots[slots[1]]
    assert pool.slot_position(slots[3]) == 1 and pool.bytes_moved == pool.layout.slot_bytes
    shadow.check()
    pool.free_slot(slots[2])                                           # the last one: nothing moves
    del shadow.slots[slots[2]]
    assert pool.bytes_moved == pool.layout.slot_bytes
    shadow.check()
    pool.check_invariants()


def test_freeing_pages_moves_only_survivors_beyond_the_new_boundary():
    layout = small_layout()
    pool = make_pool(UnifiedPool, layout, 1, 8)
    shadow = Shadow(pool, seed=random.randrange(1 << 30))
    pages = pool.alloc_pages(8)
    shadow.write_pages(pages)
    # Free depths 1, 3 and 6: survivors at depths 5 and 7 move into holes 1 and 3; depth 6 is just dropped.
    pool.free_pages([pages[3], pages[6], pages[1]])
    for handle in (pages[1], pages[3], pages[6]):
        del shadow.pages[handle]
    assert pool.bytes_moved == 2 * layout.page_bytes
    shadow.check()
    pool.check_invariants()


@pytest.mark.parametrize("cls", POOLS)
def test_bad_frees_raise_and_leave_the_pool_unchanged(cls):
    pool = make_pool(cls, small_layout(), 2, 4)
    slot, pages = pool.alloc_slot(), pool.alloc_pages(3)
    pool.free_slot(slot)
    with pytest.raises(PoolError, match="not live"):
        pool.free_slot(slot)
    with pytest.raises(PoolError, match="not live"):
        pool.free_slot(12345)
    before = (pool.usage(), pool.page_positions(pages).tolist())
    with pytest.raises(PoolError, match="more than once"):
        pool.free_pages([pages[0], pages[0]])
    with pytest.raises(PoolError, match="not live"):
        pool.free_pages([pages[1], 999])
    assert (pool.usage(), pool.page_positions(pages).tolist()) == before
    pool.free_pages(pages)
    with pytest.raises(PoolError, match="not live"):
        pool.page_positions(pages[:1])
    pool.check_invariants()


@pytest.mark.parametrize("cls", POOLS)
def test_copy_and_zero(cls):
    pool = make_pool(cls, small_layout(), 3, 3)
    shadow = Shadow(pool, seed=random.randrange(1 << 30))
    checkpoint, working = pool.alloc_slot(), pool.alloc_slot()
    shadow.write_slot(checkpoint)
    shadow.write_slot(working)
    pool.copy_slot(checkpoint, working)
    shadow.slots[working] = [value.clone() for value in shadow.slots[checkpoint]]
    pages = pool.alloc_pages(2)
    shadow.write_pages(pages)
    pool.copy_page(pages[0], pages[1])
    shadow.pages[pages[1]] = [value.clone() for value in shadow.pages[pages[0]]]
    shadow.check()
    pool.zero_slot(working)
    shadow.slots[working] = [torch.zeros_like(value) for value in shadow.slots[working]]
    shadow.check()


# ---- the checker really checks --------------------------------------------------------------------
def test_check_invariants_catches_corrupted_tables():
    pool = make_pool(UnifiedPool, small_layout(), 3, 4)
    slots, pages = [pool.alloc_slot() for _ in range(2)], pool.alloc_pages(3)
    pool.check_invariants()
    pool._slot_position[slots[0]] = 1                                   # two slots at one position
    with pytest.raises(AssertionError, match="share a position"):
        pool.check_invariants()
    pool._slot_position[slots[0]] = 0
    pool._page_position[pages[2]] -= 1                                  # a gap in the page side
    with pytest.raises(AssertionError):
        pool.check_invariants()
    pool._page_position[pages[2]] += 1
    pool._page_at.append(pool._page_at[0])                              # table longer than live handles
    with pytest.raises(AssertionError):
        pool.check_invariants()
    pool._page_at.pop()
    pool.check_invariants()

    static = make_pool(StaticDualPool, small_layout(), 2, 3)
    (page,) = static.alloc_pages(1)
    static.check_invariants()
    static._free_page_positions[:] = [2, 2]                             # a position free twice, one lost
    with pytest.raises(AssertionError, match="listed twice"):
        static.check_invariants()
    static._free_page_positions[:] = [2, static._page_position[page]]   # a live position also free
    with pytest.raises(AssertionError, match="both live and free"):
        static.check_invariants()


# ---- random sequences -----------------------------------------------------------------------------
OPS = st.lists(st.tuples(st.sampled_from(["slot", "pages", "free_slot", "free_pages", "copy_slot"]),
                         st.integers(0, 4), st.integers(0, 1 << 20)), min_size=1, max_size=60)


@pytest.mark.parametrize("cls", POOLS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, seed=st.integers(0, 1 << 30), num_slot_blocks=st.integers(1, 5),
       num_page_blocks=st.integers(1, 12))
def test_random_alloc_free_sequences_keep_invariants_and_data(cls, ops, seed, num_slot_blocks, num_page_blocks):
    pool = make_pool(cls, small_layout(), num_slot_blocks, num_page_blocks)
    shadow, rng = Shadow(pool, seed), random.Random(seed)
    live_slots, live_pages = [], []
    for op, count, pick in ops:
        if op == "slot":
            fits = pool.can_allocate(1, 0)
            handle = pool.alloc_slot()
            assert (handle is not None) == fits, "can_allocate disagrees with alloc_slot"
            if handle is not None:
                live_slots.append(handle)
                shadow.write_slot(handle)
        elif op == "pages":
            fits = pool.can_allocate(0, count)
            handles = pool.alloc_pages(count)
            assert (handles is not None) == fits, "can_allocate disagrees with alloc_pages"
            if handles:
                live_pages.extend(handles)
                shadow.write_pages(handles)
        elif op == "free_slot" and live_slots:
            handle = live_slots.pop(pick % len(live_slots))
            pool.free_slot(handle)
            del shadow.slots[handle]
        elif op == "free_pages" and live_pages:
            chosen = rng.sample(live_pages, min(count + 1, len(live_pages)))
            pool.free_pages(chosen)
            for handle in chosen:
                live_pages.remove(handle)
                del shadow.pages[handle]
        elif op == "copy_slot" and len(live_slots) >= 2:
            src, dst = rng.sample(live_slots, 2)
            pool.copy_slot(src, dst)
            shadow.slots[dst] = [value.clone() for value in shadow.slots[src]]
        pool.check_invariants()
        shadow.check()
        assert pool.num_slots == len(live_slots) and pool.num_pages == len(live_pages)
    if cls is UnifiedPool:
        # Everything freed: the free region is the whole arena again.
        pool.free_pages(live_pages)
        for handle in live_slots:
            pool.free_slot(handle)
        assert pool.usage().free_bytes == pool.capacity_bytes
        pool.check_invariants()

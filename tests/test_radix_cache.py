"""Tests of the copy-on-write radix cache (k3core/cache) against a small fake pool and the real UnifiedPool.

Every checkpoint slot and page carries recognisable data written through the pool's views: a slot holds a tag
derived from the exact prefix it is the state of, and a page holds its token ids (+1, so a zero page never passes).
A hit is accepted only when its checkpoint tag, shared pages and partial page spell exactly the query's prefix, so a
checkpoint attached to the wrong prefix (after a split, an eviction, a compaction move) fails loudly.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3core.cache import EvictResult, RadixCache

PAGE_SIZE = 4
INTERVAL = 8


# ------------------------------------------------------------------------------------------------ fake pool
class FakePool:
    """Obeys the k3core.memory pool API with separate slot and page capacities. Positions are kept dense and a free
    moves the last block into the hole (like the unified pool's compaction), so a cache that caches positions
    across frees reads the wrong data."""

    def __init__(self, max_slots: int, max_pages: int, page_size: int) -> None:
        self.max_slots, self.max_pages, self.page_size = max_slots, max_pages, page_size
        self._kda = torch.zeros(max_slots, 1, 1, 1)            # [slots, H, V, K]
        self._mla = torch.zeros(max_pages, page_size, 1)       # [pages, page_size, latent]
        self._slot_pos: dict[int, int] = {}
        self._page_pos: dict[int, int] = {}
        self._next_id = 1000
        self.bytes_moved = 0

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    @staticmethod
    def _free(positions: dict[int, int], data: torch.Tensor, handle: int) -> None:
        if handle not in positions:
            raise AssertionError(f"fake pool: handle {handle} freed twice or never allocated")
        hole = positions.pop(handle)
        last = len(positions)
        for other, pos in positions.items():
            if pos == last:                     # compaction: the last block moves into the hole
                data[hole] = data[last]
                positions[other] = hole
        data[last] = float("nan")               # stale reads of a freed block show up as NaN

    def alloc_slot(self) -> Optional[int]:
        if len(self._slot_pos) >= self.max_slots:
            return None
        handle = self._new_id()
        self._slot_pos[handle] = len(self._slot_pos)
        return handle

    def free_slot(self, handle: int) -> None:
        self._free(self._slot_pos, self._kda, handle)

    def alloc_pages(self, n: int) -> Optional[list[int]]:
        if len(self._page_pos) + n > self.max_pages:
            return None
        handles = []
        for _ in range(n):
            handle = self._new_id()
            self._page_pos[handle] = len(self._page_pos)
            handles.append(handle)
        return handles

    def free_pages(self, handles) -> None:
        for handle in handles:
            self._free(self._page_pos, self._mla, handle)

    def copy_slot(self, src: int, dst: int) -> None:
        self._kda[self._slot_pos[dst]] = self._kda[self._slot_pos[src]]

    def copy_page(self, src: int, dst: int) -> None:
        self._mla[self._page_pos[dst]] = self._mla[self._page_pos[src]]

    def zero_slot(self, handle: int) -> None:
        self._kda[self._slot_pos[handle]] = 0.0

    def can_allocate(self, num_slots: int, num_pages: int) -> bool:
        return (len(self._slot_pos) + num_slots <= self.max_slots
                and len(self._page_pos) + num_pages <= self.max_pages)

    def slot_position(self, handle: int) -> int:
        return self._slot_pos[handle]

    def page_positions(self, handles) -> torch.Tensor:
        return torch.tensor([self._page_pos[h] for h in handles], dtype=torch.int32)

    def kda_state(self, kda_layer: int) -> torch.Tensor:
        return self._kda

    def mla_kv(self, mla_layer: int) -> torch.Tensor:
        return self._mla

    def num_used(self) -> tuple[int, int]:
        return len(self._slot_pos), len(self._page_pos)

    def check_invariants(self) -> None:
        assert sorted(self._slot_pos.values()) == list(range(len(self._slot_pos))), "slot positions not dense"
        assert sorted(self._page_pos.values()) == list(range(len(self._page_pos))), "page positions not dense"


def _unified_pool(max_slots: int, max_pages: int, page_size: int):
    memory = pytest.importorskip("k3core.memory")
    if not hasattr(memory, "UnifiedPool"):
        pytest.skip("k3core.memory does not export UnifiedPool yet")
    # float32 KV so token ids round-trip exactly; tiny shapes keep slots and pages cheap.
    layout = memory.PoolLayout(num_kda_layers=1, kda_heads=1, kda_head_dim=2, conv_channels=2, conv_window=1,
                               state_dtype=torch.float32, conv_dtype=torch.float32, num_mla_layers=1,
                               page_size=page_size, latent_width=2, kv_dtype=torch.float32)
    pool = memory.UnifiedPool(layout, max_slots * layout.slot_bytes + max_pages * layout.page_bytes)
    pool.num_used = lambda: (pool.usage().num_slots, pool.usage().num_pages)
    return pool


def make_pool(kind: str, max_slots: int = 64, max_pages: int = 512, page_size: int = PAGE_SIZE):
    if kind == "fake":
        return FakePool(max_slots, max_pages, page_size)
    return _unified_pool(max_slots, max_pages, page_size)


POOL_KINDS = ["fake", "unified"]


# ------------------------------------------------------------------------------------------------ request model
def state_tag(tokens) -> float:
    """A nonzero value exact in float32 that identifies the prefix a KDA state was computed from."""
    return float(hash(tuple(tokens)) % 4_000_000 + 1)


class OutOfMemory(Exception):
    pass


@dataclass
class Request:
    tokens: list[int]                 # prompt, then sampled tokens
    fed: int                          # tokens whose state is in the working slot and whose KV is in pages
    slot: int
    pages: list[int]                  # page p holds tokens [p * page_size, (p + 1) * page_size)
    own_pages: set[int] = field(default_factory=set)
    node: object = None
    prompt_len: int = 0


class Harness:
    """Plays the engine's part: match, copy-on-write, run (write tags), snapshot, donate, release."""

    def __init__(self, pool, cache: RadixCache) -> None:
        self.pool, self.cache, self.ps = pool, cache, cache.page_size
        self.running: list[Request] = []

    # -- pool access through the public views only
    def read_slot(self, slot: int) -> float:
        return float(self.pool.kda_state(0)[self.pool.slot_position(slot)].flatten()[0])

    def write_slot(self, slot: int, value: float) -> None:
        assert not self.cache.owns_slot(slot), "the engine wrote a tree-owned checkpoint slot"
        self.pool.kda_state(0)[self.pool.slot_position(slot)] = value

    def read_page(self, page: int) -> list[float]:
        pos = int(self.pool.page_positions([page])[0])
        return self.pool.mla_kv(0)[pos, :, 0].tolist()

    def write_token(self, req: Request, position: int) -> None:
        page = req.pages[position // self.ps]
        assert page in req.own_pages and not self.cache.owns_page(page), "the engine wrote a tree-owned page"
        pos = int(self.pool.page_positions([page])[0])
        self.pool.mla_kv(0)[pos, position % self.ps, 0] = req.tokens[position] + 1

    def _alloc_slot(self) -> int:
        slot = self.pool.alloc_slot()
        if slot is None:
            self.cache.evict(num_slots=1)
            slot = self.pool.alloc_slot()
        if slot is None:
            raise OutOfMemory
        return slot

    def _alloc_pages(self, n: int) -> list[int]:
        pages = self.pool.alloc_pages(n)
        if pages is None:
            self.cache.evict(num_pages=n)
            pages = self.pool.alloc_pages(n)
        if pages is None:
            self.cache.evict(num_slots=n)      # in a unified pool slot bytes also make room for pages
            pages = self.pool.alloc_pages(n)
        if pages is None:
            raise OutOfMemory
        return pages

    def verify_hit(self, tokens, hit) -> None:
        n = hit.num_tokens
        assert n <= max(len(tokens) - 1, 0), "a hit must leave one prompt token to compute"
        assert len(hit.shared_pages) == n // self.ps
        for p, page in enumerate(hit.shared_pages):
            assert self.read_page(page) == [t + 1 for t in tokens[p * self.ps:(p + 1) * self.ps]], f"page {p}"
        if n == 0:
            assert hit.checkpoint is None and hit.partial_page is None
            return
        assert self.read_slot(hit.checkpoint) == state_tag(tokens[:n]), "checkpoint holds another prefix's state"
        assert (hit.partial_page is None) == (n % self.ps == 0)
        if hit.partial_page is not None:
            start = n // self.ps * self.ps
            got = self.read_page(hit.partial_page)[:n - start]
            assert got == [t + 1 for t in tokens[start:n]], "partial page holds another prefix's tokens"

    # -- request life cycle
    def start(self, prompt: list[int]) -> Request:
        hit = self.cache.match(prompt)
        self.verify_hit(prompt, hit)
        self.cache.lock(hit.node)
        req = Request(list(prompt), hit.num_tokens, slot=-1, pages=list(hit.shared_pages), node=hit.node,
                      prompt_len=len(prompt))
        self.running.append(req)
        req.slot = self._alloc_slot()
        if hit.checkpoint is not None:
            self.pool.copy_slot(hit.checkpoint, req.slot)      # copy-on-write: never run on the tree's slot
        else:
            self.pool.zero_slot(req.slot)
        if hit.partial_page is not None:
            (page,) = self._alloc_pages(1)
            self.pool.copy_page(hit.partial_page, page)
            req.pages.append(page)
            req.own_pages.add(page)
        return req

    def feed(self, req: Request, upto: int) -> None:
        assert req.fed <= upto <= len(req.tokens)
        need = -(-upto // self.ps) - len(req.pages)
        if need > 0:
            pages = self._alloc_pages(need)
            req.pages.extend(pages)
            req.own_pages.update(pages)
        for position in range(req.fed, upto):
            self.write_token(req, position)
        self.write_slot(req.slot, state_tag(req.tokens[:upto]))
        req.fed = upto

    def _take_over(self, req: Request, result) -> None:
        assert set(result.adopted_pages) <= req.own_pages, "the tree adopted a page the request did not own"
        req.own_pages.difference_update(result.adopted_pages)

    def snapshot(self, req: Request) -> None:
        slot = self._alloc_slot()
        self.pool.copy_slot(req.slot, slot)
        result = self.cache.insert_checkpoint(req.tokens[:req.fed], req.pages, slot)
        self._take_over(req, result)
        # The request keeps reading the pages it handed over: move its lock down to the node that now holds them.
        self.cache.lock(result.node)
        self.cache.unlock(req.node)
        req.node = result.node

    def prefill(self, req: Request) -> None:
        for position in self.cache.checkpoint_positions(req.tokens[:req.prompt_len], req.fed):
            self.feed(req, position)
            self.snapshot(req)
        self.feed(req, req.prompt_len)

    def decode(self, req: Request, sampled: list[int]) -> None:
        """Sample each token; every sampled token but the last is fed back (its KV and state are computed)."""
        for i, token in enumerate(sampled):
            req.tokens.append(token)
            if i + 1 < len(sampled):
                self.feed(req, len(req.tokens))

    def finish(self, req: Request, donate: bool = True) -> None:
        if donate and req.fed > 0:
            self._take_over(req, self.cache.donate(req.tokens[:req.fed], req.pages, req.slot))
        else:
            self.pool.free_slot(req.slot)
        self.release(req, free_slot=False)

    def release(self, req: Request, free_slot: bool = True) -> None:
        if free_slot and req.slot != -1:
            self.pool.free_slot(req.slot)
        if req.own_pages:
            self.pool.free_pages(sorted(req.own_pages))
        self.cache.unlock(req.node)
        self.running.remove(req)

    def run(self, prompt: list[int], sampled: Optional[list[int]] = None):
        """One whole request; returns the hit length it started from."""
        req = self.start(prompt)
        cached = req.fed
        self.prefill(req)
        self.decode(req, sampled if sampled is not None else [7])
        self.finish(req)
        return cached

    def check(self) -> None:
        """Every slot and page the pool has handed out is owned exactly once: by the tree or by one request."""
        self.cache.check_invariants()
        self.pool.check_invariants()
        slots = [self.cache.num_cached_slots] + [1 for req in self.running if req.slot != -1]
        pages = [self.cache.num_cached_pages] + [len(req.own_pages) for req in self.running]
        assert self.pool.num_used() == (sum(slots), sum(pages)), "a slot or page leaked or is owned twice"


def setup(kind: str, interval: int = INTERVAL, **pool_sizes):
    pool = make_pool(kind, **pool_sizes)
    cache = RadixCache(pool, PAGE_SIZE, interval)
    return pool, cache, Harness(pool, cache)


def fresh_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(200) for _ in range(n)]


# ------------------------------------------------------------------------------------------------ configuration
@pytest.mark.parametrize("page_size, interval", [(4, 6), (4, 0), (4, -8), (0, 8)])
def test_interval_must_be_positive_multiple_of_page_size(page_size, interval):
    with pytest.raises(ValueError, match="multiple|positive"):
        RadixCache(FakePool(4, 4, 4), page_size, interval)


def test_interval_must_align_with_kda_chunk():
    with pytest.raises(ValueError, match="chunk"):
        RadixCache(FakePool(4, 4, 4), 16, 48, kda_chunk_size=64)
    RadixCache(FakePool(4, 4, 4), 16, 128, kda_chunk_size=64)


# ------------------------------------------------------------------------------------------------ failure modes
@pytest.mark.parametrize("kind", POOL_KINDS)
@pytest.mark.parametrize("n", [1, 2, 5, 8, 9, 23])
def test_identical_prompt_twice_hits_all_but_last_token(kind, n):
    pool, cache, h = setup(kind)
    prompt = fresh_tokens(random.Random(n), n)
    assert h.run(prompt) == 0
    h.check()
    assert h.run(prompt) == n - 1     # the end-of-prompt checkpoint sits at n - 1, the last reusable position
    h.check()
    stats = cache.stats
    assert stats.queried_tokens == 2 * n and stats.hit_tokens == n - 1


@pytest.mark.parametrize("kind", POOL_KINDS)
def test_prompt_shorter_than_interval_hits(kind):
    pool, cache, h = setup(kind, interval=64)
    rng = random.Random(1)
    prompt = fresh_tokens(rng, 10)                                     # 10 < interval 64, not page-aligned
    h.run(prompt, sampled=[5, 6, 9])
    assert h.run(prompt) == 9
    assert h.run(prompt + [5, 6, 1]) == 12                             # the donated state: prompt + 5, 6 fed
    assert h.run(prompt + [4, 4]) == 10                                # donated by the identical prompt's run
    assert h.run(prompt[:7] + [999]) == 0                              # no checkpoint at or before 7
    h.check()


@pytest.mark.parametrize("kind", POOL_KINDS)
def test_family_reuses_whole_shared_prefix(kind):
    pool, cache, h = setup(kind, interval=16)
    rng = random.Random(2)
    system = fresh_tokens(rng, 21)                                     # shared prefix, not on any boundary
    first, second, third = ([200 + i] + fresh_tokens(rng, 6) for i in range(3))
    assert h.run(system + first) == 0
    assert cache.checkpoint_positions(system + second, 16) == [21, 27]   # divergence point and n - 1
    assert h.run(system + second) == 16
    assert h.run(system + third) == 21                                 # the whole shared prefix
    h.check()


@pytest.mark.parametrize("kind", POOL_KINDS)
def test_checkpoint_positions(kind):
    pool, cache, h = setup(kind, interval=8)
    tokens = list(range(30))
    assert cache.checkpoint_positions(tokens, 0) == [8, 16, 24, 29]
    assert cache.checkpoint_positions(tokens, 16) == [24, 29]
    assert cache.checkpoint_positions(tokens, 29) == []
    assert cache.checkpoint_positions(tokens[:1], 0) == []
    h.run(tokens[:13] + [500, 501])
    assert cache.checkpoint_positions(tokens, 8) == [13, 16, 24, 29]  # 13: where it leaves the cached branch


@pytest.mark.parametrize("kind", POOL_KINDS)
def test_eviction_pressure_falls_back_to_shallower_checkpoint(kind):
    pool, cache, h = setup(kind, interval=8)
    prompt = fresh_tokens(random.Random(3), 30)
    h.run(prompt, sampled=[1])                   # checkpoints at 8, 16, 24, 29 and the donation at 30
    assert cache.num_cached_slots == 5
    result = cache.evict(num_slots=2)
    assert (result.num_slots_freed, result.num_pages_freed) == (2, 2)   # 29, 30 are not page-aligned
    h.check()
    assert h.run(prompt + [4]) == 24             # the deepest checkpoint left, not zero
    cache.evict(num_slots=3)                     # 31 (just donated), 30 (its end of prompt), 24
    h.check()
    hit = cache.match(prompt)
    h.verify_hit(prompt, hit)
    assert hit.num_tokens == 16, "evicting deep checkpoints must leave the shared shallow ones"
    assert cache.stats.evicted_checkpoints == 5


@pytest.mark.parametrize("kind", POOL_KINDS)
def test_page_eviction_takes_dead_branches_and_leaves_first(kind):
    pool, cache, h = setup(kind, interval=8)
    rng = random.Random(4)
    hot = fresh_tokens(rng, 20)
    cold = hot[:8] + fresh_tokens(rng, 12)
    h.run(cold)
    h.run(hot)
    cache.evict(num_slots=1)                     # some deep checkpoint of the cold branch, now dead pages
    for _ in range(3):
        h.run(hot)
    before = cache.match(hot).num_tokens
    slots_before = cache.num_cached_slots
    first = cache.evict(num_pages=1)
    assert first == EvictResult(num_slots_freed=0, num_pages_freed=1), "a dead leaf's pages must go first"
    assert cache.num_cached_slots == slots_before
    cache.evict(num_pages=3)
    h.check()
    assert cache.match(hot).num_tokens == before, "page eviction hit the hot prefix while a cold one remained"
    cache.evict(num_pages=1000)
    h.check()
    assert cache.num_cached_pages == 0 and cache.num_cached_slots == 0
    assert cache.match(hot).num_tokens == 0


@pytest.mark.parametrize("kind", POOL_KINDS)
def test_split_keeps_checkpoints_with_their_prefix(kind):
    pool, cache, h = setup(kind, interval=64)
    rng = random.Random(5)
    a, b, c = fresh_tokens(rng, 6), [300] + fresh_tokens(rng, 5), [301] + fresh_tokens(rng, 4)
    h.run(a + b)                                     # one edge A+B with its checkpoint at len(A+B) - 1
    h.run(a + b + [9])                               # checkpoint exactly at len(A+B)
    assert h.run(a + c) == 0                         # diverges inside the edge: split at len(A)
    h.check()
    hit = cache.match(a + b + [42])
    h.verify_hit(a + b + [42], hit)
    assert hit.num_tokens == len(a + b)
    hit = cache.match(a + [42])
    h.verify_hit(a + [42], hit)
    assert hit.num_tokens <= len(a)
    assert cache.match(a + c + [1]).num_tokens == len(a + c)       # A+C's donated working slot
    assert cache.match(a + [303]).num_tokens == len(a)             # the divergence checkpoint A+C left at len(A)


@pytest.mark.parametrize("kind", POOL_KINDS)
@pytest.mark.parametrize("len_a, len_b", [(6, 6), (4, 8), (5, 3), (1, 9)])
def test_split_by_direct_inserts(kind, len_a, len_b):
    """Insert A+B with one checkpoint at its end, then A+C diverging inside that edge, nothing else."""
    pool, cache, h = setup(kind, interval=64)
    rng = random.Random(len_a * 10 + len_b)
    a = fresh_tokens(rng, len_a)
    b, c = [300] + fresh_tokens(rng, len_b - 1), [301] + fresh_tokens(rng, 4)
    for tokens in (a + b, a + c):
        req = h.start(tokens + [0])
        h.feed(req, len(tokens))
        h.snapshot(req)
        h.release(req)
        h.check()
    assert cache.num_cached_slots == 2
    hit = cache.match(a + b + [42])
    h.verify_hit(a + b + [42], hit)
    assert hit.num_tokens == len(a + b)
    hit = cache.match(a + [42])
    h.verify_hit(a + [42], hit)
    assert hit.num_tokens == 0                       # no checkpoint at or before len(A)
    hit = cache.match(a + c + [42])
    h.verify_hit(a + c + [42], hit)
    assert hit.num_tokens == len(a + c)


@pytest.mark.parametrize("kind", POOL_KINDS)
def test_split_of_locked_edge_keeps_lock_counts(kind):
    pool, cache, h = setup(kind, interval=64)
    rng = random.Random(6)
    a, b = fresh_tokens(rng, 9), fresh_tokens(rng, 9)
    h.run(a + b)
    holder = h.start(a + b)                          # locks the A+B node
    h.run(a + [250, 251, 252])                       # splits the locked edge
    h.check()
    assert cache.flush().num_slots_freed >= 1
    h.check()
    hit = cache.match(a + b)
    assert hit.num_tokens == len(a + b) - 1, "a locked node (or its new upper half) was evicted"
    h.release(holder)
    cache.flush()
    h.check()
    assert pool.num_used() == (0, 0)


# ------------------------------------------------------------------------------------------------ ownership
@pytest.mark.parametrize("kind", POOL_KINDS)
def test_copy_on_write_leaves_checkpoint_untouched(kind):
    pool, cache, h = setup(kind)
    prompt = fresh_tokens(random.Random(7), 14)
    h.run(prompt)
    hit = cache.match(prompt)
    tag_before = h.read_slot(hit.checkpoint)
    req = h.start(prompt + [1, 2, 3])
    assert req.slot != hit.checkpoint and req.pages[-1] != hit.partial_page
    h.prefill(req)
    h.decode(req, [4, 5])
    assert h.read_slot(hit.checkpoint) == tag_before
    h.verify_hit(prompt, cache.match(prompt))
    h.finish(req)
    h.check()


@pytest.mark.parametrize("kind", POOL_KINDS)
def test_donate_adopts_working_slot_or_frees_duplicate(kind):
    pool, cache, h = setup(kind)
    prompt = fresh_tokens(random.Random(8), 10)
    req = h.start(prompt)
    h.prefill(req)
    h.decode(req, [11, 12, 13])
    slot = req.slot
    result = cache.donate(req.tokens[:req.fed], req.pages, req.slot)
    assert result.slot_adopted and cache.owns_slot(slot) and result.num_tokens == 12
    h._take_over(req, result)
    h.release(req, free_slot=False)
    h.check()
    used_slots = pool.num_used()[0]
    req = h.start(prompt + [11, 12, 13])             # hits the donation at 12, feeds 13, donates 12 again?
    assert req.fed == 12
    h.prefill(req)
    result = cache.donate(req.tokens[:12], req.pages, req.slot)   # same prefix: the cache frees the slot
    assert not result.slot_adopted and not cache.owns_slot(req.slot)
    h._take_over(req, result)
    h.release(req, free_slot=False)
    h.check()
    assert pool.num_used()[0] == used_slots


def test_insert_rejects_pages_the_tree_owns():
    pool, cache, h = setup("fake")
    prompt = fresh_tokens(random.Random(9), 12)
    h.run(prompt)
    hit = cache.match(prompt + [1] * 8)
    slot = pool.alloc_slot()
    with pytest.raises(ValueError, match="already owned"):
        cache.insert_checkpoint(prompt[:4] + [77] * 8, hit.shared_pages + hit.shared_pages, slot)
    with pytest.raises(ValueError, match="request pages"):
        cache.insert_checkpoint(prompt + [1] * 8, hit.shared_pages[:1], slot)
    pool.free_slot(slot)


def test_unlock_without_lock_raises():
    pool, cache, h = setup("fake")
    h.run(fresh_tokens(random.Random(10), 9))
    hit = cache.match(fresh_tokens(random.Random(10), 9))
    with pytest.raises(ValueError, match="without a matching lock"):
        cache.unlock(hit.node)


def test_invariant_check_catches_misplaced_checkpoint():
    pool, cache, h = setup("fake", interval=64)
    rng = random.Random(11)
    a = fresh_tokens(rng, 6)
    h.run(a + [300, 1, 2, 3])
    h.run(a + [301, 1, 2, 3])
    cache.check_invariants()
    upper = cache.match(a + [302]).node
    lower = next(iter(upper.children.values()))
    upper.checkpoint, lower.checkpoint = lower.checkpoint, upper.checkpoint
    with pytest.raises(AssertionError, match="checkpoint"):
        cache.check_invariants()


def test_invariant_check_catches_double_owned_page():
    pool, cache, h = setup("fake", interval=8)
    h.run(fresh_tokens(random.Random(12), 20))
    node = cache.match(fresh_tokens(random.Random(12), 20)).node
    while not node.pages or not node.parent.pages:
        node = node.parent
    node.pages[-1] = node.parent.pages[0]
    with pytest.raises(AssertionError, match="owned twice|pages"):
        cache.check_invariants()


# ------------------------------------------------------------------------------------------------ random workload
PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9], [8] * 13]

operation = st.one_of(
    st.tuples(st.just("run"), st.integers(0, len(PREFIXES) - 1), st.integers(0, 14), st.integers(1, 4),
              st.integers(0, 10**6)),
    st.tuples(st.just("hold"), st.integers(0, len(PREFIXES) - 1), st.integers(1, 10), st.integers(0, 10**6)),
    st.tuples(st.just("release"), st.integers(0, 7)),
    st.tuples(st.just("evict"), st.integers(0, 3), st.integers(0, 6)),
    st.tuples(st.just("repeat"),),
)


def _apply(h: Harness, op, history: list[list[int]]) -> None:
    rng = random.Random(op[-1] if op[0] in ("run", "hold") else 0)
    try:
        if op[0] == "run":
            prompt = PREFIXES[op[1]] + [rng.randrange(4) for _ in range(op[2])]
            if prompt:
                history.append(prompt)
                h.run(prompt, sampled=[rng.randrange(6) for _ in range(op[3])])
        elif op[0] == "hold":                        # a request that stays running (its hit stays locked)
            prompt = PREFIXES[op[1]] + [rng.randrange(4) for _ in range(op[2])]
            req = h.start(prompt)
            h.prefill(req)
        elif op[0] == "release" and h.running:
            h.finish(h.running[op[1] % len(h.running)], donate=op[1] % 2 == 0)
        elif op[0] == "evict":
            h.cache.evict(num_slots=op[1], num_pages=op[2])
        elif op[0] == "repeat" and history:
            h.run(history[-1])
    except OutOfMemory:
        if h.running and h.running[-1].fed < h.running[-1].prompt_len:
            h.release(h.running[-1])             # admission failed halfway: give everything back


def run_workload(kind: str, ops) -> None:
    pool, cache, h = setup(kind, interval=4, max_slots=8, max_pages=24)
    history: list[list[int]] = []
    for op in ops:
        _apply(h, op, history)
        h.check()
    for req in list(h.running):
        h.release(req)
    cache.flush()
    h.check()
    assert cache.num_cached_slots == 0 and cache.num_cached_pages == 0
    assert pool.num_used() == (0, 0)
    if kind == "unified":
        usage = pool.usage()
        assert usage.kda_bytes == 0 and usage.mla_bytes == 0 and usage.free_bytes == usage.capacity_bytes


@pytest.mark.parametrize("kind", POOL_KINDS)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(operation, min_size=1, max_size=25))
def test_random_workload_keeps_invariants(kind, ops):
    run_workload(kind, ops)

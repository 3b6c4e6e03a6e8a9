"""The fake pool, the request model and the harness that the radix-cache tests drive (not a test module).

Every checkpoint slot and page carries recognisable data written through the pool's views, so a hit whose data
does not spell the query's prefix fails loudly."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

import pytest
import torch

from k3core.cache import RadixCache

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
        self.cache.lock(hit.node)                              # the pages this request will read
        if hit.checkpoint is not None:
            self.cache.pin_checkpoint(hit.node)                # the checkpoint and its partial page, until copied
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
        if hit.checkpoint is not None:
            self.cache.unpin_checkpoint(hit.node)
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

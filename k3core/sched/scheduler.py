"""Scheduler: continuous batching with chunked prefill, admission, retraction and abort.

The scheduler is pure bookkeeping over the pool and the prefix cache: it decides which requests feed how many
tokens this step, makes sure each has a KDA working slot and enough MLA pages first, and gives back everything a
request held when it finishes, is retracted or is aborted. It never touches tensors except through the pool's
copy methods (copy-on-write of a cached checkpoint or partial page).

Rules callers rely on:
* every slot and page is owned exactly once: by a running request, or by the radix cache (then only read);
* a request's chunk never crosses one of its checkpoint positions, so that after the step its working slot holds
  exactly the state the cache should snapshot there;
* decodes are scheduled before prefill chunks; when a decode cannot get a page, the running request that is
  cheapest to recompute (fewest computed tokens) is retracted and requeued at the front.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from k3core.sched.request import Request, Status


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    num_tokens: int            # tokens fed this step
    samples: bool              # the chunk reaches the end of the known tokens: sample after it


@dataclass(frozen=True)
class SchedulerOptions:
    max_running_requests: int
    chunked_prefill_tokens: int
    page_size: int


class Scheduler:
    def __init__(self, pool, cache, options: SchedulerOptions):
        self.pool = pool
        self.cache = cache                     # RadixCache or None (prefix cache off)
        self.options = options
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_retractions = 0

    # ---- queue operations -----------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = Status.WAITING
        self.waiting.append(request)

    def abort(self, request: Request) -> None:
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        self.release(request, donate=False)
        request.status = Status.FINISHED
        request.finish_reason = request.finish_reason or "abort"

    def finish(self, request: Request) -> None:
        self.running.remove(request)
        self.release(request, donate=True)
        request.status = Status.FINISHED

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -------------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledChunk]:
        budget = self.options.chunked_prefill_tokens
        chunks: list[ScheduledChunk] = []
        for request in sorted([r for r in self.running if not r.is_prefilling], key=lambda r: r.arrival):
            if request not in self.running:           # retracted while making room for an earlier decode
                continue
            if not self._ensure_pages(request, request.num_computed_tokens + 1):
                continue
            chunks.append(ScheduledChunk(request, 1, samples=True))
            budget -= 1
        # A decode may have retracted a request whose decode was already scheduled this step. Drop those chunks
        # now, before admission: a retracted request can be readmitted below and must then get only its new chunk.
        chunks = [c for c in chunks if c.request.status == Status.RUNNING]
        budget = self.options.chunked_prefill_tokens - len(chunks)
        for request in [r for r in self.running if r.is_prefilling]:
            if budget <= 0:
                break
            chunk = self._prefill_chunk(request, budget)
            if chunk is not None:
                chunks.append(chunk)
                budget -= chunk.num_tokens
        while self.waiting and budget > 0 and len(self.running) < self.options.max_running_requests:
            request = self.waiting[0]
            if not self._admit(request):
                break
            self.waiting.popleft()
            self.running.append(request)
            request.status = Status.RUNNING
            chunk = self._prefill_chunk(request, budget)
            if chunk is not None:
                chunks.append(chunk)
                budget -= chunk.num_tokens
        if not chunks and self.running:
            # Every running request is waiting for pages that only another running request holds: recompute the
            # cheapest later rather than stall forever.
            victim = self._cheapest_to_recompute(exclude=None)
            if victim is not None and len(self.running) > 1:
                self.retract(victim)
        return chunks

    def _prefill_chunk(self, request: Request, budget: int) -> ScheduledChunk | None:
        num = min(budget, request.num_pending_tokens)
        later = [p for p in request.checkpoint_positions if p > request.num_computed_tokens]
        if later:
            num = min(num, later[0] - request.num_computed_tokens)
        if num <= 0 or not self._ensure_pages(request, request.num_computed_tokens + num, retract_others=False):
            return None
        return ScheduledChunk(request, num, samples=request.num_computed_tokens + num == request.num_tokens)

    # ---- memory ---------------------------------------------------------------------------------
    def _ensure_pages(self, request: Request, num_tokens: int, retract_others: bool = True) -> bool:
        """Give the request pages for `num_tokens`; evict cache, then retract others, before giving up."""
        need = -(-num_tokens // self.options.page_size) - len(request.page_handles)
        while need > 0:
            pages = self._alloc(0, need)
            if pages is not None:
                request.page_handles.extend(pages)
                request.owned_pages.update(pages)
                return True
            if not retract_others:
                return False
            victim = self._cheapest_to_recompute(exclude=request)
            if victim is None:
                self.retract(request)
                return False
            self.retract(victim)
        return True

    def _alloc(self, num_slots: int, num_pages: int):
        """Allocate, evicting unlocked cache entries when the pool is full. Returns pages (or [slot]) or None."""
        if not self._make_room(num_slots, num_pages):
            return None
        if num_slots:
            return [self.pool.alloc_slot()]
        return self.pool.alloc_pages(num_pages)

    def _make_room(self, num_slots: int, num_pages: int) -> bool:
        """Evict unlocked cache entries until the pool can hold `num_slots` slots and `num_pages` pages. In the
        unified pool bytes are bytes: a cached checkpoint slot makes room for pages and the other way round, so
        keep evicting whichever kind is left until it fits or nothing unlocked remains."""
        while not self.pool.can_allocate(num_slots, num_pages):
            if self.cache is None:
                return False
            freed = self.cache.evict(num_slots=num_slots, num_pages=num_pages)
            if freed.num_slots_freed + freed.num_pages_freed == 0:
                freed = self.cache.evict(num_slots=1, num_pages=1)
            if freed.num_slots_freed + freed.num_pages_freed == 0:
                return self.pool.can_allocate(num_slots, num_pages)
        return True

    def _cheapest_to_recompute(self, exclude: Request | None) -> Request | None:
        candidates = [r for r in self.running if r is not exclude]
        return min(candidates, key=lambda r: (r.num_computed_tokens, -r.arrival)) if candidates else None

    def retract(self, request: Request) -> None:
        """Free everything the request holds and requeue it at the front; it recomputes prompt + output so far."""
        self.running.remove(request)
        self.release(request, donate=False)
        request.status = Status.WAITING
        request.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(request)

    def _admit(self, request: Request) -> bool:
        tokens = request.all_token_ids
        hit = self.cache.match(tokens) if self.cache is not None else None
        hit_tokens = hit.num_tokens if hit is not None and hit.checkpoint is not None else 0
        need_pages = -(-max(hit_tokens + 1, 1) // self.options.page_size) - (
            len(hit.shared_pages) if hit_tokens else 0)
        if hit_tokens:
            self.cache.lock(hit.node)           # protect the hit's pages while we make room
            self.cache.pin_checkpoint(hit.node)  # ... and its checkpoint until it is copied
        if not self._make_room(1, need_pages):
            if hit_tokens:
                self.cache.unpin_checkpoint(hit.node)
                self.cache.unlock(hit.node)
            return False
        request.working_slot = self.pool.alloc_slot()
        if hit_tokens:
            request.cache_node = hit.node
            self.pool.copy_slot(hit.checkpoint, request.working_slot)    # copy-on-write: never write the checkpoint
            request.page_handles = list(hit.shared_pages)
            if hit.partial_page is not None:
                page = self.pool.alloc_pages(1)[0]
                self.pool.copy_page(hit.partial_page, page)
                request.page_handles.append(page)
                request.owned_pages.add(page)
            self.cache.unpin_checkpoint(hit.node)          # checkpoint and partial page copied: no longer read
        else:
            self.pool.zero_slot(request.working_slot)
        request.num_computed_tokens = hit_tokens
        if request.num_retractions == 0 or request.num_cached_tokens == 0:
            request.num_cached_tokens = min(hit_tokens, len(request.prompt_token_ids))
        if self.cache is not None:
            request.checkpoint_positions = self.cache.checkpoint_positions(tokens, hit_tokens)
        return True

    def release(self, request: Request, donate: bool) -> None:
        """Give back the request's slot and pages: to the cache (donate) or to the pool."""
        fed = request.all_token_ids[: request.num_computed_tokens]
        if donate and self.cache is not None and request.working_slot is not None and fed:
            result = self.cache.donate(fed, request.page_handles, request.working_slot)
            request.owned_pages -= set(result.adopted_pages)
            request.working_slot = None
        if request.working_slot is not None:
            self.pool.free_slot(request.working_slot)
            request.working_slot = None
        if request.owned_pages:
            self.pool.free_pages([p for p in request.page_handles if p in request.owned_pages])
        if request.cache_node is not None:
            self.cache.unlock(request.cache_node)
            request.cache_node = None
        request.page_handles, request.owned_pages = [], set()
        request.num_computed_tokens = 0
        request.checkpoint_positions = []

    def snapshot(self, request: Request) -> None:
        """After a step ending at a checkpoint position: copy the working slot into a new tree-owned checkpoint."""
        position = request.num_computed_tokens
        if self.cache is None or position not in request.checkpoint_positions:
            return
        request.checkpoint_positions.remove(position)
        allocated = self._alloc(1, 0)
        if allocated is None:
            return                               # no room for a checkpoint: skip it, never block decoding
        slot = allocated[0]
        self.pool.copy_slot(request.working_slot, slot)
        result = self.cache.insert_checkpoint(request.all_token_ids[:position], request.page_handles, slot)
        request.owned_pages -= set(result.adopted_pages)
        # The request still reads the pages the tree adopted: hold the new node (a descendant of the old one).
        self.cache.lock(result.node)
        if request.cache_node is not None:
            self.cache.unlock(request.cache_node)
        request.cache_node = result.node

"""Scheduler: continuous batching with chunked prefill, admission, retraction and abort.

The scheduler is pure bookkeeping over the pool and the prefix cache: it decides which requests feed how many
tokens this step, makes sure each has a KDA working slot and enough MLA pages first, and gives back everything a
request held when it finishes, is retracted or is aborted. It never touches tensors except through the pool's
copy methods (copy-on-write of a cached checkpoint or partial page).

Rules callers rely on:
* every slot and page is owned exactly once: by a running request, or by the radix cache (then only read);
* prefill chunks are cut by the token budget only. A chunk may cross any number of the request's checkpoint
  positions: for each one it carries a `Snapshot` with a fresh slot, the step writes the state after that
  position into it (the KDA prefill op emits it), and `commit_snapshots` hands the slots to the cache right after
  the step is launched;
* decodes are scheduled before prefill chunks; when a decode cannot get a page, the running request that is
  cheapest to recompute (fewest computed tokens) is retracted and requeued at the front;
* abort and finish cost the same however many requests wait (the waiting queue removes lazily; the running
  list is bounded by max_running_requests);
* a request whose sampled token is still on the device (overlapped steps: `Request.num_unresolved`) decodes it
  from there, is never admitted until it is known, and is not scheduled once it holds all its tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

from k3core.memory.layout import SlotHandle
from k3core.sched.request import Request, Status
from k3core.sched.waiting import WaitingQueue


@dataclass(frozen=True)
class Snapshot:
    """The KDA state after `position` tokens of the request's sequence, written by the step into `slot` (a fresh
    slot the scheduler took for it; the cache's once committed). slot None: no room for it, but the step still cuts
    its KDA chunks there, so that a later request resuming from any checkpoint computes exactly what this one did."""
    position: int
    slot: SlotHandle | None


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    num_tokens: int            # tokens fed this step
    samples: bool              # the chunk reaches the end of the known tokens: sample after it
    snapshots: tuple[Snapshot, ...] = ()   # checkpoint positions inside (start, start + num_tokens], in order


@dataclass(frozen=True)
class SchedulerOptions:
    max_running_requests: int
    chunked_prefill_tokens: int
    page_size: int
    max_model_len: int | None = None       # a request never holds more tokens than this (None: no limit)


class Scheduler:
    def __init__(self, pool, cache, options: SchedulerOptions):
        self.pool = pool
        self.cache = cache                     # RadixCache or None (prefix cache off)
        self.options = options
        self.waiting = WaitingQueue()           # abort and finish remove from it in O(1)
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
        """Also for a request that was retracted while its last token was on the device (it is waiting then)."""
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
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
            if self._holds_all_tokens(request):       # its last token is still on the device: it ends there
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
            if request.num_unresolved or not self._admit(request):
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

    def unschedule(self, chunk: ScheduledChunk) -> None:
        """Take back a chunk that will not run this step (before its step is launched): its snapshot slots return
        to the pool and their positions to the request. Its pages stay the request's, for when it runs."""
        request = chunk.request
        for snapshot in chunk.snapshots:
            if snapshot.slot is not None:
                self.pool.free_slot(snapshot.slot)
        request.checkpoint_positions = [s.position for s in chunk.snapshots] + request.checkpoint_positions

    def _prefill_chunk(self, request: Request, budget: int) -> ScheduledChunk | None:
        start = request.num_computed_tokens
        num = min(budget, request.num_pending_tokens)
        if num <= 0 or not self._ensure_pages(request, start + num, retract_others=False):
            return None
        return ScheduledChunk(request, num, samples=start + num == request.num_tokens,
                              snapshots=self._take_snapshots(request, start, start + num))

    def _take_snapshots(self, request: Request, start: int, end: int) -> tuple[Snapshot, ...]:
        """A fresh slot for each of the request's checkpoint positions in (start, end]. A position without room
        for its slot is dropped: a missed checkpoint costs a later hit, never a stall."""
        if self.cache is None:
            return ()
        due = [p for p in request.checkpoint_positions if start < p <= end]
        request.checkpoint_positions = [p for p in request.checkpoint_positions if p > end]
        snapshots, room = [], True
        for position in due:
            allocated = self._alloc(1, 0) if room else None
            room = allocated is not None
            snapshots.append(Snapshot(position, allocated[0] if room else None))
        return tuple(snapshots)

    def _holds_all_tokens(self, request: Request) -> bool:
        limit = self.options.max_model_len
        return (len(request.output_token_ids) >= request.params.max_tokens
                or (limit is not None and request.num_tokens >= limit))

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
        # a request that still needs prompt logprobs needs the logits of every position it has no logprobs for: it
        # reads a cached prefix only up to the positions the prompt-logprob store gave it (match looks at [:n-1])
        match_tokens = tokens[:request.num_known_prompt_logprobs] if request.needs_prompt_logprobs else tokens
        reads_cache = self.cache is not None and len(match_tokens) > 1
        hit = self.cache.match(match_tokens) if reads_cache else None
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
            # With nothing running, no request will ever free memory: if only the hit's own locked pages and
            # checkpoint stand in the way, waiting for the hit would stall forever. Admit as a miss instead (the
            # hit may then be evicted to make room).
            if not hit_tokens or self.running:
                return False
            hit_tokens = 0
            if not self._make_room(1, 1):
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
        if reads_cache and (hit_tokens or not request.needs_prompt_logprobs):
            request.checkpoint_positions = self.cache.checkpoint_positions(tokens, hit_tokens)
        elif self.cache is not None:
            # where an empty cache would snapshot (no divergence point), so that the request computes the same
            # numbers whatever the cache holds
            interval, last = self.cache.checkpoint_interval, len(tokens) - 1
            request.checkpoint_positions = sorted({*range(interval, last + 1, interval), last}) if last > 0 else []
        return True

    def release(self, request: Request, donate: bool) -> None:
        """Give back the request's slot and pages: to the cache (donate) or to the pool."""
        fed = request.all_token_ids[: request.num_computed_tokens]
        if donate and self.cache is not None and request.working_slot is not None and fed:
            assert request.num_unresolved == 0, "a request was donated with a token still on the device"
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

    def commit_snapshots(self, chunk: ScheduledChunk) -> None:
        """After the chunk's step was launched: hand each snapshot slot to the cache as the checkpoint of its prefix.
        The step writes the slots before anything later on the device can read them (one stream), so the tree may
        own them at once. The request keeps reading the pages the tree adopts: it holds the newest node instead."""
        request = chunk.request
        for snapshot in chunk.snapshots:
            if snapshot.slot is None:
                continue
            result = self.cache.insert_checkpoint(request.all_token_ids[:snapshot.position], request.page_handles,
                                                  snapshot.slot)
            request.owned_pages -= set(result.adopted_pages)
            self.cache.lock(result.node)          # a descendant of the node held so far
            if request.cache_node is not None:
                self.cache.unlock(request.cache_node)
            request.cache_node = result.node

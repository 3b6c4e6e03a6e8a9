"""The engine's cross-structure invariants: who owns every slot and page, and which cache locks are whose."""
from __future__ import annotations

from k3core.sched.request import Status


def check_engine_invariants(engine) -> None:
    """Pool and cache structure, plus the ownership rules between requests and the cache: every live slot and
    page is owned exactly once (a running request or the tree), a request reads tree pages only below the node
    it holds locked, and every lock in the tree belongs to a running request."""
    engine.pool.check_invariants()
    cache = engine.cache
    if cache is not None:
        cache.check_invariants()
        engine.prompt_logprob_store.check_invariants()
    running = engine.scheduler.running
    owned = [p for r in running for p in r.owned_pages]
    assert len(owned) == len(set(owned)), "a page is owned by two running requests"
    slots = [r.working_slot for r in running if r.working_slot is not None]
    assert len(slots) == len(set(slots)), "a working slot is held by two requests"
    scratch_slots, scratch_pages = 0, 0
    if engine.graph_decode is not None:           # the scratch belongs to the graphs alone
        scratch = engine.graph_decode.scratch
        assert scratch.slot not in slots and scratch.page not in owned, "a request holds the graphs' scratch"
        assert not any(scratch.page in r.page_handles for r in running), "a request reads the graphs' scratch page"
        assert cache is None or not (cache.owns_slot(scratch.slot) or cache.owns_page(scratch.page)), (
            "the cache holds the graphs' scratch")
        scratch_slots, scratch_pages = 1, 1
    locks = 0
    for request in running:
        name = request.request_id
        assert request.status == Status.RUNNING, f"request {name} is in the running list as {request.status}"
        assert request.working_slot is not None, f"running request {name} has no working slot"
        assert len(request.page_handles) * engine.page_size >= request.num_computed_tokens, (
            f"request {name} has fed more tokens than its pages hold")
        assert len(set(request.page_handles)) == len(request.page_handles), f"request {name} lists a page twice"
        assert request.owned_pages <= set(request.page_handles), f"request {name} owns pages it does not list"
        assert 0 <= request.num_computed_tokens < request.num_tokens, (
            f"request {name} computed {request.num_computed_tokens} of {request.num_tokens} tokens")
        borrowed = [p for p in request.page_handles if p not in request.owned_pages]
        if cache is None:
            assert not borrowed and request.cache_node is None, f"request {name} borrows pages with no cache"
            continue
        assert not cache.owns_slot(request.working_slot), f"request {name} writes a cache checkpoint slot"
        assert not any(cache.owns_page(p) for p in request.owned_pages), (
            f"request {name} owns a page the cache owns too")
        if request.cache_node is None:
            assert not borrowed, f"request {name} reads cache pages without holding a lock"
            continue
        node = request.cache_node
        assert node.lock_count > 0, f"request {name} holds an unlocked node {node!r}"
        assert node.path_tokens() == request.all_token_ids[:node.end], (
            f"request {name} holds a node for a prefix it does not have")
        locks += 1
        protected = set()
        while node is not None:
            protected.update(node.pages)
            node = node.parent
        assert set(borrowed) <= protected, (
            f"request {name} reads cache pages outside the path it holds locked (they could be evicted)")
    if cache is not None:
        total_locks, stack = 0, [cache.root]
        while stack:
            node = stack.pop()
            total_locks += node.lock_count
            stack.extend(node.children.values())
        assert total_locks == locks, f"{total_locks} cache locks held but running requests account for {locks}"
    usage = engine.pool.usage()
    cached_slots = cache.num_cached_slots if cache is not None else 0
    cached_pages = cache.num_cached_pages if cache is not None else 0
    assert usage.num_slots == len(slots) + cached_slots + scratch_slots, (
        f"{usage.num_slots} slots live but requests hold {len(slots)}, the cache {cached_slots} and the graphs "
        f"{scratch_slots}: a slot leaked")
    assert usage.num_pages == len(owned) + cached_pages + scratch_pages, (
        f"{usage.num_pages} pages live but requests own {len(owned)}, the cache {cached_pages} and the graphs "
        f"{scratch_pages}: a page leaked")
    for request in engine.scheduler.waiting:
        assert request.status == Status.WAITING, f"request {request.request_id} waits as {request.status}"
        assert request.working_slot is None and not request.page_handles and request.cache_node is None, (
            f"waiting request {request.request_id} still holds memory")

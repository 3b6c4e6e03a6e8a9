"""Tests of the copy-on-write radix cache (k3core/cache) against a small fake pool and the real UnifiedPool.

Every checkpoint slot and page carries recognisable data written through the pool's views: a slot holds a tag
derived from the exact prefix it is the state of, and a page holds its token ids (+1, so a zero page never passes).
A hit is accepted only when its checkpoint tag, shared pages and partial page spell exactly the query's prefix, so a
checkpoint attached to the wrong prefix (after a split, an eviction, a compaction move) fails loudly.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3core.cache import EvictResult, RadixCache
from radix_harness import (INTERVAL, PAGE_SIZE, POOL_KINDS, FakePool, Harness, OutOfMemory, Request,  # noqa: F401
                           fresh_tokens, make_pool, setup, state_tag)



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
    # A lock protects the pages a running request reads; its hit's checkpoint was copied at admission and may go.
    assert cache.num_cached_pages >= (len(a + b) - 1) // PAGE_SIZE, "a locked node (or its upper half) lost pages"
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


@pytest.mark.parametrize("kind", POOL_KINDS)
def test_pinned_checkpoint_survives_eviction_and_unpinned_locked_ones_may_go(kind):
    pool, cache, h = setup(kind, interval=64)
    rng = random.Random(8)
    locked, free = fresh_tokens(rng, 10), fresh_tokens(rng, 10)
    h.run(locked)
    h.run(free)
    hit = cache.match(locked + [1])
    cache.lock(hit.node)
    cache.pin_checkpoint(hit.node)
    unlocked = cache.num_cached_slots - 1           # all but the pinned one
    cache.evict(num_slots=unlocked)
    assert cache.match(free + [1]).checkpoint is None
    assert cache.match(locked + [1]).checkpoint == hit.checkpoint
    cache.flush()
    h.check()
    assert cache.match(locked + [1]).checkpoint == hit.checkpoint, "a pinned checkpoint was evicted"
    cache.unpin_checkpoint(hit.node)
    with pytest.raises(ValueError):
        cache.unpin_checkpoint(hit.node)
    assert cache.evict(num_slots=1).num_slots_freed == 1      # locked but unpinned: may go now
    cache.unlock(hit.node)
    cache.flush()
    assert pool.num_used() == (0, 0)

"""Step isolation and abort cost, at the engine and scheduler level (CPU, k3-tiny, float32 greedy: exact).

A poison request is made to fail by injection (the sampler or the model raises whenever that one request is in
the step, at one position), not by a bad parameter: validation refuses the known bad parameters, and isolation
must hold for failures nobody has thought of yet. The innocent requests of the failed batches must end exactly as
they do alone (same greedy tokens), the poison alone ends with finish_reason "error", and nothing leaks.
"""
from __future__ import annotations

import functools
import random

import pytest
import torch

from k3core import LLM, SamplingParams
from k3core.sched.request import Request
from k3core.sched.waiting import WaitingQueue

PAGE_SIZE = 4
INTERVAL = 8
MAGIC = 250                 # a token id only the poison prompt holds (innocent prompts draw from 0..199)


def _llm(**options) -> LLM:
    options = {"page_size": PAGE_SIZE, "checkpoint_interval": INTERVAL, **options}
    return LLM("k3-tiny", backend="torch", device="cpu", dtype="float32", seed=3, **options)


@functools.lru_cache(maxsize=None)
def _reference() -> LLM:
    return _llm(prefix_cache=False, chunked_prefill_tokens=4096, memory_bytes=64 << 20)


def _alone(prompt: list[int], params: SamplingParams) -> list[int]:
    return _reference().generate([prompt], SamplingParams(**vars(params)))[0].token_ids


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    innocent = [torch.randint(0, 200, (n,), generator=generator).tolist() for n in (23, 31, 9)]
    poison = torch.randint(0, 200, (30,), generator=generator).tolist()
    poison[20] = MAGIC                       # in the second prefill chunk (16 tokens per step)
    return innocent + [poison]


def _run(engine, prompts, params) -> tuple[list[str], dict[str, list]]:
    ids = [engine.add_request(p, SamplingParams(**vars(params[i]))) for i, p in enumerate(prompts)]
    outputs: dict[str, list] = {i: [] for i in ids}
    while engine.has_work:
        for output in engine.step():
            outputs[output.request_id].append(output)
        engine.check_invariants()
    return ids, outputs


def _check(llm, prompts, params, ids, outputs) -> None:
    engine = llm.engine
    for request_id, prompt, p in zip(ids[:-1], prompts[:-1], params[:-1]):
        request = engine.requests[request_id]
        assert request.finish_reason == "length", (request_id, request.finish_reason)
        assert request.output_token_ids == _alone(prompt, p), f"{request_id} differs from its run alone"
        emitted = [t for o in outputs[request_id] for t in o.new_token_ids]
        assert emitted == request.output_token_ids, "every token reaches the caller exactly once"
    poison = engine.requests[ids[-1]]
    assert poison.finish_reason == "error"
    last = outputs[ids[-1]][-1]
    assert last.finished and last.finish_reason == "error" and "injected" in last.error
    assert sum(o.finished for o in outputs[ids[-1]]) == 1
    assert engine.quarantine.num_failures >= 2 and not engine.quarantine.active
    engine.check_invariants()
    assert engine.flush_cache()
    usage = engine.memory_usage()
    assert (usage.num_slots, usage.num_pages) == (0, 0), f"memory leaked: {usage}"
    assert engine.sampler.num_requests == 0


def test_a_sampler_failure_fails_only_its_request(monkeypatch):
    llm = _llm(prefix_cache=True, overlap=True, chunked_prefill_tokens=16)
    prompts = _prompts()
    prompts[-1][20] = 7                       # the sampler poison needs no magic token
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.5),          # its counts must be rebuilt after a rollback
              SamplingParams(max_tokens=6, temperature=0.9, top_k=20, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)]
    sampler = llm.engine.sampler
    original = sampler.sample
    poison_id = "req-3"

    def sample(logits, rows):
        for row in rows:                      # fails once the poison has 3 output tokens: mid-decode
            if row.request_id == poison_id and len(row.output_token_ids) == 3:
                raise RuntimeError("injected sampler fault")
        return original(logits, rows)

    monkeypatch.setattr(sampler, "sample", sample)
    ids, outputs = _run(llm.engine, prompts, params)
    assert ids[-1] == poison_id
    assert len(llm.engine.requests[poison_id].output_token_ids) == 3
    _check(llm, prompts, params, ids, outputs)


def test_a_model_failure_fails_only_its_request(monkeypatch):
    llm = _llm(prefix_cache=True, chunked_prefill_tokens=16)
    prompts = _prompts()
    params = [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)] * len(prompts)
    runner = llm.engine.runner
    original = runner.forward

    def forward(work, pool, future=None):
        if any(MAGIC in item.new_token_ids for item in work):
            raise RuntimeError("injected kernel fault")
        return original(work, pool, future)

    monkeypatch.setattr(runner, "forward", forward)
    ids, outputs = _run(llm.engine, prompts, params)
    assert llm.engine.requests[ids[-1]].output_token_ids == []
    _check(llm, prompts, params, ids, outputs)


# ---- abort cost -----------------------------------------------------------------------------------------------
def _request(index: int) -> Request:
    return Request(f"r{index}", [1, 2, 3], SamplingParams(max_tokens=1))


def test_waiting_queue_matches_a_deque_under_random_operations():
    rng = random.Random(0)
    queue, model = WaitingQueue(), []
    live = [_request(i) for i in range(200)]
    for _ in range(2000):
        op = rng.random()
        outside = [r for r in live if r not in model]
        if op < 0.35 and outside:
            request = rng.choice(outside)
            (queue.append(request), model.append(request)) if rng.random() < 0.7 else (
                queue.appendleft(request), model.insert(0, request))
        elif op < 0.6 and model:
            request = rng.choice(model)
            queue.remove(request)
            model.remove(request)
        elif op < 0.8 and model:
            assert queue.popleft() is model.pop(0)
        assert len(queue) == len(model) and bool(queue) == bool(model)
        assert list(queue) == model
        if model:
            assert queue[0] is model[0]
        assert all((r in queue) == (r in model) for r in live[:20])


def test_abort_cost_does_not_grow_with_the_queue():
    """Removing any request is O(1): the front visits each entry at most once over the queue's life, however
    many requests are removed from the middle, and removal itself visits none (counted, not timed)."""
    for size in (1_000, 20_000):
        queue = WaitingQueue()
        requests = [_request(i) for i in range(size)]
        for request in requests:
            queue.append(request)
        rng = random.Random(size)
        for request in rng.sample(requests, size // 2):          # abort half, from anywhere in the queue
            queue.remove(request)
        assert queue.num_entry_visits == 0, "a removal walked the queue"
        assert len(queue._entries) <= 2 * len(queue) + 64, "stale entries are bounded by the live ones"
        while queue:
            queue.popleft()
        assert queue.num_entry_visits <= 2 * size

"""Random serving workloads against the engine: arrivals over time, shared prefixes, aborts, a pool too small to
hold everything, the prefix cache on and small prefill chunks. After EVERY step the engine's invariants must hold;
at the end every request is finished or aborted, every finished request produced exactly the greedy tokens of its
prompt run alone (an aborted one a prefix of them), and a flush leaves no byte in use.

The reference is exact (token ids, no tolerance): float32 greedy decoding of the same weights, one request at a
time, prefix cache off, whole-prompt prefill, a big pool.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, event, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from k3core import LLM, SamplingParams  # noqa: E402
from k3core.engine import Engine, EngineOptions  # noqa: E402

PAGE_SIZE = 4
INTERVAL = 8
MAX_PREFIX = 12          # tokens a request can share with one of the base prompts
MAX_TAIL = 6
MAX_NEW = 5
MAX_STEPS = 200          # far above what any drawn workload needs: hitting it means the engine stopped progressing


@functools.lru_cache(maxsize=None)
def _llm() -> LLM:
    return LLM("k3-tiny", backend="torch", device="cpu", dtype="float32", seed=5, page_size=PAGE_SIZE,
               checkpoint_interval=INTERVAL, prefix_cache=False, chunked_prefill_tokens=4096,
               memory_bytes=16 << 20)


@functools.lru_cache(maxsize=None)
def _reference(prompt: tuple[int, ...]) -> list[int]:
    """Greedy tokens of the prompt alone (MAX_NEW of them; a shorter max_tokens gives a prefix)."""
    out = _llm().generate([list(prompt)], SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    return out[0].token_ids


# Two base prompts that requests draw their shared prefixes from; fixed so that references are reused across runs.
_BASES = [torch.randint(0, 256, (MAX_PREFIX,), generator=torch.Generator().manual_seed(s)).tolist() for s in (1, 2)]


@dataclass
class Arrival:
    prompt: list[int]
    max_tokens: int
    arrive_step: int
    abort_step: int | None


@st.composite
def _arrivals(draw) -> list[Arrival]:
    arrivals: list[Arrival] = []
    for _ in range(draw(st.integers(2, 5))):
        if arrivals and draw(st.integers(0, 4)) == 0:      # an exact repeat of an earlier prompt
            prompt = list(draw(st.sampled_from(arrivals)).prompt)
        else:
            base = _BASES[draw(st.integers(0, len(_BASES) - 1))]
            # Shared lengths around the checkpoint interval and the page size, and the whole base, are the
            # interesting ones (a hit, a hit on a partial page, a divergence just after a checkpoint).
            prefix = base[:draw(st.sampled_from([0, 3, INTERVAL - 1, INTERVAL, INTERVAL + 1, MAX_PREFIX]))]
            tail = draw(st.lists(st.integers(0, 255), min_size=0 if prefix else 1, max_size=MAX_TAIL))
            prompt = prefix + tail
        arrivals.append(Arrival(
            prompt=prompt,
            max_tokens=draw(st.integers(1, MAX_NEW)),
            arrive_step=draw(st.integers(0, 6)),
            abort_step=draw(st.one_of(st.none(), st.none(), st.integers(0, 12)))))
    return arrivals


def _engine(chunk_tokens: int, max_running: int, pool_requests: int) -> Engine:
    """A fresh engine over the shared weights: cache on, small chunks, a pool of about `pool_requests` requests."""
    llm = _llm()
    probe = llm.engine.pool.layout
    pages = -(-(MAX_PREFIX + MAX_TAIL + MAX_NEW) // PAGE_SIZE)
    memory = int(pool_requests * (probe.slot_bytes + pages * probe.page_bytes))
    return Engine(llm, EngineOptions(prefix_cache=True, chunked_prefill_tokens=chunk_tokens,
                                     max_running_requests=max_running, page_size=PAGE_SIZE,
                                     checkpoint_interval=INTERVAL, memory_bytes=memory))


@settings(max_examples=18, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(arrivals=_arrivals(), chunk_tokens=st.integers(2, 9), max_running=st.integers(1, 4),
       pool_requests=st.sampled_from([1.5, 2, 3]))
# Found by a CI run: with nothing running, the last request's cache hit (a finished request's prefix) locked the
# only memory that could make room for it, and admission waited for it forever (the scheduler now admits it as a
# miss).
@example(arrivals=[Arrival([136, 227, 211, 30, 40, 35], 1, 2, 12), Arrival([168, 15, 237, 72, 22, 43, 210], 3, 0, 10),
                   Arrival([37, 235, 140, 72, 255, 137, 203, 133, 79], 1, 5, None),
                   Arrival([168, 15, 237, 72, 22, 43, 210, 75], 4, 2, None),
                   Arrival([37, 235, 140, 72, 255, 137, 203, 133, 79, 192, 144, 129, 78, 174, 79], 2, 6, None)],
         chunk_tokens=5, max_running=3, pool_requests=1.5)
def test_random_workload_matches_isolated_greedy(arrivals, chunk_tokens, max_running, pool_requests):
    engine = _engine(chunk_tokens, max_running, pool_requests)
    ids: dict[int, str] = {}
    step = 0
    while len(ids) < len(arrivals) or engine.has_work:
        assert step < MAX_STEPS, "the engine stopped making progress"
        for index, arrival in enumerate(arrivals):
            if arrival.arrive_step == step:
                ids[index] = engine.add_request(
                    arrival.prompt, SamplingParams(max_tokens=arrival.max_tokens, temperature=0.0, ignore_eos=True))
            if arrival.abort_step == step and index in ids:
                engine.abort(ids[index])
                engine.check_invariants()
        engine.step()
        engine.check_invariants()
        step += 1
    for index, arrival in enumerate(arrivals):
        request = engine.requests[ids[index]]
        assert request.is_finished
        expected = _reference(tuple(arrival.prompt))[:arrival.max_tokens]
        if request.finish_reason == "abort":
            assert request.output_token_ids == expected[:len(request.output_token_ids)]
        else:
            assert request.finish_reason == "length"
            assert request.output_token_ids == expected, f"request {index} ({len(arrival.prompt)} tokens) differs"
    # What this example exercised (pytest --hypothesis-show-statistics prints how often).
    event(f"retracted: {engine.scheduler.num_retractions > 0}")
    event(f"cache hit: {any(r.num_cached_tokens > 0 for r in engine.requests.values())}")
    event(f"aborted: {any(r.finish_reason == 'abort' for r in engine.requests.values())}")
    engine.flush_cache()
    engine.check_invariants()
    usage = engine.memory_usage()
    assert (usage.kda_bytes, usage.mla_bytes) == (0, 0), f"memory still held after every request ended: {usage}"

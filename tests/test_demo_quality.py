"""Quality checks on the trained default (k3-demo): on a trained model a wrong KDA checkpoint, a stale page or a
mis-scheduled chunk changes the text, so these compare what the engine produces across the system paths that must
not change it: prefix cache on and off, chunk sizes that cut the prompt at and between checkpoints, retraction
under memory pressure, overlapped and plain steps, against the committed golden continuation."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from k3core import LLM, SamplingParams
from k3core.config import resolve_model

pytest.importorskip("tiktoken")
GOLDEN = json.loads((Path(resolve_model("k3-demo")) / "golden.json").read_text())
GREEDY = SamplingParams(max_tokens=len(GOLDEN["greedy_token_ids"]), temperature=0.0, ignore_eos=True)


def _llm(**options) -> LLM:
    return LLM("k3-demo", backend="torch", device="cpu", dtype="float32", page_size=4, checkpoint_interval=8,
               **options)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """The golden prompt, a family sharing a 40-token held-out prefix, and a longer held-out window."""
    held = GOLDEN["heldout_token_ids"]
    return [GOLDEN["prompt_token_ids"], held[:40] + held[100:109], held[:40] + held[120:133], held[:75]]


@pytest.fixture(scope="module")
def reference(prompts):
    llm = _llm(prefix_cache=False, chunked_prefill_tokens=4096, overlap=False)
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def test_the_default_reproduces_its_golden_continuation(reference):
    assert reference[0] == GOLDEN["greedy_token_ids"]


@pytest.mark.parametrize("options", [
    dict(prefix_cache=True, chunked_prefill_tokens=4096),
    dict(prefix_cache=True, chunked_prefill_tokens=5),
    dict(prefix_cache=True, chunked_prefill_tokens=8, overlap=False),
    dict(prefix_cache=False, chunked_prefill_tokens=7),
], ids=["cache-one-chunk", "cache-chunk5", "cache-chunk8-plain", "nocache-chunk7"])
def test_greedy_continuations_do_not_depend_on_the_system_path(prompts, reference, options):
    llm = _llm(**options)
    for _ in range(2):                                   # the second round runs against a warm cache
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == reference
        llm.engine.check_invariants()


def test_retraction_under_memory_pressure_keeps_the_continuations(prompts, reference):
    probe = _llm()
    layout = probe.engine.pool.layout
    memory = 3 * layout.slot_bytes + 36 * layout.page_bytes      # three prompts fit, not their outputs
    llm = _llm(chunked_prefill_tokens=16, memory_bytes=memory)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == reference
    assert llm.engine.scheduler.num_retractions > 0


def test_held_out_logprobs_equal_with_the_cache_on_and_off(prompts):
    """The engine's logprob of each generated token, cached prefix or not, within float32 rounding; and the
    held-out loss of the golden window from a full forward matches the golden one."""
    held = GOLDEN["heldout_token_ids"]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    cold = _llm(prefix_cache=False).generate([held[:60]], params)[0]
    warm_llm = _llm()
    warm_llm.generate([held[:48]], params)                       # caches checkpoints of the first 48 tokens
    warm = warm_llm.generate([held[:60]], params)[0]
    assert warm.num_cached_tokens >= 40
    assert warm.token_ids == cold.token_ids
    for a, b in zip(warm.logprobs, cold.logprobs):
        assert all(abs(a[t] - b[t]) < 1e-4 for t in a)
    logits = warm_llm.prompt_logits(held).double()
    loss = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(held[1:])).item()
    assert abs(loss - GOLDEN["heldout_loss"]) < 1e-3


def test_the_triton_backend_continues_like_the_golden():
    """The cuda backend's Triton kernels (interpreted here, float32) on the trained model: the golden tokens."""
    llm = LLM("k3-demo", backend="cuda", device="cpu", dtype="float32", page_size=4, checkpoint_interval=8,
              chunked_prefill_tokens=16)
    assert llm.ops.backend == "cuda"
    out = llm.generate([GOLDEN["prompt_token_ids"]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert out[0].token_ids == GOLDEN["greedy_token_ids"][:3]

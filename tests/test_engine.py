"""The serving core end to end on the CPU: sampling options, prefix cache, chunked prefill, retraction and abort.

Every equivalence test compares against the same isolated reference: one request at a time, prefix cache off,
whole-prompt prefill, a pool far larger than needed. Greedy decoding on float32 makes that reference exact (no
tolerance): a scheduling bug that feeds a wrong token, reads a stale page or a wrong checkpoint shows up as a
different token id. Both a k3-tiny preset and a random transformers Kimi-Linear checkpoint run every equivalence.
"""
from __future__ import annotations

import functools

import pytest
import torch

from hf_helpers import save_kimi_linear
from k3core import LLM, SamplingParams

# Small pages and a short checkpoint interval so that 40-token prompts cross many page and checkpoint boundaries.
PAGE_SIZE = 4
INTERVAL = 8
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _random_prompts(seed: int, lengths, vocab: int = 256) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


def _family(seed: int, shared_len: int, tail_lens, vocab: int = 256) -> list[list[int]]:
    """Prompts that share their first `shared_len` tokens and then diverge."""
    shared = _random_prompts(seed, [shared_len], vocab)[0]
    tails = _random_prompts(seed + 1, tail_lens, vocab)
    return [shared + tail for tail in tails]


# ---- models -------------------------------------------------------------------------------------------------
def _hf_checkpoint(directory) -> str:
    """A tiny random transformers Kimi-Linear checkpoint (MLA at layers 1 and 3) with every parameter perturbed."""
    return save_kimi_linear(directory, seed=11, layer_types=["linear_attention", "full_attention"] * 2)


@pytest.fixture(scope="module", params=["k3-tiny", "hf-kimi-linear"])
def model_path(request, tmp_path_factory):
    if request.param == "k3-tiny":
        return "k3-tiny"
    return _hf_checkpoint(tmp_path_factory.mktemp("kimi_linear"))


def _llm(model: str, **options) -> LLM:
    options = {"page_size": PAGE_SIZE, "checkpoint_interval": INTERVAL, **options}
    return LLM(model, backend="torch", device="cpu", dtype="float32", seed=3, **options)


@functools.lru_cache(maxsize=None)
def _reference_llm(model: str) -> LLM:
    return _llm(model, prefix_cache=False, chunked_prefill_tokens=4096, memory_bytes=64 << 20)


def _isolated(model: str, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of `prompt` run alone: no cache, no chunking, no memory pressure."""
    return _isolated_cached(model, tuple(prompt), max_tokens)


@functools.lru_cache(maxsize=None)
def _isolated_cached(model: str, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    out = _reference_llm(model).generate([list(prompt)], SamplingParams(max_tokens=max_tokens, **GREEDY))[0]
    return out.token_ids


def _assert_all_freed(llm: LLM) -> None:
    engine = llm.engine
    engine.check_invariants()
    assert engine.flush_cache()
    usage = engine.memory_usage()
    assert (usage.kda_bytes, usage.mla_bytes) == (0, 0), f"memory still held after flush: {usage}"
    assert (usage.num_slots, usage.num_pages) == (0, 0)


def _pool_for(llm: LLM, num_requests: int, tokens_per_request: int) -> int:
    """Bytes of a pool holding about `num_requests` requests of `tokens_per_request` tokens (slot + pages)."""
    layout = llm.engine.pool.layout
    pages = -(-tokens_per_request // PAGE_SIZE)
    return num_requests * (layout.slot_bytes + pages * layout.page_bytes)


# ---- sampling -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    return _llm("k3-tiny", chunked_prefill_tokens=16)


def _spy_logits(llm, monkeypatch) -> list[tuple[str, int, torch.Tensor]]:
    """Record (request id, sampled token, logits it was sampled from) for every sampled token."""
    seen = []
    sampler = llm.engine.sampler
    original = sampler.sample

    def spy(logits, rows):
        sample = original(logits, rows)
        ids = sample.token_ids.tolist()          # a sync the engine itself avoids: tests only
        seen.extend((row.request_id, ids[i], logits[i].clone()) for i, row in enumerate(rows))
        return sample

    monkeypatch.setattr(sampler, "sample", spy)
    return seen


def test_greedy_follows_full_forward_argmax(tiny):
    prompt = _random_prompts(1, [13])[0]
    out = tiny.generate([prompt], SamplingParams(max_tokens=6, **GREEDY))[0]
    logits = tiny.prompt_logits(prompt + out.token_ids[:-1])                              # [T, V]
    assert out.token_ids == logits[len(prompt) - 1:].argmax(dim=-1).tolist()
    assert out.finish_reason == "length"


def test_seed_reproduces_tokens_even_in_a_different_batch(tiny):
    prompts = _random_prompts(2, [5, 17, 9])
    sampled = SamplingParams(max_tokens=10, temperature=1.3, seed=77, ignore_eos=True)
    alone = tiny.generate([prompts[0]], sampled)[0].token_ids
    batch_params = [sampled, SamplingParams(max_tokens=4, temperature=1.0, seed=5, ignore_eos=True),
                    SamplingParams(max_tokens=12, temperature=0.7, ignore_eos=True)]
    batched = tiny.generate(prompts, batch_params)[0].token_ids
    assert batched == alone
    # Behind the batch, the other seeded request draws from its own generator too.
    assert tiny.generate([prompts[1]], batch_params[1])[0].token_ids == \
        tiny.generate(prompts[:2], batch_params[:2])[1].token_ids
    others = {tuple(tiny.generate([prompts[0]], SamplingParams(max_tokens=10, temperature=1.3, seed=s,
                                                                ignore_eos=True))[0].token_ids)
              for s in (1, 2, 3)}
    assert others != {tuple(alone)}, "different seeds gave the same tokens: the seed is not used"


@pytest.mark.parametrize("filters", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_filters_that_keep_one_token_are_greedy(tiny, filters):
    prompt = _random_prompts(3, [11])[0]
    greedy = tiny.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0].token_ids
    params = SamplingParams(max_tokens=8, temperature=2.0, seed=4, ignore_eos=True, **filters)
    assert tiny.generate([prompt], params)[0].token_ids == greedy


@pytest.mark.parametrize("filters", [dict(top_k=3), dict(top_p=0.3), dict(min_p=0.5),
                                     dict(top_k=5, top_p=0.6, min_p=0.2)])
def test_sampled_tokens_respect_the_filters(tiny, monkeypatch, filters):
    temperature = 1.5
    seen = _spy_logits(tiny, monkeypatch)
    prompts = _random_prompts(4, [6, 21])
    params = [SamplingParams(max_tokens=12, temperature=temperature, seed=10 + i, ignore_eos=True, **filters)
              for i in range(len(prompts))]
    tiny.generate(prompts, params)
    assert len(seen) == 24
    for _, token, logits in seen:
        probs = torch.softmax(logits.double() / temperature, dim=-1)                       # [V] float64
        order = torch.argsort(probs, descending=True, stable=True)
        rank = int((order == token).nonzero()[0, 0])
        if "top_k" in filters:
            assert rank < filters["top_k"]
        kept = probs[order[:filters.get("top_k", len(order))]]
        kept = kept / kept.sum()
        if "top_p" in filters:     # the mass of the tokens ranked before it is below top_p
            assert float(kept[:rank].sum()) < filters["top_p"] + 1e-6
        if "min_p" in filters:
            assert float(kept[rank]) >= filters["min_p"] * float(kept[0]) - 1e-6


def test_max_tokens_finishes_with_length(tiny):
    for max_tokens in (1, 2, 7):
        out = tiny.generate([[7, 8, 9]], SamplingParams(max_tokens=max_tokens, **GREEDY))[0]
        assert len(out.token_ids) == max_tokens and out.finish_reason == "length"


def test_stop_token_ids_end_the_request(tiny):
    prompt = _random_prompts(5, [9])[0]
    full = tiny.generate([prompt], SamplingParams(max_tokens=12, **GREEDY))[0].token_ids
    stop = full[5]
    out = tiny.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=[stop], **GREEDY))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full[:full.index(stop) + 1]


def test_stop_string_truncates_text_before_it(tiny):
    # The byte-level tokenizer decodes every id; find a prompt whose continuation has printable text to stop on.
    for seed in range(40):
        prompt = _random_prompts(100 + seed, [7])[0]
        full = tiny.generate([prompt], SamplingParams(max_tokens=16, **GREEDY))[0]
        text = full.text
        candidates = [i for i in range(2, len(text) - 1)
                      if text[i:i + 2].isprintable() and "\ufffd" not in text[i:i + 2]]
        if candidates:
            break
    else:
        pytest.skip("no printable two-character stop string in 40 greedy continuations")
    stop = text[candidates[0]: candidates[0] + 2]
    out = tiny.generate([prompt], SamplingParams(max_tokens=16, stop=[stop, "never-there"], **GREEDY))[0]
    # Expected: the first token whose decoded prefix contains the stop string ends the request.
    num = next(n for n in range(1, len(full.token_ids) + 1) if stop in tiny.tokenizer.decode(full.token_ids[:n]))
    decoded = tiny.tokenizer.decode(full.token_ids[:num])
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[:num]
    assert out.text == decoded[:decoded.index(stop)]
    assert stop not in out.text


def test_eos_stops_unless_ignore_eos(monkeypatch):
    llm = _llm("k3-tiny")
    prompt = _random_prompts(6, [10])[0]
    full = llm.generate([prompt], SamplingParams(max_tokens=10, **GREEDY))[0].token_ids
    eos = full[4]
    monkeypatch.setattr(llm.engine, "eos_token_ids", {eos})
    stopped = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == full[:full.index(eos) + 1]
    ignored = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert ignored.finish_reason == "length" and ignored.token_ids == full


# ---- scheduling equivalence (both models) --------------------------------------------------------------------
def _workload(vocab: int) -> list[list[int]]:
    """Mixed lengths, a family sharing a 13-token prefix, an exact repeat, a one-token prompt (short: CI is slow)."""
    family = _family(20, 13, [3, 6, 1], vocab)
    singles = _random_prompts(21, [1, 5, 11], vocab)
    return family + singles + [family[0]]


MAX_TOKENS = 6


def _check_equivalent(model: str, llm: LLM, prompts, outs) -> None:
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == _isolated(model, prompt, MAX_TOKENS), f"prompt of {len(prompt)} tokens differs"
        assert out.finish_reason == "length"


@pytest.mark.parametrize("options", [
    dict(prefix_cache=True, chunked_prefill_tokens=512),
    dict(prefix_cache=True, chunked_prefill_tokens=3),
    dict(prefix_cache=False, chunked_prefill_tokens=3, max_running_requests=2),
], ids=["cache", "cache-chunk3", "nocache-chunk3-max2"])
def test_greedy_outputs_do_not_depend_on_scheduling(model_path, options):
    llm = _llm(model_path, **options)
    prompts = _workload(llm.config.vocab_size)
    params = SamplingParams(max_tokens=MAX_TOKENS, **GREEDY)
    for _ in range(2 if options["prefix_cache"] else 1):      # the second round runs against a warm cache
        outs = llm.generate(prompts, params)
        _check_equivalent(model_path, llm, prompts, outs)
        llm.engine.check_invariants()
    _assert_all_freed(llm)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_retraction_under_memory_pressure_keeps_outputs(model_path, prefix_cache):
    probe = _llm(model_path)
    prompts = _random_prompts(30, [29, 35, 40, 33, 24], probe.config.vocab_size)
    prompts += [prompts[0][:20] + p for p in _random_prompts(31, [15, 17], probe.config.vocab_size)]
    max_tokens = 14
    memory = _pool_for(probe, 2, 60)
    llm = _llm(model_path, prefix_cache=prefix_cache, chunked_prefill_tokens=16, memory_bytes=memory)
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, **GREEDY)
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_work:
        engine.step()
        engine.check_invariants()
    assert engine.scheduler.num_retractions > 0, "the pool was meant to be too small to hold every request"
    for request_id, prompt in zip(ids, prompts):
        request = engine.requests[request_id]
        assert request.finish_reason == "length"
        assert request.output_token_ids == _isolated(model_path, prompt, max_tokens)
    _assert_all_freed(llm)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_request_retracted_after_its_decode_was_scheduled(prefix_cache):
    # A (short prompt, arrived first) gets its decode scheduled, then B's decode needs a page and retracts A, the
    # cheapest to recompute; A's freed slot lets it be readmitted in the same step. Its decode from before the
    # retraction must not run (it would feed a token into pages A no longer holds).
    probe = _llm("k3-tiny")
    layout = probe.engine.pool.layout
    short, long = _random_prompts(0, [5, 30])
    llm = _llm("k3-tiny", prefix_cache=prefix_cache, chunked_prefill_tokens=64,
               memory_bytes=2 * layout.slot_bytes + 10 * layout.page_bytes)
    engine = llm.engine
    ids = [engine.add_request(short, SamplingParams(max_tokens=30, **GREEDY)),
           engine.add_request(long, SamplingParams(max_tokens=12, **GREEDY))]
    while engine.has_work:
        engine.step()
        engine.check_invariants()
    assert engine.scheduler.num_retractions > 0
    for request_id, prompt, max_tokens in zip(ids, (short, long), (30, 12)):
        assert engine.requests[request_id].output_token_ids == _isolated("k3-tiny", prompt, max_tokens)
    _assert_all_freed(llm)


# ---- prefix cache -------------------------------------------------------------------------------------------
def test_repeated_prompt_hits_all_but_the_last_token(model_path):
    llm = _llm(model_path)
    params = SamplingParams(max_tokens=4, **GREEDY)
    for length in (1, 2, 5, 8, 9, 26):
        prompt = _random_prompts(40 + length, [length], llm.config.vocab_size)[0]
        first = llm.generate([prompt], params)[0]
        second = llm.generate([prompt], params)[0]
        assert first.num_cached_tokens == 0
        assert second.num_cached_tokens == length - 1
        assert first.token_ids == second.token_ids == _isolated(model_path, prompt, 4)
        llm.engine.check_invariants()
    _assert_all_freed(llm)


@pytest.mark.parametrize("shared_len", [8, 21, 37])
def test_a_family_reuses_its_shared_prefix(model_path, shared_len):
    llm = _llm(model_path)
    prompts = _family(50 + shared_len, shared_len, [5, 7, 3], llm.config.vocab_size)
    params = SamplingParams(max_tokens=4, **GREEDY)
    outs = [llm.generate([p], params)[0] for p in prompts]
    assert outs[0].num_cached_tokens == 0
    assert outs[1].num_cached_tokens >= shared_len // INTERVAL * INTERVAL
    assert outs[2].num_cached_tokens >= shared_len
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == _isolated(model_path, prompt, 4)
    llm.engine.check_invariants()
    _assert_all_freed(llm)


def test_cache_eviction_keeps_outputs_and_frees_everything():
    # A pool of about three requests and twelve distinct prompts: the cache must evict to admit new ones.
    probe = _llm("k3-tiny")
    llm = _llm("k3-tiny", memory_bytes=_pool_for(probe, 3, 48), chunked_prefill_tokens=24)
    prompts = _random_prompts(60, [30, 31, 17, 40, 22, 9, 35, 28, 19, 33, 12, 26])
    params = SamplingParams(max_tokens=MAX_TOKENS, **GREEDY)
    for prompt in prompts + prompts[:3]:
        out = llm.generate([prompt], params)[0]
        assert out.token_ids == _isolated("k3-tiny", prompt, MAX_TOKENS)
        llm.engine.check_invariants()
    assert llm.engine.cache.evicted_pages > 0
    _assert_all_freed(llm)


# ---- abort --------------------------------------------------------------------------------------------------
def _drive(engine, steps: int) -> None:
    for _ in range(steps):
        engine.step()
        engine.check_invariants()


@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("when", ["queued", "mid-prefill", "decoding", "after-first-token"])
def test_abort_frees_everything_and_spares_the_others(model_path, prefix_cache, when):
    llm = _llm(model_path, prefix_cache=prefix_cache, chunked_prefill_tokens=5, max_running_requests=2)
    engine = llm.engine
    vocab = llm.config.vocab_size
    victim_prompt, *others = _family(70, 16, [20, 4, 9, 6], vocab)
    params = SamplingParams(max_tokens=8, **GREEDY)
    if when == "queued":     # two others fill max_running_requests, the victim waits behind them
        survivors = [(engine.add_request(p, params), p) for p in others[:2]]
        victim = engine.add_request(victim_prompt, params)
        _drive(engine, 2)
        assert engine.requests[victim] in engine.scheduler.waiting
    else:
        victim = engine.add_request(victim_prompt, params)
        survivors = [(engine.add_request(others[0], params), others[0])]
        request = engine.requests[victim]
        if when == "mid-prefill":
            _drive(engine, 2)
            assert 0 < request.num_computed_tokens < len(victim_prompt)
        else:
            target = 1 if when == "after-first-token" else 3
            while len(request.output_token_ids) < target:
                _drive(engine, 1)
    survivors.append((engine.add_request(others[2], params), others[2]))     # arrives after the victim started
    assert engine.abort(victim)
    assert not engine.abort(victim), "a second abort of the same request must be a no-op"
    engine.check_invariants()
    request = engine.requests[victim]
    assert request.working_slot is None and not request.page_handles and request.cache_node is None
    assert request not in engine.scheduler.running and request not in engine.scheduler.waiting
    while engine.has_work:
        _drive(engine, 1)
    for request_id, prompt in survivors:
        assert engine.requests[request_id].output_token_ids == _isolated(model_path, prompt, 8)
    assert engine.requests[victim].finish_reason == "abort"
    _assert_all_freed(llm)


def test_abort_everything_mid_flight_leaves_nothing():
    llm = _llm("k3-tiny", chunked_prefill_tokens=6)
    engine = llm.engine
    prompts = _family(80, 19, [14, 2, 30, 5])
    ids = [engine.add_request(p, SamplingParams(max_tokens=20, **GREEDY)) for p in prompts]
    _drive(engine, 7)
    for request_id in ids:
        engine.abort(request_id)
        engine.check_invariants()
    assert not engine.has_work
    _assert_all_freed(llm)
    # The engine still serves correctly afterwards.
    out = llm.generate([prompts[1]], SamplingParams(max_tokens=5, **GREEDY))[0]
    assert out.token_ids == _isolated("k3-tiny", prompts[1], 5)


# ---- budget-only prefill chunks and overlapped steps ------------------------------------------------------------
def test_a_prefill_chunk_crosses_checkpoints_and_snapshots_each(model_path):
    """One chunk holds the whole prompt (several checkpoint positions inside it); the cache still gets a checkpoint
    at each, so a later prompt sharing part of it hits the longest shared checkpoint, with unchanged outputs."""
    llm = _llm(model_path, chunked_prefill_tokens=4096)
    vocab = llm.config.vocab_size
    first, second, third = _family(90, 5 * INTERVAL + 3, [4, 0, 0], vocab)
    second = second[: 3 * INTERVAL + 5] + _random_prompts(91, [6], vocab)[0]     # shares 3 checkpoints and a bit
    third = first[: 5 * INTERVAL + 3]                                            # ends past the 5th checkpoint
    params = SamplingParams(max_tokens=4, **GREEDY)
    steps = llm.engine.num_steps
    out_first = llm.generate([first], params)[0]
    assert llm.engine.num_steps - steps <= 1 + 4, "the prompt was cut into several prefill chunks"
    out_second = llm.generate([second], params)[0]
    out_third = llm.generate([third], params)[0]
    assert out_second.num_cached_tokens == 3 * INTERVAL
    assert out_third.num_cached_tokens == 5 * INTERVAL
    for prompt, out in ((first, out_first), (second, out_second), (third, out_third)):
        assert out.token_ids == _isolated(model_path, prompt, 4)
    llm.engine.check_invariants()
    _assert_all_freed(llm)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_overlapped_steps_give_the_plain_loops_outputs(prefix_cache):
    """Greedy, seeded sampling with penalties, stop strings, min_tokens, logprobs and retraction under memory
    pressure: the overlapped loop emits exactly what the plain loop emits, token by token and in text."""
    probe = _llm("k3-tiny")
    vocab = probe.config.vocab_size
    prompts = _random_prompts(60, [29, 3, 40, 17, 1, 33], vocab) + _family(61, 2 * INTERVAL + 1, [2, 9], vocab)
    params = [SamplingParams(max_tokens=14, **GREEDY),
              SamplingParams(max_tokens=9, temperature=1.1, seed=7, top_p=0.8, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.9, seed=8, presence_penalty=0.5, frequency_penalty=0.3,
                             repetition_penalty=1.2, logprobs=3, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=1.0, seed=9, min_tokens=6, top_k=20),
              SamplingParams(max_tokens=8, temperature=1.3, seed=10, stop=["a", "e"], ignore_eos=True),
              SamplingParams(max_tokens=11, **GREEDY),
              SamplingParams(max_tokens=6, temperature=0.7, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=6, **GREEDY)]
    memory = _pool_for(probe, 2, 60)
    results = {}
    for overlap in (False, True):
        llm = _llm("k3-tiny", prefix_cache=prefix_cache, chunked_prefill_tokens=16, memory_bytes=memory,
                   overlap=overlap)
        assert llm.engine.overlap is overlap
        outs = llm.generate(prompts, params)
        llm.engine.check_invariants()
        _assert_all_freed(llm)
        results[overlap] = [(o.token_ids, o.text, o.finish_reason, o.logprobs) for o in outs]
        if not overlap:
            assert llm.engine.scheduler.num_retractions > 0, "the pool was meant to force retractions"
    for plain, overlapped in zip(results[False], results[True]):
        assert overlapped[:3] == plain[:3]
        if plain[3] is not None:                 # logprobs: same ids, values to float32 rounding of the batch
            assert [list(d) for d in overlapped[3]] == [list(d) for d in plain[3]]
            for a, b in zip(overlapped[3], plain[3]):
                assert all(abs(a[t] - b[t]) < 1e-5 for t in a), (a, b)

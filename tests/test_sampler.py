"""The batched sampler (k3core.sampler) and the `sample` op it calls, against float64 host references.

Distribution checks draw many rows in one call (each row its own seed) and compare the empirical frequencies with
the filtered softmax computed in float64; the bound is chosen so that the distribution a wrong filter would give
fails it (asserted in each test)."""
from __future__ import annotations

import math

import pytest
import torch

from k3core.sampler import HostSample, SampleRow, Sampler, filter_width
from k3core.sampling_params import SamplingParams
from kernels.torch.sampling import _kept_tokens, sample, uniform_noise

F64 = torch.float64
EOS = 2


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_sampler(vocab: int, eos=(EOS,)) -> Sampler:
    return Sampler(vocab, "cpu", set(eos))


def add(sampler: Sampler, request_id: str, prompt=(1, 2, 3), **params) -> SampleRow:
    p = SamplingParams(max_tokens=100, **params)
    sampler.add_request(request_id, p, list(prompt))
    return SampleRow(request_id, p, [], list(prompt))


def with_output(row: SampleRow, output) -> SampleRow:
    return SampleRow(row.request_id, row.params, list(output), row.prompt_token_ids, row.allowed_token_mask)


def run(sampler: Sampler, logits: torch.Tensor, rows) -> HostSample:
    out = sampler.sample(logits, rows)
    out.start_copy()
    return out.result()


# ---- the reference of the documented filters (float64, one row at a time, a stable sort) -----------------------
def reference_kept(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> set[int]:
    vocab = logits.shape[0]
    values, ids = torch.sort(logits.to(F64) / temperature, descending=True, stable=True)   # ties: lower id first
    k = top_k if 0 < top_k < vocab else vocab
    probs = torch.softmax(values[:k], dim=0)
    kept = []
    mass = 0.0
    for i in range(k):
        if (top_p >= 1 or mass < top_p) and probs[i] >= min_p * probs[0]:
            kept.append(int(ids[i]))
            mass += float(probs[i])
        else:
            break
    return set(kept) or {int(ids[0])}


def filtered_softmax(logits: torch.Tensor, temperature: float, kept: set[int]) -> torch.Tensor:
    scaled = logits.to(F64) / temperature
    mask = torch.full_like(scaled, -math.inf)
    mask[list(kept)] = 0.0
    return torch.softmax(scaled + mask, dim=0)


def draw_many(logits_row: torch.Tensor, num: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
              position=0) -> torch.Tensor:
    """num draws of one row (seeds 0..num-1) in one op call -> empirical frequencies [V]."""
    vocab = logits_row.shape[0]
    full = lambda v, dtype=torch.float32: torch.full((num,), v, dtype=dtype)  # noqa: E731
    width = filter_width([top_k], [top_p], [min_p], [False], vocab)
    ids = sample(logits_row[None].expand(num, vocab), full(temperature), full(top_k, torch.int64), full(top_p),
                 full(min_p), torch.arange(num, dtype=torch.int64), full(position, torch.int64), width)
    return torch.bincount(ids, minlength=vocab).to(F64) / num


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


# ---- greedy -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax_of_the_processed_logits(dtype):
    vocab = 97
    sampler = make_sampler(vocab)
    logits = torch.randn(5, vocab, generator=seeded(1)).to(dtype)
    logits[0, [10, 40]] = 30.0                                             # a tie: the lower id wins
    logits[4, [3, 5]] = 30.0
    rows = [add(sampler, "plain", temperature=0.0),
            add(sampler, "tie", temperature=1e-40),                         # subnormal: greedy, not a crash
            add(sampler, "bias", temperature=0.0, logit_bias={7: 50.0}),
            add(sampler, "penalised", temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5),
            add(sampler, "banned", temperature=0.0, min_tokens=3, stop_token_ids=[3], prompt=(3, 5))]
    rows[1] = SampleRow("tie", rows[1].params, [], [1], None)
    logits[1] = logits[0]
    processed = sampler.processed_logits(logits, rows)
    got = run(sampler, logits, rows).token_ids
    assert got == torch.argmax(processed, dim=-1).tolist()
    assert got[0] == 10 and got[1] == 10 and got[2] == 7 and got[4] == 5
    assert torch.equal(torch.argmax(logits[:2].float(), -1), torch.tensor(got[:2]))


# ---- reproducible seeds -------------------------------------------------------------------------------------
def test_a_seeded_row_gives_the_same_tokens_alone_in_any_batch_and_order():
    vocab = 300
    gen = seeded(2)
    settings = [dict(temperature=0.9, seed=11), dict(temperature=1.2, top_k=20, seed=-5),
                dict(temperature=0.7, top_p=0.8, seed=2 ** 62), dict(temperature=1.0, min_p=0.1, seed=0),
                dict(temperature=1.0, top_k=50, top_p=0.9, min_p=0.02, seed=3)]
    others = [dict(temperature=1.5, top_p=0.5), dict(temperature=0.0), dict(temperature=1.0, top_k=3),
              dict(temperature=0.8)]
    steps = [torch.randn(vocab, generator=gen) * 3 for _ in range(6)]
    other_logits = [torch.randn(len(others), vocab, generator=gen) * 3 for _ in range(6)]

    def generate(order: list[int], with_others: bool) -> dict[str, list[int]]:
        sampler = make_sampler(vocab)
        rows = {f"s{i}": add(sampler, f"s{i}", **settings[i]) for i in range(len(settings))}
        if with_others:
            rows.update({f"o{i}": add(sampler, f"o{i}", **others[i]) for i in range(len(others))})
        outputs = {name: [] for name in rows}
        for step in range(len(steps)):
            names = [f"s{i}" for i in order] + ([f"o{i}" for i in range(len(others))] if with_others else [])
            if with_others:
                names = names[::2] + names[1::2]                          # interleave seeded and other rows
            logits = torch.stack([steps[step] * (1 + 0.1 * int(n[1:])) if n.startswith("s")
                                  else other_logits[step][int(n[1:])] for n in names])
            result = run(sampler, logits, [with_output(rows[n], outputs[n]) for n in names])
            for name, token in zip(names, result.token_ids):
                outputs[name].append(token)
        return {n: t for n, t in outputs.items() if n.startswith("s")}

    alone = {}
    for i in range(len(settings)):
        alone.update({f"s{i}": generate([i], False)[f"s{i}"]})
    assert generate(list(range(len(settings))), False) == alone
    assert generate(list(reversed(range(len(settings)))), True) == alone
    assert len({tuple(t) for t in alone.values()}) > 1
    assert any(len(set(t)) > 1 for t in alone.values()), "positions must change the draw from step to step"


def test_placeholders_and_unseeded_requests():
    """Position counts placeholders; a request without a seed gets its own random one (torch.manual_seed
    replays it)."""
    vocab = 50
    logits = torch.randn(1, vocab, generator=seeded(3)) * 0.1
    a, b = make_sampler(vocab), make_sampler(vocab)
    row_a = add(a, "r", temperature=1.0, seed=9, frequency_penalty=1.0)
    row_b = add(b, "r", temperature=1.0, seed=9, frequency_penalty=1.0)
    real, seen = [], []
    for _ in range(8):
        token_a = run(a, logits, [with_output(row_a, real)]).token_ids[0]
        token_b = run(b, logits, [with_output(row_b, [-1] * len(seen))]).token_ids[0]
        real.append(token_a)
        seen.append(token_b)
    assert real == seen
    flat = torch.zeros(6, vocab)
    replays = []
    for _ in range(2):
        torch.manual_seed(1234)                          # unseeded requests draw their seed from torch's RNG
        unseeded = make_sampler(vocab)
        rows = [add(unseeded, f"u{i}", temperature=1.0) for i in range(6)]
        replays.append(run(unseeded, flat, rows).token_ids)
    assert replays[0] == replays[1] and len(set(replays[0])) > 1


def test_noise_is_uniform_and_never_zero_or_one():
    u = uniform_noise(torch.tensor([0, 1, -7, 2 ** 63 - 1]), torch.tensor([0, 5, 5, 2 ** 40]), 20000).to(F64)
    assert float(u.min()) > 0 and float(u.max()) < 1
    # each row: Kolmogorov-Smirnov distance to U(0, 1) well under the 0.1% critical value 1.95 / sqrt(n)
    for row in u:
        values = row.sort().values
        grid = torch.arange(1, values.numel() + 1, dtype=F64) / values.numel()
        assert float((values - grid).abs().max()) < 1.95 / math.sqrt(values.numel())
    assert float(torch.corrcoef(u)[0, 1:].abs().max()) < 0.05


# ---- distributions ------------------------------------------------------------------------------------------
DRAWS = 40000
TV_BOUND = 0.02      # 40000 draws over <= 8 live tokens: the sampling noise of the TV distance is ~0.006


@pytest.mark.parametrize("setting", [dict(temperature=1.0), dict(temperature=0.6), dict(temperature=1.0, top_k=3),
                                     dict(temperature=1.0, top_p=0.75), dict(temperature=1.4, min_p=0.2),
                                     dict(temperature=0.9, top_k=5, top_p=0.8, min_p=0.1)])
def test_draws_follow_the_filtered_softmax(setting):
    logits = torch.tensor([2.0, 1.6, 1.2, 0.9, 0.3, 0.0, -0.4, -1.0, -9.0, -9.5])
    full = {**dict(top_k=0, top_p=1.0, min_p=0.0), **setting}
    kept = reference_kept(logits, full["temperature"], full["top_k"], full["top_p"], full["min_p"])
    want = filtered_softmax(logits, full["temperature"], kept)
    got = draw_many(logits, DRAWS, **setting)
    assert set(got.nonzero().flatten().tolist()) <= kept, "a filtered token was drawn"
    assert total_variation(got, want) < TV_BOUND
    if kept != set(range(10)):                                                   # the bound can tell filters apart
        assert total_variation(want, filtered_softmax(logits, full["temperature"], set(range(10)))) > 3 * TV_BOUND
    draws_at_other_position = draw_many(logits, DRAWS, position=7, **setting)
    assert total_variation(draws_at_other_position, want) < TV_BOUND


def test_the_filters_cut_exactly_the_documented_set():
    """_kept_tokens vs the float64 one-row reference, on bf16-rounded logits full of ties, through the top-k
    path (width = the largest top_k) and the sort path (width = V)."""
    gen = seeded(5)
    vocab, rows = 64, 40
    logits = (torch.randn(rows, vocab, generator=gen) * 2).to(torch.bfloat16).float()
    logits[:, 10:20] = logits[:, 10:11]                                          # ten-way ties
    temperature = torch.rand(rows, generator=gen) + 0.5
    top_k = torch.randint(1, 30, (rows,), generator=gen)
    top_p = torch.rand(rows, generator=gen) * 0.9 + 0.05
    min_p = torch.rand(rows, generator=gen) * 0.3
    top_k[::4], top_p[1::4], min_p[2::4] = 0, 1.0, 0.0
    scaled = logits / temperature[:, None]
    for width in (int(top_k.max()), vocab):
        keep = _kept_tokens(scaled, top_k, top_p, min_p, width)
        for r in range(rows):
            k = int(top_k[r]) if width < vocab or int(top_k[r]) > 0 else 0
            if width < vocab and k == 0:
                continue                                                         # a top_k-less row needs width V
            want = reference_kept(logits[r], float(temperature[r]), int(top_k[r]), float(top_p[r]), float(min_p[r]))
            assert set(keep[r].nonzero().flatten().tolist()) == want, (width, r)


def test_top_k_ties_at_the_boundary_keep_the_lowest_ids():
    logits = torch.tensor([1.0, 3.0, 2.0, 2.0, 2.0, 0.0])
    for top_k, kept in ((2, {1, 2}), (3, {1, 2, 3}), (4, {1, 2, 3, 4})):
        got = draw_many(logits, 4000, temperature=0.5, top_k=top_k)
        assert set(got.nonzero().flatten().tolist()) == kept


# ---- logit processing ---------------------------------------------------------------------------------------
def test_penalties_min_tokens_and_logit_bias_follow_the_formulas():
    vocab = 40
    sampler = make_sampler(vocab, eos=(EOS, 39))
    gen = seeded(6)
    prompt = [4, 5, 5, 9]
    rows = [add(sampler, "pen", prompt, temperature=1.0, seed=1, presence_penalty=0.7, frequency_penalty=-0.3,
                repetition_penalty=1.4, logit_bias={4: 2.5, 30: -100.0}),
            add(sampler, "min", prompt, temperature=1.0, seed=2, min_tokens=3, stop_token_ids=[6, 7]),
            add(sampler, "min_ignore_eos", prompt, temperature=1.0, seed=3, min_tokens=9, ignore_eos=True,
                stop_token_ids=[8]),
            add(sampler, "plain", prompt, temperature=1.0, seed=4)]
    outputs = [[] for _ in rows]
    for step in range(6):
        logits = torch.randn(len(rows), vocab, generator=gen) * 2
        logits[0, :20] = logits[0, :20].abs() * torch.tensor([1, -1] * 10)      # both signs for repetition
        logits[0, [11, 12]] = 9.0                                                # repeats: counts above 1
        current = [with_output(r, o) for r, o in zip(rows, outputs)]
        got = sampler.processed_logits(logits, current).to(F64)
        want = logits.to(F64).clone()
        # logit_bias first, then min_tokens, then penalties
        want[0, 4] += 2.5
        want[0, 30] -= 100.0
        if step < 3:
            want[1, [EOS, 39, 6, 7]] = -math.inf
        want[2, 8] = -math.inf                                                   # ignore_eos: EOS stays
        counts = torch.bincount(torch.tensor(outputs[0], dtype=torch.int64), minlength=vocab).to(F64)
        seen = (counts > 0) | torch.isin(torch.arange(vocab), torch.tensor(prompt))
        row = want[0]
        row = torch.where(seen, torch.where(row > 0, row / 1.4, row * 1.4), row)
        want[0] = row - (-0.3) * counts - 0.7 * (counts > 0).to(F64)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
        result = run(sampler, logits, current)
        for o, token in zip(outputs, result.token_ids):
            o.append(token)
        if step < 3:
            assert result.token_ids[1] not in (EOS, 39, 6, 7)
        assert result.token_ids[2] != 8
    assert max(outputs[0].count(t) for t in outputs[0]) >= 3, "frequency and presence must differ somewhere"


def test_a_freed_count_slot_starts_clean():
    vocab = 16
    sampler = make_sampler(vocab)
    row = add(sampler, "a", temperature=0.0, frequency_penalty=2.0)
    logits = torch.zeros(1, vocab)
    logits[0, 3] = 1.0
    first = run(sampler, logits, [row]).token_ids[0]
    assert first == 3
    assert sampler.processed_logits(logits, [with_output(row, [3])])[0, 3] == -1.0    # 1 - 2 * 1
    sampler.remove_request("a")
    fresh = add(sampler, "b", temperature=0.0, frequency_penalty=2.0)
    assert sampler.processed_logits(logits, [fresh])[0, 3] == 1.0
    sampler.remove_request("b")
    sampler.remove_request("b")                                                  # unknown: nothing to do
    assert sampler.num_requests == 0


def test_allowed_token_mask_restricts_the_draw():
    vocab = 30
    sampler = make_sampler(vocab)
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[[5, 6, 21]] = True
    rows = [SampleRow(f"r{i}", SamplingParams(temperature=1.0 if i else 0.0), [], [1], allowed) for i in range(64)]
    rows.append(SampleRow("free", SamplingParams(temperature=0.0), [], [1]))
    for row in rows:
        sampler.add_request(row.request_id, row.params, row.prompt_token_ids)
    logits = torch.randn(len(rows), vocab, generator=seeded(7))
    logits[:, 0] = 50.0
    got = run(sampler, logits, rows).token_ids
    assert set(got[:-1]) <= {5, 6, 21} and len(set(got[1:-1])) > 1
    assert got[0] == [5, 6, 21][int(logits[0, [5, 6, 21]].argmax())]
    assert got[-1] == 0


# ---- logprobs -----------------------------------------------------------------------------------------------
def test_logprobs_are_the_raw_log_softmax_with_the_sampled_token():
    vocab = 64
    sampler = make_sampler(vocab)
    counts = [None, 0, 1, 5, 20]
    rows = [add(sampler, f"r{i}", temperature=1.0, top_k=40, seed=i, logprobs=n, logit_bias={1: -5.0})
            for i, n in enumerate(counts)]
    logits = (torch.randn(len(rows), vocab, generator=seeded(8)) * 3).to(torch.bfloat16)
    result = run(sampler, logits, rows)
    reference = torch.log_softmax(logits.to(F64), dim=-1)
    assert result.logprobs[0] is None
    for row, n in enumerate(counts[1:], start=1):
        entry = result.logprobs[row]
        token = result.token_ids[row]
        assert token in entry and len(entry) in (n, n + 1) and list(entry)[0] == token
        top = set(reference[row].topk(n).indices.tolist()) if n else set()
        assert set(entry) == top | {token}
        for token_id, value in entry.items():
            assert abs(value - float(reference[row, token_id])) < 1e-5


def test_sample_does_not_read_device_values_back(monkeypatch):
    """No .tolist() / .item() / bool() of a tensor inside sample(): the one sync is DeviceSample.result()."""
    vocab = 50
    sampler = make_sampler(vocab)
    rows = [add(sampler, "a", temperature=0.8, top_p=0.9, logprobs=3, presence_penalty=0.5, logit_bias={3: 1.0},
                min_tokens=2),
            add(sampler, "b", temperature=0.0, top_k=4), add(sampler, "c", temperature=1.0)]
    logits = torch.randn(3, vocab, generator=seeded(9))

    def forbidden(*args, **kwargs):
        raise AssertionError("a host sync inside Sampler.sample")

    with monkeypatch.context() as patch:
        for name in ("tolist", "item", "__bool__", "cpu", "numpy"):
            patch.setattr(torch.Tensor, name, forbidden)
        device_sample = sampler.sample(logits, rows)
        device_sample.start_copy()
    assert device_sample.token_ids.dtype == torch.int64 and device_sample.token_ids.shape == (3,)
    result = device_sample.result()
    assert len(result.token_ids) == 3 and result.logprobs[1] is None


# ---- validation ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [dict(top_k=2 ** 63), dict(top_k=-2), dict(top_k=1.5), dict(top_p=1e-50),
                                 dict(top_p=0.0), dict(top_p=float("nan")), dict(top_p=1.5),
                                 dict(temperature=float("nan")), dict(temperature=float("inf")),
                                 dict(temperature=1e39), dict(temperature=-1e-9), dict(min_p=float("nan")),
                                 dict(min_p=1.5), dict(seed=2 ** 63), dict(seed=-2 ** 63 - 1), dict(seed=1.0),
                                 dict(logprobs=21), dict(logprobs=True), dict(presence_penalty=2.5),
                                 dict(frequency_penalty=float("nan")), dict(repetition_penalty=0.0),
                                 dict(repetition_penalty=1e-50), dict(repetition_penalty=float("inf")),
                                 dict(min_tokens=17), dict(min_tokens=-1), dict(logit_bias={5: 101.0}),
                                 dict(logit_bias={5: float("nan")}), dict(logit_bias={-1: 1.0}),
                                 dict(logit_bias={"x": 1.0}), dict(stop_token_ids=[-3]), dict(max_tokens=-1),
                                 dict(prompt_logprobs=21), dict(prompt_logprobs=-1)])
def test_poison_values_are_refused_by_name(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{"max_tokens": 16, **bad})


def test_accepted_edge_values_sample_next_to_innocent_rows():
    params = [SamplingParams(temperature=1e-40), SamplingParams(top_k=-1), SamplingParams(top_k=2 ** 31 - 1),
              SamplingParams(top_p=1e-40), SamplingParams(seed=-2 ** 63), SamplingParams(seed=2 ** 63 - 1),
              SamplingParams(logit_bias={"7": -100.0}), SamplingParams(logprobs=20), SamplingParams(min_tokens=16)]
    assert params[0].greedy and params[1].top_k == 0 and params[6].logit_bias == {7: -100.0}
    vocab = 32
    sampler = make_sampler(vocab)
    rows = [SampleRow(f"p{i}", p, [], [1]) for i, p in enumerate(params)]
    innocent = [SampleRow(f"i{i}", SamplingParams(temperature=0.0), [], [1]) for i in range(3)]
    for row in rows + innocent:
        sampler.add_request(row.request_id, row.params, row.prompt_token_ids)
    logits = torch.randn(len(rows) + 3, vocab, generator=seeded(10))
    result = run(sampler, logits, rows + innocent)
    assert result.token_ids[-3:] == logits[-3:].argmax(-1).tolist()
    assert result.token_ids[6] != 7 and len(result.logprobs[7]) >= 20
    with pytest.raises(ValueError, match="logit_bias"):
        sampler.add_request("outside", SamplingParams(logit_bias={vocab: 1.0}), [1])
    with pytest.raises(ValueError, match="twice"):
        sampler.add_request("p0", params[0], [1])


def test_rows_without_filters_pay_no_sort_and_top_k_rows_no_full_sort():
    """The sampler groups drawn rows by the filter width they need; each group is one op call on its rows."""
    calls = []

    class SpyOps:
        @staticmethod
        def sample(logits, *args):
            calls.append((logits.shape[0], args[-1]))
            return sample(logits, *args)

    vocab = 100
    sampler = Sampler(vocab, "cpu", {EOS}, ops=SpyOps())
    rows = [add(sampler, "plain", temperature=1.0), add(sampler, "k7", temperature=1.0, top_k=7),
            add(sampler, "greedy", temperature=0.0), add(sampler, "p", temperature=1.0, top_p=0.9),
            add(sampler, "k3p", temperature=1.0, top_k=3, top_p=0.5), add(sampler, "plain2", temperature=0.5)]
    logits = torch.randn(len(rows), vocab, generator=seeded(11))
    mixed = run(sampler, logits, rows).token_ids
    assert sorted(calls) == [(1, vocab), (2, 0), (2, 7)]
    assert mixed[2] == int(logits[2].argmax())
    calls.clear()
    assert run(sampler, logits[:2], rows[:2]).token_ids == mixed[:2]           # same rows, same draw
    assert sorted(calls) == [(1, 0), (1, 7)]
    calls.clear()
    run(sampler, logits[[0, 5]], [rows[0], rows[5]])
    assert calls == [(2, 0)], "one group covering every row is one call on the whole batch"

"""The PyTorch references (kernels/torch): against each other, against transformers' independent Kimi-Linear
code, and against small cases computed by hand from K3_ARCHITECTURE.md. Oracles run in float64."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from k3core.ops import OPS
from kernels.torch.activation import glu_activation
from kernels.torch.attn_res import attn_res_read
from kernels.torch.conv import short_conv_decode, short_conv_prefill
from kernels.torch.kda import kda_decode, kda_prefill
from kernels.torch.mla import mla_decode, mla_prefill
from kernels.torch.moe import moe_experts, moe_route
from kernels.torch.norm import gated_rms_norm, rms_norm
from kernels.torch.sampling import sample
from reference_helpers import (F64, KDA_F64_ATOL, independent_l2, kda_inputs, random_gate,  # noqa: F401
                               make_state_view, recurrent_states_at, seeded)

def test_every_op_reference_resolves():
    import importlib
    for op in OPS:
        module, _, name = op.reference.partition(":")
        assert callable(getattr(importlib.import_module(module), name)), op.reference


# ----------------------------------------------------------------------------------- hand-computed cases


def test_situ_and_silu_by_hand():
    points = [(0.0, 1.0), (1.0, 2.0), (-3.0, 0.5), (10.0, -40.0), (-10.0, 100.0)]
    x = torch.tensor([[g for g, _ in points] + [u for _, u in points]], dtype=F64)
    situ = glu_activation(x, "situ", 4.0, 25.0)[0].tolist()
    unclipped = glu_activation(x, "situ", 4.0, None)[0].tolist()
    silu = glu_activation(x, "silu", None, None)[0].tolist()
    for i, (g, u) in enumerate(points):
        a = 4.0 * math.tanh(g / 4.0) / (1.0 + math.exp(-g))
        assert situ[i] == pytest.approx(a * 25.0 * math.tanh(u / 25.0), rel=1e-12, abs=1e-15)
        assert unclipped[i] == pytest.approx(a * u, rel=1e-12, abs=1e-15)
        assert silu[i] == pytest.approx(g / (1.0 + math.exp(-g)) * u, rel=1e-12, abs=1e-15)
    with pytest.raises(ValueError, match="unknown activation"):
        glu_activation(x, "gelu", None, None)


def test_attn_res_by_hand():
    gen = seeded(31)
    live = torch.randn(5, 6, generator=gen, dtype=F64)
    bank = torch.full((5, 3, 6), float("nan"), dtype=F64)                   # unread rows may hold anything
    assert torch.equal(attn_res_read(bank, 0, live, torch.randn(6, dtype=F64), 1e-5), live)

    bank = torch.tensor([[[1.0, 0.0]]], dtype=F64)
    live = torch.tensor([[0.0, 2.0]], dtype=F64)
    eps = 1e-5
    s0 = 1.0 / math.sqrt(0.5 + eps) * 1.0                                   # query = [1, 1]
    s1 = 1.0 / math.sqrt(2.0 + eps) * 2.0
    a0 = math.exp(s0) / (math.exp(s0) + math.exp(s1))
    got = attn_res_read(bank, 1, live, torch.tensor([1.0, 1.0], dtype=F64), eps)[0].tolist()
    assert got == pytest.approx([a0, 2.0 * (1.0 - a0)], rel=1e-12)


def test_routing_bias_chooses_but_does_not_weigh():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    sig = [1.0 / (1.0 + math.exp(-v)) for v in (2.0, 1.0, 0.0, -1.0)]
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    route = moe_route(logits, bias, 2, "sigmoid", True, 1.0)
    assert route.expert_ids.tolist() == [[3, 0]] and route.expert_ids.dtype == torch.int64
    total = sig[3] + sig[0] + 1e-20
    assert route.weights[0].tolist() == pytest.approx([sig[3] / total, sig[0] / total], rel=1e-6)
    raw = moe_route(logits, bias, 2, "sigmoid", False, 2.5)
    assert raw.weights[0].tolist() == pytest.approx([2.5 * sig[3], 2.5 * sig[0]], rel=1e-6)
    plain = moe_route(logits, None, 2, "softmax", False, 1.0)
    soft = torch.softmax(logits[0].double(), 0)
    assert plain.expert_ids.tolist() == [[0, 1]]
    assert plain.weights[0].tolist() == pytest.approx(soft[:2].tolist(), rel=1e-6)


def test_moe_experts_matches_dense_loop_with_expert_offset():
    gen = seeded(32)
    tokens, hidden, inter, num_local, top_k, offset = 9, 8, 6, 4, 3, 4
    x = torch.randn(tokens, hidden, generator=gen, dtype=F64)
    w13 = torch.randn(num_local, 2 * inter, hidden, generator=gen, dtype=F64)
    w2 = torch.randn(num_local, hidden, inter, generator=gen, dtype=F64)
    ids = torch.stack([torch.randperm(12, generator=gen)[:top_k] for _ in range(tokens)])  # 12 experts, 4 here
    weights = torch.rand(tokens, top_k, generator=gen, dtype=F64)
    y = moe_experts(x, w13, w2, weights, ids, "situ", 4.0, 25.0, expert_offset=offset)
    want = torch.zeros_like(x)
    for t in range(tokens):
        for j in range(top_k):
            e = ids[t, j].item() - offset
            if 0 <= e < num_local:
                h = w13[e] @ x[t]
                gate, up = h[:inter], h[inter:]
                act = 4 * torch.tanh(gate / 4) * torch.sigmoid(gate) * 25 * torch.tanh(up / 25)
                want[t] += weights[t, j] * (w2[e] @ act)
    torch.testing.assert_close(y, want, atol=1e-12, rtol=1e-12)   # float64, a handful of sums


# ----------------------------------------------------------------------------------------- short conv


def test_short_conv_prefill_then_decode_equals_prefill_and_short_history():
    gen = seeded(41)
    channels, kernel = 10, 4
    weight = torch.randn(channels, kernel, generator=gen, dtype=F64)
    arena = torch.randn(5, 2, kernel - 1, channels, generator=gen, dtype=F64)
    state = arena[:, 0]                                                      # strided slot axis
    untouched = state[1].clone()
    state[3] = float("nan")                                                  # no initial state: never read
    x = torch.randn(12, channels, generator=gen, dtype=F64)
    whole_state = torch.zeros(5, kernel - 1, channels, dtype=F64)
    whole = short_conv_prefill(x, weight, torch.tensor([0, 12]), whole_state, torch.tensor([3]), torch.tensor([False]))
    # 5 tokens, then a 2-token prefill (shorter than the 3-token window), then 5 decode steps.
    parts = [short_conv_prefill(x[:5], weight, torch.tensor([0, 5]), state, torch.tensor([3]), torch.tensor([False]))]
    parts.append(short_conv_prefill(x[5:7], weight, torch.tensor([0, 2]), state, torch.tensor([3]),
                                    torch.tensor([True])))
    assert torch.equal(state[3], x[4:7]), "a short prefill must keep the newest old input in the window"
    for t in range(7, 12):
        parts.append(short_conv_decode(x[t:t + 1], weight, state, torch.tensor([3])))
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-13, rtol=0)    # float64, 4-tap sums
    assert torch.equal(state[3], whole_state[3]) and torch.equal(state[3], x[9:12])
    assert torch.equal(state[1], untouched)
    # By hand: first output of a fresh sequence sees only its own first input, at the last tap.
    assert whole[0].tolist() == pytest.approx(F.silu(weight[:, -1] * x[0]).tolist(), rel=1e-13)


# ----------------------------------------------------------------------------------------------- MLA


def test_mla_prefill_matches_dense_masked_softmax():
    gen = seeded(51)
    num_heads, dqk, dv = 3, 12, 8
    lens_q, lens_k = [3, 5, 1, 0], [7, 5, 10, 4]
    cu_q = torch.tensor([0, 3, 8, 9, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 12, 22, 26], dtype=torch.int32)
    q = torch.randn(9, num_heads, dqk, generator=gen, dtype=F64)
    k = torch.randn(26, num_heads, dqk, generator=gen, dtype=F64)
    v = torch.randn(26, num_heads, dv, generator=gen, dtype=F64)
    scale = dqk ** -0.5
    out = mla_prefill(q, k, v, cu_q, cu_k, scale)
    for b in range(4):
        prefix = lens_k[b] - lens_q[b]
        for i in range(lens_q[b]):
            row = cu_q[b] + i
            keys = slice(cu_k[b], cu_k[b] + prefix + i + 1)                  # the prefix and itself
            probs = torch.softmax(scale * torch.einsum("hd,khd->hk", q[row], k[keys]), dim=-1)
            torch.testing.assert_close(out[row], torch.einsum("hk,khd->hd", probs, v[keys]), atol=1e-12, rtol=0)


def test_mla_decode_matches_gather_softmax():
    gen = seeded(52)
    num_heads, latent, v_dim, page_size = 4, 20, 16, 16
    arena = torch.full((10, 2, page_size, latent), float("nan"), dtype=F64)
    kv_cache = arena[:, 1]                                                   # strided page axis
    seq_lens = torch.tensor([1, 17, 48], dtype=torch.int32)
    page_table = torch.tensor([[6, -1, -1], [2, 9, -1], [1, 4, 7]], dtype=torch.int32)   # page 0 stays NaN
    for b, n in enumerate(seq_lens.tolist()):
        for j in range(n):
            kv_cache[page_table[b, j // page_size], j % page_size] = torch.randn(latent, generator=gen, dtype=F64)
    q = torch.randn(3, num_heads, latent, generator=gen, dtype=F64)
    scale = 0.3
    out = mla_decode(q, kv_cache, page_table, seq_lens, scale, v_dim)
    for b, n in enumerate(seq_lens.tolist()):
        entries = torch.stack([kv_cache[page_table[b, j // page_size], j % page_size] for j in range(n)])
        scores = scale * q[b] @ entries.T                                    # [H, n]
        peak = scores.max(-1, keepdim=True).values
        lse = peak[:, 0] + torch.log(torch.exp(scores - peak).sum(-1))
        torch.testing.assert_close(out.output[b], torch.softmax(scores, -1) @ entries[:, :v_dim], atol=1e-12, rtol=0)
        torch.testing.assert_close(out.lse[b], lse, atol=1e-12, rtol=0)


# ------------------------------------------------------------------------------------------ sampling


def _draw(logits, temperature, top_k, top_p, min_p, seeds, width=None):
    rows, vocab = logits.shape
    full = lambda v, dtype=torch.float32: torch.full((rows,), v, dtype=dtype)  # noqa: E731
    return sample(logits, full(temperature), full(top_k, torch.int64), full(top_p), full(min_p),
                  torch.as_tensor(seeds, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64),
                  vocab if width is None else width)


def test_sampling_greedy_topk_and_seeds():
    gen = seeded(61)
    logits = torch.randn(6, 50, generator=gen)
    logits[0, [3, 7]] = 100.0                                                # a tie: lowest index wins
    seeds = list(range(6))
    greedy = _draw(logits, 0.0, 0, 1.0, 0.0, seeds)
    assert greedy.dtype == torch.int64 and greedy[0].item() == 3
    assert torch.equal(greedy, logits.argmax(-1))
    top1 = _draw(logits, 1.0, 1, 1.0, 0.0, seeds, width=1)
    assert torch.equal(top1, greedy)
    draws = [_draw(logits, 2.0, 0, 1.0, 0.0, seeds, width=0) for _ in range(2)]
    assert torch.equal(draws[0], draws[1]), "the same seeds must give the same tokens"


def test_sampling_never_returns_a_filtered_token():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    rows = 300
    logits = probs.log().repeat(rows, 1)
    seeds = list(range(1000, 1000 + rows))
    # top_p 0.7: the smallest prefix reaching 0.7 is {0, 1} (0.5 alone does not reach it).
    assert set(_draw(logits, 1.0, 0, 0.7, 0.0, seeds).tolist()) == {0, 1}
    # min_p 0.25: keep p >= 0.125 -> {0, 1, 2}.
    assert set(_draw(logits, 1.0, 0, 1.0, 0.25, seeds).tolist()) == {0, 1, 2}
    assert set(_draw(logits, 1.0, 2, 1.0, 0.0, seeds, width=2).tolist()) == {0, 1}
    assert set(_draw(logits, 1.0, 0, 0.01, 0.0, seeds).tolist()) == {0}     # always at least one token


# ------------------------------------------------------------------------------ dtypes (bf16 / fp32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduced_precision_inputs_follow_the_float64_oracle(dtype):
    """Inputs are rounded to `dtype` first, then the float64 result of the same values is the reference, so only
    the output rounding (bf16: 2^-8 relative) and float32 internals separate them."""
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=2e-5, rtol=2e-5)
    gen = seeded(71)
    num_heads, head_dim = 2, 16
    cu = torch.tensor([0, 5, 75], dtype=torch.int32)
    raw = [torch.randn(75, num_heads, head_dim, generator=gen).to(dtype) for _ in range(4)]
    beta_logits = torch.randn(75, num_heads, generator=gen).to(dtype)
    gate = random_gate(num_heads, head_dim, "lower_bound", gen)
    slots, init = torch.tensor([1, 0]), torch.tensor([True, False])
    state32 = torch.randn(2, num_heads, head_dim, head_dim, generator=gen)
    state64 = state32.double()
    low = kda_prefill(*raw, beta_logits, gate, cu, state32, slots, init, 0.25, checkpoint_interval=64)
    ref = kda_prefill(*[t.double() for t in raw], beta_logits.double(), gate, cu, state64, slots, init, 0.25,
                      checkpoint_interval=64)
    assert low.output.dtype == dtype and low.checkpoint_states.dtype == torch.float32
    torch.testing.assert_close(low.output.double(), ref.output, **tol)
    torch.testing.assert_close(state32.double(), state64, atol=1e-4, rtol=1e-4)  # the float32 state, no bf16 rounding
    o = kda_decode(*[t[:2] for t in raw], beta_logits[:2], gate, state32, slots, 0.25)
    o_ref = kda_decode(*[t[:2].double() for t in raw], beta_logits[:2].double(), gate, state64, slots, 0.25)
    assert o.dtype == dtype
    torch.testing.assert_close(o.double(), o_ref, **tol)

    x = torch.randn(75, 12, generator=gen).to(dtype)
    weight = torch.randn(12, 4, generator=gen)
    conv32, conv64 = torch.zeros(2, 3, 12, dtype=dtype), torch.zeros(2, 3, 12, dtype=F64)
    y = short_conv_prefill(x, weight, cu, conv32, slots, init)
    torch.testing.assert_close(y.double(), short_conv_prefill(x.double(), weight, cu, conv64, slots, init), **tol)
    assert y.dtype == dtype and torch.equal(conv32.double(), conv64)    # the window holds inputs, exactly

    mla_args = [raw[0], raw[1], raw[2][..., :8]]
    o = mla_prefill(*mla_args, cu, cu, 0.25)
    torch.testing.assert_close(o.double(), mla_prefill(*[t.double() for t in mla_args], cu, cu, 0.25), **tol)
    bank, live, query = raw[0][:, :, :], raw[1][:, 0], torch.randn(head_dim, generator=gen)
    mixed = attn_res_read(bank, 2, live, query, 1e-5)
    assert mixed.dtype == dtype
    torch.testing.assert_close(mixed.double(), attn_res_read(bank.double(), 2, live.double(), query, 1e-5), **tol)
    w = torch.randn(head_dim, generator=gen).to(dtype)
    normed = gated_rms_norm(live, raw[3][:, 0], w, 1e-5)
    torch.testing.assert_close(normed.double(), gated_rms_norm(live.double(), raw[3][:, 0].double(), w, 1e-5), **tol)


# ------------------------------------------------------------------------------------------------ CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA (or ROCm) device")
def test_references_run_on_the_device_like_on_the_cpu():
    """Every op on device tensors (strided state views included) gives the CPU result of the same float64 inputs."""
    dev = torch.device("cuda")
    gen = seeded(81)
    num_heads, head_dim = 2, 16
    cu = torch.tensor([0, 5, 75], dtype=torch.int32)
    kda_args = [torch.randn(75, num_heads, head_dim, generator=gen, dtype=F64) for _ in range(4)]
    kda_args.append(torch.randn(75, num_heads, generator=gen, dtype=F64))
    gate = random_gate(num_heads, head_dim, "softplus", gen)
    slots, init = torch.tensor([2, 0]), torch.tensor([True, False])
    _, state = make_state_view(3, num_heads, head_dim, head_dim, gen)
    x = torch.randn(75, 12, generator=gen, dtype=F64)
    conv_w = torch.randn(12, 4, generator=gen)
    conv_state = torch.randn(3, 3, 12, generator=gen, dtype=F64)
    kv_cache = torch.randn(4, 16, 20, generator=gen, dtype=F64)
    pages, lens = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32), torch.tensor([20, 7], dtype=torch.int32)
    w13, w2 = torch.randn(4, 12, 8, generator=gen, dtype=F64), torch.randn(4, 8, 6, generator=gen, dtype=F64)
    logits = torch.randn(10, 6, generator=gen, dtype=F64)

    def run_all(d):
        to = lambda t: t.to(d)  # noqa: E731
        st, cs = to(state.clone()), to(conv_state.clone())
        results = [kda_prefill(*map(to, kda_args), gate, to(cu), st, to(slots), to(init), 0.25, 32)]
        results.append(kda_decode(*[to(t[:2]) for t in kda_args], gate, st, to(slots), 0.25))
        results += [st, short_conv_prefill(to(x), to(conv_w), to(cu), cs, to(slots), to(init))]
        results += [short_conv_decode(to(x[:2]), to(conv_w), cs, to(slots)), cs]
        results.append(mla_prefill(to(kda_args[0]), to(kda_args[1]), to(kda_args[2]), to(cu), to(cu), 0.3))
        results.append(mla_decode(to(torch.randn(2, 3, 20, generator=seeded(1), dtype=F64)), to(kv_cache),
                                  to(pages), to(lens), 0.3, 16))
        route = moe_route(to(logits), to(torch.zeros(6, dtype=F64)), 2, "sigmoid", True, 1.0)
        results += [route, moe_experts(to(x[:10, :8]), to(w13[:, :, :8]), to(w2), route.weights,
                                       route.expert_ids + 2, "silu", None, None, expert_offset=2)]
        results.append(attn_res_read(to(kda_args[0][:, :, :12]), 1, to(x), to(x[0]), 1e-5))
        results.append(rms_norm(to(x), to(x[1]), 1e-5))
        ones = torch.ones(10, device=d)
        results.append(sample(to(logits).float(), ones * 0.8, (ones * 3).long(), ones * 0.9, ones * 0.1,
                              torch.arange(10, device=d), torch.arange(10, device=d) * 7, 3))
        return results

    def flat(items):
        for item in items:
            if isinstance(item, tuple):
                yield from flat(item)
            else:
                yield item

    for got, want in zip(flat(run_all(dev)), flat(run_all(torch.device("cpu")))):
        assert got.device.type == "cuda"
        # float64 on both devices; only the reduction order differs.
        torch.testing.assert_close(got.cpu(), want, atol=1e-10, rtol=1e-10)


def test_empty_batches():
    """B = 0, cu_seqlens = [0], T = 0 (the op table's convention) must work and touch nothing."""
    cu, none = torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int64)
    empty = torch.zeros(0, 2, 8, dtype=F64)
    state = torch.randn(3, 2, 8, 8, dtype=F64)
    before = state.clone()
    out = kda_prefill(empty, empty, empty, empty, torch.zeros(0, 2, dtype=F64),
                      random_gate(2, 8, "softplus", seeded(0)), cu, state, none, none.bool(), 0.3, 4)
    assert out.output.shape == (0, 2, 8) and out.checkpoint_states.shape == (0, 2, 8, 8)
    assert kda_decode(empty, empty, empty, empty, torch.zeros(0, 2, dtype=F64), random_gate(2, 8, "softplus",
                      seeded(0)), state, none, 0.3).shape == (0, 2, 8)
    assert torch.equal(state, before)
    conv_state = torch.randn(2, 3, 6)
    assert short_conv_prefill(torch.zeros(0, 6), torch.ones(6, 4), cu, conv_state, none, none.bool()).shape == (0, 6)
    assert mla_prefill(empty, empty, empty, cu, cu, 0.3).shape == (0, 2, 8)
    assert mla_decode(empty, torch.zeros(2, 4, 8), torch.zeros(0, 1, dtype=torch.int32),
                      torch.zeros(0, dtype=torch.int32), 0.3, 4).output.shape == (0, 2, 4)
    route = moe_route(torch.zeros(0, 5), None, 2, "sigmoid", True, 1.0)
    assert route.weights.shape == (0, 2)
    assert moe_experts(torch.zeros(0, 4), torch.zeros(3, 6, 4), torch.zeros(3, 4, 3), route.weights,
                       route.expert_ids, "silu", None, None).shape == (0, 4)
    none64 = torch.zeros(0, dtype=torch.int64)
    assert sample(torch.zeros(0, 5), *(torch.zeros(0),) * 4, none64, none64, 0).shape == (0,)

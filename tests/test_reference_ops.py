"""The PyTorch references (kernels/torch): against each other, against transformers' independent Kimi-Linear
code, and against small cases computed by hand from K3_ARCHITECTURE.md. Oracles run in float64."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from k3core.ops import OPS, KdaGateParams
from kernels.torch.activation import glu_activation
from kernels.torch.attn_res import attn_res_read
from kernels.torch.conv import short_conv_decode, short_conv_prefill
from kernels.torch.kda import kda_chunked, kda_decode, kda_gate, kda_prefill, kda_recurrent, l2_normalize
from kernels.torch.mla import mla_decode, mla_prefill
from kernels.torch.moe import moe_experts, moe_route
from kernels.torch.norm import gated_rms_norm, rms_norm
from kernels.torch.sampling import sample

F64 = torch.float64
# float64 chunked vs recurrent: the two differ only in summation order and a unit-triangular solve (~1e-14 seen).
KDA_F64_ATOL = 1e-10


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def independent_l2(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def random_gate(num_heads: int, head_dim: int, form: str, gen: torch.Generator) -> KdaGateParams:
    a_log = torch.randn(num_heads, generator=gen) * 0.5
    dt_bias = torch.randn(num_heads * head_dim, generator=gen) * 0.5
    return KdaGateParams(A_log=a_log, dt_bias=dt_bias, form=form, lower_bound=-5.0)


def kda_inputs(seq_len, num_heads, head_dim, form, gen, dtype=F64):
    q = independent_l2(torch.randn(seq_len, num_heads, head_dim, generator=gen, dtype=F64))
    k = independent_l2(torch.randn(seq_len, num_heads, head_dim, generator=gen, dtype=F64))
    v = torch.randn(seq_len, num_heads, head_dim, generator=gen, dtype=F64)
    f = torch.randn(seq_len, num_heads, head_dim, generator=gen, dtype=F64) * 2
    g = kda_gate(f, random_gate(num_heads, head_dim, form, gen))
    beta = torch.rand(seq_len, num_heads, generator=gen, dtype=F64)
    return [t.to(dtype) for t in (q, k, v, g, beta)]


def recurrent_states_at(q, k, v, g, beta, state, scale, lengths):
    """The recurrent oracle's state after each of `lengths` tokens (segment by segment: the recurrence is Markov)."""
    states, start = [], 0
    for end in lengths:
        state = kda_recurrent(q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end], state,
                              scale).final_state
        states.append(state)
        start = end
    return states


def test_every_op_reference_resolves():
    import importlib
    for op in OPS:
        module, _, name = op.reference.partition(":")
        assert callable(getattr(importlib.import_module(module), name)), op.reference


# ----------------------------------------------------------------------------------------------- KDA


@pytest.mark.parametrize("form", ["softplus", "lower_bound"])
@pytest.mark.parametrize("with_initial", [False, True])
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("seq_len", [1, 15, 63, 64, 65, 200])
def test_kda_chunked_matches_recurrent(seq_len, head_dim, with_initial, form):
    gen = seeded(seq_len * 1000 + head_dim * 10 + with_initial)
    num_heads = 2
    q, k, v, g, beta = kda_inputs(seq_len, num_heads, head_dim, form, gen)
    initial = torch.randn(num_heads, head_dim, head_dim, generator=gen, dtype=F64) if with_initial else None
    scale = head_dim ** -0.5
    ref = kda_recurrent(q, k, v, g, beta, initial, scale)
    # 24 is not a multiple of the chunk size: chunks are then also cut at checkpoint boundaries.
    for every in (0, 64, 24):
        out = kda_chunked(q, k, v, g, beta, initial, scale, chunk_size=64, checkpoint_every=every)
        torch.testing.assert_close(out.output, ref.output, atol=KDA_F64_ATOL, rtol=0)
        torch.testing.assert_close(out.final_state, ref.final_state, atol=KDA_F64_ATOL, rtol=0)
        lengths = list(range(every, seq_len + 1, every)) if every else []
        assert out.checkpoint_states.shape[0] == len(lengths)
        for got, want in zip(out.checkpoint_states, recurrent_states_at(q, k, v, g, beta, initial, scale, lengths)):
            torch.testing.assert_close(got, want, atol=KDA_F64_ATOL, rtol=0)


def test_kda_chunked_survives_strong_decay():
    # g near -50 per token: exp(-G) over a 64-token chunk would overflow; only differences G_i - G_j may be used.
    gen = seeded(7)
    q, k, v, _, beta = kda_inputs(130, 2, 16, "softplus", gen, dtype=torch.float32)
    g = -50 * torch.rand(130, 2, 16, generator=gen)
    ref = kda_recurrent(q, k, v, g, beta, None, 0.25)
    out = kda_chunked(q, k, v, g, beta, None, 0.25)
    assert torch.isfinite(out.output).all() and torch.isfinite(out.final_state).all()
    # float32: errors of a few ulps of O(1) values accumulated over a 64-token solve.
    torch.testing.assert_close(out.output, ref.output, atol=1e-5, rtol=0)


def make_state_view(num_slots, num_heads, v_dim, k_dim, gen, dtype=F64):
    """A state whose slot axis is strided (a view into a bigger arena), as the unified pool hands it out."""
    arena = torch.randn(num_slots, 3, num_heads, v_dim, k_dim, generator=gen, dtype=dtype)
    return arena, arena[:, 1]


@pytest.mark.parametrize("form", ["softplus", "lower_bound"])
def test_kda_prefill_varlen_matches_recurrent(form):
    gen = seeded(11)
    num_heads, head_dim, lengths = 2, 16, [1, 15, 64, 100, 0]
    total = sum(lengths)
    q = torch.randn(total, num_heads, head_dim, generator=gen, dtype=F64)
    k = torch.randn(total, num_heads, head_dim, generator=gen, dtype=F64)
    v = torch.randn(total, num_heads, head_dim, generator=gen, dtype=F64)
    f = torch.randn(total, num_heads, head_dim, generator=gen, dtype=F64)
    beta_logits = torch.randn(total, num_heads, generator=gen, dtype=F64)
    gate = random_gate(num_heads, head_dim, form, gen)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    arena, state = make_state_view(9, num_heads, head_dim, head_dim, gen)
    assert not state.is_contiguous()
    slots = torch.tensor([7, 2, 5, 0, 3])
    has_init = torch.tensor([True, False, True, False, True])
    state[slots[~has_init]] = float("nan")                  # a slot without initial state must never be read
    before = arena.clone()
    scale, interval = head_dim ** -0.5, 32
    out = kda_prefill(q, k, v, f, beta_logits, gate, cu, state, slots, has_init, scale, checkpoint_interval=interval)

    touched = set(slots.tolist())
    for slot in range(9):
        if slot not in touched:
            assert torch.equal(state[slot], before[slot, 1]), "an unaddressed slot changed"
    assert torch.equal(arena[:, [0, 2]], before[:, [0, 2]]), "the arena around the state view changed"

    g = kda_gate(f, gate)
    beta = torch.sigmoid(beta_logits)
    want_seqs, want_lens, want_states = [], [], []
    for b, length in enumerate(lengths):
        s, e = cu[b].item(), cu[b + 1].item()
        initial = before[slots[b], 1] if has_init[b] else None
        args = (independent_l2(q[s:e]), independent_l2(k[s:e]), v[s:e], g[s:e], beta[s:e])
        ref = kda_recurrent(*args, initial, scale)
        torch.testing.assert_close(out.output[s:e], ref.output, atol=KDA_F64_ATOL, rtol=0)
        if length == 0:                                     # nothing consumed: the initial state (or zeros) is written
            expected_final = initial if initial is not None else torch.zeros_like(ref.final_state)
        else:
            expected_final = ref.final_state
        torch.testing.assert_close(state[slots[b]], expected_final, atol=KDA_F64_ATOL, rtol=0)
        ckpt = sorted(set(range(interval, length + 1, interval)) | ({length} if length else set()))
        want_seqs += [b] * len(ckpt)
        want_lens += ckpt
        want_states += recurrent_states_at(*args, initial, scale, ckpt)
    assert out.checkpoint_seq_ids.tolist() == want_seqs
    assert out.checkpoint_lengths.tolist() == want_lens
    torch.testing.assert_close(out.checkpoint_states, torch.stack(want_states), atol=KDA_F64_ATOL, rtol=0)


def test_kda_decode_steps_equal_prefill():
    gen = seeded(12)
    num_heads, head_dim, lengths, split = 3, 16, [20, 9, 13], 5
    gate = random_gate(num_heads, head_dim, "lower_bound", gen)
    seqs = [[torch.randn(n, num_heads, head_dim, generator=gen, dtype=F64) for _ in range(4)]
            + [torch.randn(n, num_heads, generator=gen, dtype=F64)] for n in lengths]
    scale = head_dim ** -0.5
    _, whole = make_state_view(6, num_heads, head_dim, head_dim, gen)
    _, stepped = make_state_view(6, num_heads, head_dim, head_dim, gen)
    slots = torch.tensor([4, 0, 2])
    no_init = torch.zeros(3, dtype=torch.bool)

    def packed(parts):
        return [torch.cat([p[i] for p in parts]) for i in range(5)]

    def cu_of(ns):
        return torch.tensor([0] + list(torch.tensor(ns).cumsum(0)), dtype=torch.int32)

    full = kda_prefill(*packed(seqs), gate, cu_of(lengths), whole, slots, no_init, scale)
    kda_prefill(*packed([[t[:split] for t in s] for s in seqs]), gate, cu_of([split] * 3), stepped, slots, no_init,
                scale)
    cu_full = cu_of(lengths)
    for step in range(split, max(lengths)):
        live = [b for b, n in enumerate(lengths) if step < n]          # sequences still decoding
        q, k, v, f, bl = (torch.stack([seqs[b][i][step] for b in live]) for i in range(5))
        o = kda_decode(q, k, v, f, bl, gate, stepped, slots[live], scale)
        for row, b in enumerate(live):
            torch.testing.assert_close(o[row], full.output[cu_full[b] + step], atol=KDA_F64_ATOL, rtol=0)
    torch.testing.assert_close(stepped[slots], whole[slots], atol=KDA_F64_ATOL, rtol=0)


def test_kda_gate_by_hand():
    # Gate parameters are float32: use the float32 value of log(2) in the expected numbers too.
    a_log = float(torch.tensor(math.log(2.0), dtype=torch.float32))
    rate, dt_bias, f = math.exp(a_log), 0.5, 0.25
    params = dict(A_log=torch.tensor([a_log, 0.0]), dt_bias=torch.tensor([dt_bias, 0.0, 0.0, 0.0]))
    x = torch.tensor([[[f, 0.0], [0.0, 0.0]]], dtype=F64)                  # [T=1, H=2, K=2]
    soft = kda_gate(x, KdaGateParams(**params, form="softplus"))
    assert soft[0, 0, 0].item() == pytest.approx(-rate * math.log1p(math.exp(0.75)), rel=1e-12)
    assert soft[0, 1, 0].item() == pytest.approx(-math.log(2.0), rel=1e-12)
    low = kda_gate(x, KdaGateParams(**params, form="lower_bound", lower_bound=-5.0))
    assert low[0, 0, 0].item() == pytest.approx(-5.0 / (1.0 + math.exp(-rate * 0.75)), rel=1e-12)
    assert low[0, 1, 1].item() == pytest.approx(-2.5, rel=1e-12)


def test_kda_gate_ranges_and_extremes():
    gen = seeded(13)
    f = torch.randn(50, 4, 8, generator=gen) * 3
    low = kda_gate(f, random_gate(4, 8, "lower_bound", gen))
    assert low.dtype == torch.float32 and bool(((low > -5.0) & (low < 0)).all()), "lower-bounded gate leaves (-5, 0)"
    params = random_gate(4, 8, "softplus", gen)
    huge = torch.full((1, 4, 8), 1e4)
    g = kda_gate(huge, params)
    expected = -torch.exp(params.A_log)[:, None] * (1e4 + params.dt_bias.view(4, 8))   # softplus(x) = x for x > 20
    assert torch.isfinite(g).all() and torch.allclose(g, expected)
    tiny = kda_gate(-huge, params)
    assert bool((tiny <= 0).all()) and tiny.abs().max() < 1e-30
    with pytest.raises(ValueError, match="gate form"):
        kda_gate(f, params._replace(form="relu"))


# ------------------------------------------------------------------ transformers' Kimi-Linear (independent)

@pytest.fixture(scope="module")
def hf():
    return pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")


def tiny_hf_config():
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
    return KimiLinearConfig(hidden_size=32, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=3,
                            n_group=1, topk_group=1, linear_attn_config=dict(
                                head_dim=8, num_heads=2, short_conv_kernel_size=4, kda_layers=[1],
                                full_attn_layers=[2]))


@pytest.mark.parametrize("seq_len", [1, 63, 100])
def test_kda_matches_transformers(seq_len, hf):
    gen = seeded(21 + seq_len)
    num_heads, head_dim = 2, 16
    q, k, v, g, beta = kda_inputs(seq_len, num_heads, head_dim, "softplus", gen, dtype=torch.float32)
    initial = torch.randn(num_heads, head_dim, head_dim, generator=gen)     # ours [H, V, K]
    hf_initial = initial.transpose(-1, -2)[None].contiguous()              # theirs [B, H, K, V]
    batch = [t[None] for t in (q, k, v, g, beta)]
    hf_rec = hf.recurrent_kimi_delta_attention(*batch, initial_state=hf_initial, output_final_state=True)
    hf_chunk = hf.chunk_kimi_delta_attention(*batch, initial_state=hf_initial, output_final_state=True)
    ours = kda_chunked(q, k, v, g, beta, initial, head_dim ** -0.5)
    ours_rec = kda_recurrent(q, k, v, g, beta, initial, head_dim ** -0.5)
    # float32 on both sides with different association orders; values are O(1).
    for hf_out, hf_state in (hf_rec, hf_chunk):
        for mine in (ours, ours_rec):
            torch.testing.assert_close(mine.output, hf_out[0], atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(mine.final_state, hf_state[0].transpose(-1, -2), atol=2e-5, rtol=1e-5)
    x = torch.randn(5, 3, 16, generator=gen)
    torch.testing.assert_close(l2_normalize(x), hf.l2norm(x), atol=0, rtol=0)


def test_short_conv_matches_transformers(hf):
    gen = seeded(22)
    channels, kernel, length = 12, 4, 9
    weight = torch.randn(channels, kernel, generator=gen)
    x = torch.randn(length, channels, generator=gen)
    state = torch.zeros(2, kernel - 1, channels)
    ours = short_conv_prefill(x, weight, torch.tensor([0, length]), state, torch.tensor([1]), torch.tensor([False]))
    theirs = hf.causal_conv1d_fn(x.T[None].contiguous(), weight, activation="silu")[0].T
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)     # float32 conv vs float32 sum of 4 taps
    hf_state = state[1].T[None].contiguous()                             # theirs [B, C, K_conv - 1]
    step = torch.randn(1, channels, generator=gen)
    theirs = hf.causal_conv1d_update(step[:, :, None], hf_state, weight, activation="silu")[:, :, 0]
    ours = short_conv_decode(step, weight, state, torch.tensor([1]))
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(state[1], hf_state[0].T, atol=0, rtol=0)


def test_gate_router_norms_match_transformers(hf):
    torch.manual_seed(23)
    config = tiny_hf_config()
    gate = hf.KimiLinearForgetGate(config)
    torch.nn.init.normal_(gate.A_log, std=0.5)
    torch.nn.init.normal_(gate.dt_bias, std=0.5)
    hidden = torch.randn(1, 7, 32)
    f = gate.f_b_proj(gate.f_a_proj(hidden))[0].view(7, 2, 8)
    params = KdaGateParams(A_log=gate.A_log.detach().reshape(-1), dt_bias=gate.dt_bias.detach(), form="softplus")
    torch.testing.assert_close(kda_gate(f.detach(), params), gate(hidden)[0].detach(), atol=1e-6, rtol=1e-6)

    router = hf.KimiLinearTopkRouter(config)
    torch.nn.init.normal_(router.weight)
    router.e_score_correction_bias.normal_()
    x = torch.randn(11, 32)
    logits, hf_weights, hf_ids = router(x)
    route = moe_route(logits.detach(), router.e_score_correction_bias, 3, "sigmoid", True,
                      config.routed_scaling_factor)
    hf_order, our_order = hf_ids.argsort(-1), route.expert_ids.argsort(-1)    # theirs is unsorted
    assert torch.equal(hf_ids.gather(1, hf_order), route.expert_ids.gather(1, our_order))
    torch.testing.assert_close(route.weights.gather(1, our_order), hf_weights.detach().gather(1, hf_order))

    x = torch.randn(4, 5, 16, dtype=torch.bfloat16)
    norm = hf.KimiLinearRMSNorm(16, eps=1e-5).to(torch.bfloat16)
    torch.nn.init.normal_(norm.weight)
    assert torch.equal(rms_norm(x, norm.weight.detach(), 1e-5), norm(x).detach())   # same rounding order
    gated = hf.KimiLinearRMSNormGated(16, eps=1e-5)
    torch.nn.init.normal_(gated.weight)
    z = torch.randn(4, 5, 16, dtype=torch.bfloat16)
    torch.testing.assert_close(gated_rms_norm(x, z, gated.weight.detach(), 1e-5), gated(x, z).detach(),
                               atol=0, rtol=0)


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
    num_heads, latent, v_dim, page_size, max_pages = 4, 20, 16, 16, 3
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


def test_sampling_greedy_topk_and_seeds():
    gen = seeded(61)
    logits = torch.randn(6, 50, generator=gen)
    logits[0, [3, 7]] = 100.0                                                # a tie: lowest index wins
    zeros, ones = torch.zeros(6), torch.ones(6)
    no_k = torch.zeros(6, dtype=torch.int64)
    greedy = sample(logits, zeros, no_k, ones, zeros, [None] * 6)
    assert greedy.dtype == torch.int64 and greedy[0].item() == 3
    assert torch.equal(greedy, logits.argmax(-1))
    top1 = sample(logits, ones, torch.ones(6, dtype=torch.int64), ones, zeros, [seeded(s) for s in range(6)])
    assert torch.equal(top1, greedy)
    draws = [sample(logits, ones * 2, no_k, ones, zeros, [seeded(s) for s in range(6)]) for _ in range(2)]
    assert torch.equal(draws[0], draws[1]), "the same seeds must give the same tokens"


def test_sampling_never_returns_a_filtered_token():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    rows = 300
    logits = probs.log().repeat(rows, 1)
    ones, zeros = torch.ones(rows), torch.zeros(rows)
    no_k = torch.zeros(rows, dtype=torch.int64)
    gens = [seeded(1000 + r) for r in range(rows)]
    # top_p 0.7: the smallest prefix reaching 0.7 is {0, 1} (0.5 alone does not reach it).
    by_p = sample(logits, ones, no_k, ones * 0.7, zeros, gens)
    assert set(by_p.tolist()) == {0, 1}
    # min_p 0.25: keep p >= 0.125 -> {0, 1, 2}.
    by_min = sample(logits, ones, no_k, ones, ones * 0.25, gens)
    assert set(by_min.tolist()) == {0, 1, 2}
    by_k = sample(logits, ones, torch.full((rows,), 2), ones, zeros, gens)
    assert set(by_k.tolist()) == {0, 1}
    tight = sample(logits, ones, no_k, ones * 0.01, zeros, gens)          # always at least one token
    assert set(tight.tolist()) == {0}


# ------------------------------------------------------------------------------ dtypes (bf16 / fp32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduced_precision_inputs_follow_the_float64_oracle(dtype):
    """Inputs are rounded to `dtype` first, then the float64 result of the same values is the reference, so only
    the output rounding (bf16: 2^-8 relative) and float32 internals separate them."""
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=2e-5, rtol=2e-5)
    gen = seeded(71)
    num_heads, head_dim, lengths = 2, 16, [5, 70]
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
        results.append(sample(to(logits).float(), ones * 0, (ones * 0).long(), ones, ones * 0, [None] * 10))
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
    assert sample(torch.zeros(0, 5), *(torch.zeros(0),) * 4, []).shape == (0,)

"""The KDA, gate and short-conv references: chunked vs per-token oracle in float64, varlen prefill with slots
and checkpoints, decode, and agreement with transformers' independent Kimi-Linear code."""
from __future__ import annotations

import math

import pytest
import torch

from k3core.ops import KdaGateParams
from kernels.torch.conv import short_conv_decode, short_conv_prefill
from kernels.torch.kda import kda_chunked, kda_decode, kda_gate, kda_prefill, kda_recurrent, l2_normalize
from kernels.torch.moe import moe_route
from kernels.torch.norm import gated_rms_norm, rms_norm
from reference_helpers import (F64, KDA_F64_ATOL, independent_l2, kda_inputs, random_gate,  # noqa: F401
                               make_state_view, recurrent_states_at, seeded)

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


def test_prefill_explicit_checkpoint_lengths_are_the_recurrent_states():
    gen = torch.Generator().manual_seed(11)
    lengths, head_dim, num_heads = [9, 0, 20], 8, 2
    marks = [[1, 4, 9], [], [3, 17]]
    total = sum(lengths)
    q, k, v, f = (torch.randn(total, num_heads, head_dim, generator=gen, dtype=F64) for _ in range(4))
    beta_logits = torch.randn(total, num_heads, generator=gen, dtype=F64)
    gate = random_gate(num_heads, head_dim, "lower_bound", gen)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    state = torch.randn(3, num_heads, head_dim, head_dim, generator=gen, dtype=F64)
    slots, has_init = torch.tensor([2, 0, 1]), torch.tensor([True, False, False])
    initial = state.clone()
    out = kda_prefill(q, k, v, f, beta_logits, gate, cu, state, slots, has_init, 0.5, checkpoint_lengths=marks)
    g, beta = kda_gate(f, gate), torch.sigmoid(beta_logits)
    want = []
    for b, length in enumerate(lengths):
        s, e = cu[b].item(), cu[b + 1].item()
        args = (independent_l2(q[s:e]), independent_l2(k[s:e]), v[s:e], g[s:e], beta[s:e])
        want += recurrent_states_at(*args, initial[slots[b]] if has_init[b] else None, 0.5, marks[b])
    assert out.checkpoint_seq_ids.tolist() == [0, 0, 0, 2, 2]
    assert out.checkpoint_lengths.tolist() == [1, 4, 9, 3, 17]
    torch.testing.assert_close(out.checkpoint_states, torch.stack(want), atol=KDA_F64_ATOL, rtol=0)

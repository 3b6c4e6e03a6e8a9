"""Triton KDA kernels (gate, chunked varlen prefill with slots and checkpoints, decode) and the short conv,
checked against the float64 PyTorch references in kernels/torch.

Runs on a GPU when there is one, otherwise under the Triton CPU interpreter (TRITON_INTERPRET=1, set below
before triton is imported) in float32 on small shapes. Every output that a kernel allocates with torch.empty
starts as NaN, every state pool is a strided view filled with random values, and slots the batch does not
name must come back bit-identical.
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")     # also set by conftest.py; kept for running this file alone
pytest.importorskip("triton")

import kernels.torch.conv as ref_conv  # noqa: E402
import kernels.torch.kda as ref_kda  # noqa: E402
from kernels.triton.conv import short_conv_decode, short_conv_prefill  # noqa: E402
from kernels.triton.kda_decode import kda_decode  # noqa: E402
from kernels.triton.kda_gate import kda_gate  # noqa: E402
from kernels.triton.kda_prefill import kda_prefill  # noqa: E402
from kernels.triton.tuning import KINDS, KernelConfig, kernel_config  # noqa: E402
from kda_helpers import (  # noqa: E402
    CONV_TOL,
    DEVICE,
    GATE_TOL,
    KDA_OUT_TOL,
    KDA_STATE_TOL,
    NUM_SLOTS,
    PREFILL_CASES,
    _as64,
    _check_prefill_case,
    _cu_seqlens,
    _gate,
    _inputs,
    _state_pool,
    nan_poisoned_empty,  # noqa: F401 (autouse fixture: every torch.empty starts as NaN)
)


@pytest.mark.parametrize("form", ["softplus", "lower_bound"])
def test_gate_matches_reference(form):
    params = _gate(form, num_heads=3, k_dim=16, strong=False)
    f = 8.0 * torch.randn(37, 3, 16, device=DEVICE)                 # reaches both softplus branches (> 20, << 0)
    g = kda_gate(f, params)
    expected = ref_kda.kda_gate(f.double(), params)
    assert g.dtype == torch.float32 and g.shape == f.shape
    torch.testing.assert_close(g.double(), expected, **GATE_TOL)
    assert (g <= 0).all()


@pytest.mark.parametrize("form,chunk_size,lengths,k_dim,v_dim,interval,strong", PREFILL_CASES)
def test_prefill_matches_reference(form, chunk_size, lengths, k_dim, v_dim, interval, strong):
    _check_prefill_case(form, chunk_size, lengths, k_dim, v_dim, interval, strong, kda_prefill)


# The two-block intra pass (two 16-token halves of a 32-token chunk): every chunk shape it meets (full chunks,
# checkpoint cuts and sequence tails of <= 16 and 17..31 tokens, one-token sequences), random and saturated
# lower-bounded gates (strong: about -5 per token, so the in-half column factors reach exp(80)).
TWO_BLOCK_CASES = [
    ([1, 40, 15, 1, 70], 16, 32, 32, False),
    ([32, 17, 64, 33], 16, 16, 0, True),
    ([50, 24], 32, 16, 24, True),
    ([96], 16, 32, 16, False),
]


@pytest.mark.parametrize("lengths,k_dim,v_dim,interval,strong", TWO_BLOCK_CASES)
def test_prefill_two_block_intra_matches_reference(lengths, k_dim, v_dim, interval, strong, monkeypatch):
    import kernels.triton.kda_prefill as prefill_module
    launches = []
    real_kernel = prefill_module.kda_chunk_intra_two_block_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return real_kernel[grid]

    two_block = dataclasses.replace(kernel_config("kda_intra"), two_block=True, sub_chunk=16)
    monkeypatch.setattr(prefill_module, "kda_chunk_intra_two_block_kernel", Spy())
    monkeypatch.setattr(prefill_module, "kernel_config",
                        lambda kind: two_block if kind == "kda_intra" else kernel_config(kind))
    _check_prefill_case("lower_bound", 32, lengths, k_dim, v_dim, interval, strong, kda_prefill)
    assert len(launches) == 1


def test_two_block_intra_applies_only_where_its_bound_holds():
    from kernels.triton.kda_prefill import prepare_kda_prefill
    inputs = _inputs(40, 2, 16, 16, strong=False)
    _, state = _state_pool(2, 16, 16)
    common = dict(cu_seqlens=_cu_seqlens([40]).to(DEVICE), state=state, slot_ids=torch.tensor([0], device=DEVICE),
                  has_initial_state=torch.tensor([False], device=DEVICE), scale=1.0)
    config = KernelConfig(two_block=True, sub_chunk=16)
    for form, lower_bound, chunk, expected in (("lower_bound", -5.0, 32, True), ("lower_bound", -6.0, 32, False),
                                               ("softplus", -5.0, 32, False), ("lower_bound", -5.0, 16, False),
                                               ("lower_bound", -5.0, 64, False)):
        gate = _gate(form, 2, 16, False)._replace(lower_bound=lower_bound)
        launch, _ = prepare_kda_prefill(**inputs, gate=gate, **common, chunk_size=chunk)
        assert launch.uses_two_block(config) is expected, (form, lower_bound, chunk)
        assert launch.uses_two_block(dataclasses.replace(config, two_block=False)) is False


def test_prefill_empty_batch():
    num_heads, k_dim, v_dim = 2, 16, 16
    inputs = _inputs(0, num_heads, k_dim, v_dim, strong=False)
    arena, state = _state_pool(num_heads, v_dim, k_dim)
    arena_before = arena.clone()
    out = kda_prefill(**inputs, gate=_gate("lower_bound", num_heads, k_dim, False),
                      cu_seqlens=torch.zeros(1, dtype=torch.int32, device=DEVICE), state=state,
                      slot_ids=torch.zeros(0, dtype=torch.int64, device=DEVICE),
                      has_initial_state=torch.zeros(0, dtype=torch.bool, device=DEVICE), scale=1.0,
                      checkpoint_interval=64)
    assert out.output.shape == (0, num_heads, v_dim)
    assert out.checkpoint_states.shape == (0, num_heads, v_dim, k_dim) and out.checkpoint_lengths.numel() == 0
    assert torch.equal(arena, arena_before)


def test_prefill_then_decode_continues_the_sequence():
    """Prefill of 20 tokens then 3 decode steps equals one prefill of all 23 tokens (chunking must not matter)."""
    num_heads, k_dim, v_dim, total = 2, 16, 16, 23
    inputs = _inputs(total, num_heads, k_dim, v_dim, strong=False)
    gate = _gate("lower_bound", num_heads, k_dim, False)
    _, state = _state_pool(num_heads, v_dim, k_dim)
    whole_state = state.clone()
    slot = torch.tensor([4], device=DEVICE)
    no_init = torch.tensor([False], device=DEVICE)
    head = {name: t[:20] for name, t in inputs.items()}
    kda_prefill(**head, gate=gate, cu_seqlens=_cu_seqlens([20]).to(DEVICE), state=state, slot_ids=slot,
                has_initial_state=no_init, scale=0.5, chunk_size=16)
    stepped = [kda_decode(**{name: t[i:i + 1] for name, t in inputs.items()}, gate=gate, state=state,
                          slot_ids=slot, scale=0.5) for i in range(20, total)]
    whole = kda_prefill(**inputs, gate=gate, cu_seqlens=_cu_seqlens([total]).to(DEVICE), state=whole_state,
                        slot_ids=slot, has_initial_state=no_init, scale=0.5, chunk_size=16)
    torch.testing.assert_close(torch.cat(stepped), whole.output[20:], **KDA_OUT_TOL)
    torch.testing.assert_close(state[4], whole_state[4], **KDA_STATE_TOL)


@pytest.mark.parametrize("form,k_dim,v_dim,strong", [("lower_bound", 16, 32, True), ("softplus", 64, 64, False),
                                                     ("softplus", 32, 16, True)])
def test_decode_matches_reference(form, k_dim, v_dim, strong):
    num_heads, batch = 3, 4
    inputs = _inputs(batch, num_heads, k_dim, v_dim, strong)
    gate = _gate(form, num_heads, k_dim, strong)
    arena, state = _state_pool(num_heads, v_dim, k_dim)
    arena_before = arena.clone()
    expected_state = state.double()
    slot_ids = torch.randperm(NUM_SLOTS)[:batch].to(DEVICE)
    out = kda_decode(**inputs, gate=gate, state=state, slot_ids=slot_ids, scale=0.4)
    expected = ref_kda.kda_decode(**_as64(inputs), gate=gate, state=expected_state, slot_ids=slot_ids, scale=0.4)
    torch.testing.assert_close(out.double(), expected, **KDA_OUT_TOL)
    torch.testing.assert_close(state[slot_ids].double(), expected_state[slot_ids], **KDA_STATE_TOL)
    untouched = torch.ones(NUM_SLOTS, dtype=torch.bool)
    untouched[slot_ids.cpu()] = False
    assert torch.equal(arena[untouched], arena_before[untouched])
    assert torch.equal(arena[:, 0], arena_before[:, 0])


def test_decode_empty_batch():
    inputs = _inputs(0, 2, 16, 16, strong=False)
    arena, state = _state_pool(2, 16, 16)
    arena_before = arena.clone()
    out = kda_decode(**inputs, gate=_gate("softplus", 2, 16, False), state=state,
                     slot_ids=torch.zeros(0, dtype=torch.int64, device=DEVICE), scale=1.0)
    assert out.shape == (0, 2, 16) and torch.equal(arena, arena_before)


def _conv_pool(kernel: int, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    arena = torch.randn(NUM_SLOTS, kernel - 1 + 2, channels, device=DEVICE)
    return arena, arena[:, 1:kernel]                                # dim 0 strided, inner dims contiguous


@pytest.mark.parametrize("kernel,lengths", [(4, [1, 2, 70, 5]), (2, [3, 1]), (4, [130])])
def test_conv_prefill_matches_reference(kernel, lengths):
    channels = 40                                                   # not a power of two: channel masks
    cu_seqlens = _cu_seqlens(lengths).to(DEVICE)
    x = torch.randn(int(cu_seqlens[-1]), channels, device=DEVICE)
    weight = torch.randn(channels, kernel, device=DEVICE)
    arena, conv_state = _conv_pool(kernel, channels)
    arena_before = arena.clone()
    expected_state = conv_state.double()
    slot_ids = torch.randperm(NUM_SLOTS)[:len(lengths)].to(DEVICE)
    has_initial_state = torch.tensor([i % 2 == 0 for i in range(len(lengths))], device=DEVICE)
    y = short_conv_prefill(x, weight, cu_seqlens, conv_state, slot_ids, has_initial_state)
    expected = ref_conv.short_conv_prefill(x.double(), weight.double(), cu_seqlens, expected_state, slot_ids,
                                           has_initial_state)
    assert y.dtype == x.dtype
    torch.testing.assert_close(y.double(), expected, **CONV_TOL)
    torch.testing.assert_close(conv_state[slot_ids].double(), expected_state[slot_ids], **CONV_TOL)
    untouched = torch.ones(NUM_SLOTS, dtype=torch.bool)
    untouched[slot_ids.cpu()] = False
    assert torch.equal(arena[untouched], arena_before[untouched])
    assert torch.equal(arena[:, 0], arena_before[:, 0]) and torch.equal(arena[:, kernel:], arena_before[:, kernel:])


def test_conv_prefill_empty_sequence_keeps_or_clears_the_window():
    """A 0-token sequence leaves its history as the window (or zeros without one); empty batches do nothing."""
    kernel, channels = 4, 24
    arena, conv_state = _conv_pool(kernel, channels)
    before = conv_state.clone()
    x = torch.randn(3, channels, device=DEVICE)
    weight = torch.randn(channels, kernel, device=DEVICE)
    y = short_conv_prefill(x, weight, _cu_seqlens([0, 3, 0]).to(DEVICE), conv_state,
                           torch.tensor([0, 1, 2], device=DEVICE), torch.tensor([True, True, False], device=DEVICE))
    assert torch.isfinite(y).all()
    assert torch.equal(conv_state[0], before[0])
    assert torch.equal(conv_state[2], torch.zeros_like(before[2]))
    assert torch.equal(conv_state[1], x)
    arena_before = arena.clone()
    empty = short_conv_prefill(x[:0], weight, torch.zeros(1, dtype=torch.int32, device=DEVICE), conv_state,
                               torch.zeros(0, dtype=torch.int64, device=DEVICE),
                               torch.zeros(0, dtype=torch.bool, device=DEVICE))
    assert empty.shape == (0, channels) and torch.equal(arena, arena_before)


@pytest.mark.parametrize("kernel", [4, 2])
def test_conv_decode_matches_reference(kernel):
    channels, batch = 40, 3
    x = torch.randn(batch, channels, device=DEVICE)
    weight = torch.randn(channels, kernel, device=DEVICE)
    arena, conv_state = _conv_pool(kernel, channels)
    arena_before = arena.clone()
    expected_state = conv_state.double()
    slot_ids = torch.randperm(NUM_SLOTS)[:batch].to(DEVICE)
    y = short_conv_decode(x, weight, conv_state, slot_ids)
    expected = ref_conv.short_conv_decode(x.double(), weight.double(), expected_state, slot_ids)
    torch.testing.assert_close(y.double(), expected, **CONV_TOL)
    torch.testing.assert_close(conv_state[slot_ids].double(), expected_state[slot_ids], **CONV_TOL)
    untouched = torch.ones(NUM_SLOTS, dtype=torch.bool)
    untouched[slot_ids.cpu()] = False
    assert torch.equal(arena[untouched], arena_before[untouched])


def test_prefill_rejects_bad_arguments():
    inputs = _inputs(4, 2, 16, 16, strong=False)
    gate = _gate("lower_bound", 2, 16, False)
    _, state = _state_pool(2, 16, 16)
    common = dict(gate=gate, cu_seqlens=_cu_seqlens([4]).to(DEVICE), slot_ids=torch.tensor([0], device=DEVICE),
                  has_initial_state=torch.tensor([True], device=DEVICE), scale=1.0)
    with pytest.raises(ValueError, match="chunk_size"):
        kda_prefill(**inputs, **common, state=state, chunk_size=24)
    with pytest.raises(ValueError, match="checkpoint_interval"):
        kda_prefill(**inputs, **common, state=state, checkpoint_interval=-1)
    for bad, match in (([[5]], "outside 1..4"), ([[2, 2]], "strictly increasing"), ([[1], [2]], "one per sequence"),
                       ([torch.tensor([1])], "host list")):
        with pytest.raises(ValueError, match=match):
            kda_prefill(**inputs, **common, state=state, checkpoint_lengths=bad)
    with pytest.raises(ValueError, match="not both"):
        kda_prefill(**inputs, **common, state=state, checkpoint_interval=2, checkpoint_lengths=[[1]])
    with pytest.raises(ValueError, match="contiguous"):
        kda_prefill(**inputs, **common, state=state.transpose(2, 3))
    with pytest.raises(ValueError, match="gate form"):
        kda_prefill(**inputs, **{**common, "gate": gate._replace(form="relu")}, state=state)


def test_kernel_configs_cover_both_vendors():
    same_tile = 0
    for kind in KINDS:
        nvidia, amd = kernel_config(kind, "nvidia"), kernel_config(kind, "amd")
        if (nvidia.block_t, nvidia.block_c, nvidia.block_v, nvidia.two_block) == (amd.block_t, amd.block_c,
                                                                                  amd.block_v, amd.two_block):
            same_tile += 1
            assert amd.num_warps <= nvidia.num_warps                 # wave64: the same tile needs fewer warps
    assert same_tile >= 3
    with pytest.raises(ValueError, match="vendor"):
        kernel_config("kda_state", "intel")

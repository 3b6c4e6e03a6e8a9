"""Triton KDA kernels (gate, chunked varlen prefill with slots and checkpoints, decode) and the short conv,
checked against the float64 PyTorch references in kernels/torch.

Runs on a GPU when there is one, otherwise under the Triton CPU interpreter (TRITON_INTERPRET=1, set below
before triton is imported) in float32 on small shapes. Every output that a kernel allocates with torch.empty
starts as NaN, every state pool is a strided view filled with random values, and slots the batch does not
name must come back bit-identical.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")     # also set by conftest.py; kept for running this file alone
pytest.importorskip("triton")

import kernels.torch.conv as ref_conv  # noqa: E402
import kernels.torch.kda as ref_kda  # noqa: E402
from k3core.ops import KdaGateParams  # noqa: E402
from kernels.triton.conv import short_conv_decode, short_conv_prefill  # noqa: E402
from kernels.triton.kda_decode import kda_decode  # noqa: E402
from kernels.triton.kda_gate import kda_gate  # noqa: E402
from kernels.triton.kda_prefill import kda_prefill  # noqa: E402
from kernels.triton.tuning import KINDS, kernel_config  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") == "0"
                      else "cpu")
NUM_SLOTS = 6

# Tolerances (float32 kernels vs float64 references, inputs O(1), |k| = |q| = 1 after the L2 norm).
# gate: a few float32 roundings of exp/sigmoid/softplus on values up to ~20 * exp(A_log).
GATE_TOL = dict(atol=1e-5, rtol=1e-5)
# KDA output: per chunk ~10 chained float32 products of [<=64, <=64] tiles (the triangular inverse) plus the
# state recurrence over <= 3 chunks; observed errors are ~1e-7..1e-6 on outputs of size ~0.1..3.
KDA_OUT_TOL = dict(atol=2e-5, rtol=2e-5)
# KDA states / checkpoints: entries up to ~5 (random initial state plus rank-1 updates), same error sources.
KDA_STATE_TOL = dict(atol=5e-5, rtol=2e-5)
# The strong softplus gate (per-token decays of hundreds) over 64-token chunks is ill-conditioned enough that float32
# itself misses the tolerances above: over 300 random draws of the [65]-token case, PyTorch's own reference run in
# float32 was off the float64 one by up to 1.5e-4 in the checkpoint states and 2.6e-5 in the outputs, and the
# kernel by up to 1.1e-4 and 1.5e-5 (it failed the tolerances above on about 2% of draws, as the reference would).
KDA_STRONG_SOFTPLUS_TOL = (dict(atol=5e-5, rtol=2e-5), dict(atol=2e-4, rtol=2e-5))     # (outputs, states)
# short conv: a K_conv-term float32 dot and a sigmoid per output.
CONV_TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(autouse=True)
def nan_poisoned_empty(monkeypatch):
    """torch.empty / empty_like return NaN-filled tensors, so an output element a kernel skips fails the test."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(tensor):
        if tensor.is_floating_point():
            tensor.fill_(float("nan"))
        return tensor

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(real_empty_like(*a, **kw)))


def _cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def _state_pool(num_heads: int, v_dim: int, k_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(arena, state view): the view strides dim 0 over two states' worth, like a slice of the unified pool."""
    arena = torch.randn(NUM_SLOTS, 2, num_heads, v_dim, k_dim, device=DEVICE)
    return arena, arena[:, 1]


def _gate(form: str, num_heads: int, k_dim: int, strong: bool) -> KdaGateParams:
    # strong: exp(A_log) ~ 7..20 saturates the lower-bounded gate at ~-5 per token (the dense path's worst case)
    # and gives the softplus gate per-token decays of hundreds (beyond exp's float32 range within one token).
    a_log = torch.rand(num_heads) + 2.0 if strong else torch.randn(num_heads) * 0.5
    # A checkpoint stores A_log padded to head_dim entries; only the first num_heads may be used.
    padded = torch.cat([a_log, torch.full((3,), 50.0)])
    return KdaGateParams(padded.to(DEVICE), torch.randn(num_heads * k_dim, device=DEVICE), form)


def _inputs(num_tokens: int, num_heads: int, k_dim: int, v_dim: int, strong: bool) -> dict[str, torch.Tensor]:
    f_scale = 4.0 if strong else 1.0
    return dict(q=torch.randn(num_tokens, num_heads, k_dim, device=DEVICE),
                k=torch.randn(num_tokens, num_heads, k_dim, device=DEVICE),
                v=torch.randn(num_tokens, num_heads, v_dim, device=DEVICE),
                f=f_scale * torch.randn(num_tokens, num_heads, k_dim, device=DEVICE),
                beta_logits=torch.randn(num_tokens, num_heads, device=DEVICE))


def _as64(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.double() for name, t in tensors.items()}


@pytest.mark.parametrize("form", ["softplus", "lower_bound"])
def test_gate_matches_reference(form):
    params = _gate(form, num_heads=3, k_dim=16, strong=False)
    f = 8.0 * torch.randn(37, 3, 16, device=DEVICE)                 # reaches both softplus branches (> 20, << 0)
    g = kda_gate(f, params)
    expected = ref_kda.kda_gate(f.double(), params)
    assert g.dtype == torch.float32 and g.shape == f.shape
    torch.testing.assert_close(g.double(), expected, **GATE_TOL)
    assert (g <= 0).all()


PREFILL_CASES = [
    # form, chunk_size, lengths, K, V, checkpoint_interval, strong gate
    ("lower_bound", 16, [1], 16, 16, 0, False),
    ("softplus", 16, [15], 16, 32, 16, False),
    ("lower_bound", 64, [63], 16, 16, 64, False),
    ("lower_bound", 64, [64], 32, 16, 64, True),
    ("softplus", 64, [65], 16, 16, 64, True),
    ("lower_bound", 64, [130], 16, 32, 64, True),
    ("lower_bound", 32, [1, 40, 15, 1, 70], 16, 32, 32, False),
    ("softplus", 16, [0, 17, 0, 5], 16, 16, 16, False),
    ("lower_bound", 16, [33, 2], 64, 64, 0, False),
    ("lower_bound", 16, [50, 24], 16, 16, 24, False),              # checkpoints off the chunk grid
]


def _long_memory_gate(num_heads: int, k_dim: int) -> KdaGateParams:
    """A lower-bounded gate that barely decays (dt_bias = -8: g ~ -5 sigmoid(-8) ~ -2e-3 per token), so the state
    carried across chunks and segments decides the outputs. The random gates above forget within a chunk (about
    -2.5 per token), which leaves the inter-chunk recurrence almost untested."""
    a_log = torch.randn(num_heads) * 0.1
    return KdaGateParams(a_log.to(DEVICE), torch.full((num_heads * k_dim,), -8.0, device=DEVICE), "lower_bound")


def _check_prefill_case(form, chunk_size, lengths, k_dim, v_dim, interval, strong, run,
                        gate: KdaGateParams | None = None) -> None:
    """run(**kda_prefill kwargs) -> KdaPrefillOut against the float64 reference: outputs, the named slots'
    states, checkpoints, and every other byte of the strided state pool untouched."""
    num_heads = 2
    cu_seqlens = _cu_seqlens(lengths).to(DEVICE)
    inputs = _inputs(int(cu_seqlens[-1]), num_heads, k_dim, v_dim, strong)
    gate = gate or _gate(form, num_heads, k_dim, strong)
    arena, state = _state_pool(num_heads, v_dim, k_dim)
    slot_ids = torch.randperm(NUM_SLOTS)[:len(lengths)].to(DEVICE)
    has_initial_state = (torch.rand(len(lengths)) < 0.6).to(DEVICE)
    expected_state = state.double()                                 # the reference updates its own copy
    arena_before = arena.clone()

    out = run(**inputs, gate=gate, cu_seqlens=cu_seqlens, state=state, slot_ids=slot_ids,
              has_initial_state=has_initial_state, scale=0.37, checkpoint_interval=interval, chunk_size=chunk_size)
    expected = ref_kda.kda_prefill(**_as64(inputs), gate=gate, cu_seqlens=cu_seqlens, state=expected_state,
                                   slot_ids=slot_ids, has_initial_state=has_initial_state, scale=0.37,
                                   checkpoint_interval=interval)

    out_tol, state_tol = (KDA_STRONG_SOFTPLUS_TOL if strong and form == "softplus" and chunk_size >= 64
                          else (KDA_OUT_TOL, KDA_STATE_TOL))
    assert out.output.dtype == inputs["v"].dtype
    torch.testing.assert_close(out.output.double(), expected.output, **out_tol)
    torch.testing.assert_close(state[slot_ids].double(), expected_state[slot_ids], **state_tol)
    assert torch.equal(out.checkpoint_seq_ids.cpu(), expected.checkpoint_seq_ids.cpu())
    assert torch.equal(out.checkpoint_lengths.cpu(), expected.checkpoint_lengths.cpu())
    assert out.checkpoint_states.dtype == torch.float32
    torch.testing.assert_close(out.checkpoint_states.double(), expected.checkpoint_states, **state_tol)
    untouched = torch.ones(NUM_SLOTS, dtype=torch.bool)
    untouched[slot_ids.cpu()] = False
    assert torch.equal(arena[untouched], arena_before[untouched])
    assert torch.equal(arena[:, 0], arena_before[:, 0])           # the bytes between the strided states


@pytest.mark.parametrize("form,chunk_size,lengths,k_dim,v_dim,interval,strong", PREFILL_CASES)
def test_prefill_matches_reference(form, chunk_size, lengths, k_dim, v_dim, interval, strong):
    _check_prefill_case(form, chunk_size, lengths, k_dim, v_dim, interval, strong, kda_prefill)


@pytest.mark.parametrize("form,chunk_size,lengths,k_dim,v_dim,interval,strong", PREFILL_CASES)
@pytest.mark.parametrize("segment_chunks", [1, 2])
def test_segmented_state_pass_matches_reference(form, chunk_size, lengths, k_dim, v_dim, interval, strong,
                                                segment_chunks):
    """KernelConfig(segment_chunks=n): each sequence's chunks as segments of >= n chunks (cut only where a
    checkpoint may fall), their affine maps, the scan over them and the state pass per segment give the
    reference's outputs, final states and checkpoints, also for empty sequences and initial states."""
    import dataclasses

    from kernels.triton.kda_prefill import prepare_kda_prefill

    def run(**kwargs):
        launch, out = prepare_kda_prefill(**kwargs)
        launch.intra()
        launch.state(dataclasses.replace(launch.state_config(), segment_chunks=segment_chunks))
        return out

    _check_prefill_case(form, chunk_size, lengths, k_dim, v_dim, interval, strong, run)


LONG_MEMORY_CASES = [(16, [100, 0, 37], 0), (32, [130, 70], 32), (16, [75], 24)]   # chunk, lengths, interval


@pytest.mark.parametrize("chunk_size,lengths,interval", LONG_MEMORY_CASES)
@pytest.mark.parametrize("variant", ["table", "prefetch", "split", "segments of 1", "segments of 3"])
def test_state_carried_across_chunks_with_a_long_memory_gate(chunk_size, lengths, interval, variant):
    """Every form of the state pass, on a gate that keeps the state for hundreds of tokens: the state handed from
    chunk to chunk (and from segment to segment) is what the outputs depend on here."""
    import dataclasses

    from kernels.triton.kda_prefill import prepare_kda_prefill

    def run(**kwargs):
        launch, out = prepare_kda_prefill(**kwargs)
        launch.intra()
        config = launch.state_config()
        changes = {"table": {}, "prefetch": {"prefetch": not config.prefetch}, "split": {"split": True},
                   "segments of 1": {"segment_chunks": 1}, "segments of 3": {"segment_chunks": 3}}[variant]
        launch.state(dataclasses.replace(config, **changes))
        return out

    _check_prefill_case("lower_bound", chunk_size, lengths, 16, 16, interval, False, run,
                        gate=_long_memory_gate(2, 16))


def test_state_config_segments_only_sequences_long_enough_for_two_segments(monkeypatch):
    """A table entry with segment_chunks (none has it yet: the segmented pass is untimed) applies to a batch only
    when its longest sequence spans two segments; shorter batches get the same entry without it."""
    import dataclasses

    from kernels.triton import kda_prefill as module

    table = {kind: dataclasses.replace(kernel_config(kind), segment_chunks=4)
             for kind in ("kda_state", "kda_state_wide")}
    monkeypatch.setattr(module, "kernel_config", lambda kind, vendor=None: table.get(kind) or kernel_config(kind))
    num_heads, k_dim, v_dim = 2, 16, 16
    for lengths, segmented in (([112, 5], False), ([128, 5], True)):     # 7 and 8 chunks of 16
        inputs = _inputs(sum(lengths), num_heads, k_dim, v_dim, strong=False)
        launch, _ = module.prepare_kda_prefill(
            **inputs, gate=_gate("lower_bound", num_heads, k_dim, False), cu_seqlens=_cu_seqlens(lengths).to(DEVICE),
            state=torch.zeros(2, num_heads, v_dim, k_dim, device=DEVICE), slot_ids=torch.arange(2, device=DEVICE),
            has_initial_state=torch.zeros(2, dtype=torch.bool, device=DEVICE), scale=0.5, chunk_size=16)
        assert launch.state_config().segment_chunks == (4 if segmented else 0), lengths


def test_segments_end_only_where_a_checkpoint_may_fall():
    from kernels.triton.kda_prefill import host_chunk_plan, plan_segments

    bounds = [0, 50, 50, 124]                        # 50 tokens, an empty sequence, 74 tokens
    host = host_chunk_plan(bounds, 16, 24)           # chunks end at 16, 24, 32, 48, 50 | - | 16, 24, 32, 48, 64, 72, 74
    segments = plan_segments(bounds, host, 24, 1, torch.device("cpu"))
    seg_chunk = segments.seg_chunk.tolist()
    assert seg_chunk == [0, 2, 4, 5, 5, 7, 9, 11, 12]
    assert segments.seq_seg.tolist() == [0, 3, 4, 8] and segments.last_seg.tolist() == [2, 3, 7]
    assert segments.seg_bos.tolist() == [0, 0, 0, 50, 50, 50, 50, 50]
    for segment, end in enumerate(seg_chunk[1:]):
        seq = next(b for b in range(3) if segments.seq_seg[b] <= segment < segments.seq_seg[b + 1])
        if end != host.seq_chunk[seq + 1]:           # an inner cut: a multiple of the interval into the sequence
            assert (host.starts[end - 1] + host.lengths[end - 1] - bounds[seq]) % 24 == 0
    with pytest.raises(ValueError, match="segment_chunks"):
        plan_segments(bounds, host, 24, 0, torch.device("cpu"))


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
    with pytest.raises(ValueError, match="contiguous"):
        kda_prefill(**inputs, **common, state=state.transpose(2, 3))
    with pytest.raises(ValueError, match="gate form"):
        kda_prefill(**inputs, **{**common, "gate": gate._replace(form="relu")}, state=state)


def test_kernel_configs_cover_both_vendors():
    for kind in KINDS:
        nvidia, amd = kernel_config(kind, "nvidia"), kernel_config(kind, "amd")
        assert amd.num_warps <= nvidia.num_warps                     # wave64: the same tile needs fewer warps
    with pytest.raises(ValueError, match="vendor"):
        kernel_config("kda_state", "intel")


@pytest.mark.parametrize("case", [PREFILL_CASES[5], PREFILL_CASES[6]])
def test_prefill_with_the_amd_table_matches_reference(case):
    """The AMD entries (never run on AMD hardware) give the reference's results under the interpreter: their
    chunk size, value blocks and solve precision; num_warps and num_stages only matter when compiled."""
    form, _, lengths, k_dim, v_dim, interval, strong = case
    from kernels.triton.kda_prefill import prepare_kda_prefill

    def run(**kwargs):
        kwargs["chunk_size"] = kernel_config("kda_intra", "amd").block_t
        launch, out = prepare_kda_prefill(**kwargs)
        launch.intra(kernel_config("kda_intra", "amd"))
        launch.state(kernel_config("kda_state", "amd"))
        return out

    _check_prefill_case(form, kernel_config("kda_intra", "amd").block_t, lengths, k_dim, v_dim, interval, strong,
                        run)


def test_state_pass_takes_wide_value_blocks_only_when_the_batch_fills_the_device():
    """kda_state_wide when sequences x heads x value blocks give >= 1 program per compute unit (16-bit inputs, or
    the interpreter), else kda_state; both configs give the reference's output (the many-sequence PREFILL_CASES
    run the wide one under the interpreter)."""
    from kernels.triton.kda_prefill import prepare_kda_prefill
    from kernels.triton.tuning_ops import compute_units
    num_heads, k_dim, v_dim = 2, 16, 32
    gate = _gate("lower_bound", num_heads, k_dim, False)
    wide, narrow = kernel_config("kda_state_wide"), kernel_config("kda_state")
    assert wide.block_v > narrow.block_v
    enough = -(-compute_units(DEVICE) // num_heads)               # sequences that fill the device at one block
    # float32 on a real GPU always keeps kda_state (shared memory); the interpreter has no such limit
    wide_ok = os.environ.get("TRITON_INTERPRET", "0") == "1"
    for num_seqs, expected in ((1, narrow), (enough - 1, narrow), (enough, wide if wide_ok else narrow)):
        lengths = [3] * num_seqs
        inputs = _inputs(sum(lengths), num_heads, k_dim, v_dim, strong=False)
        state = torch.zeros(num_seqs, num_heads, v_dim, k_dim, device=DEVICE)
        launch, result = prepare_kda_prefill(**inputs, gate=gate, cu_seqlens=_cu_seqlens(lengths).to(DEVICE),
                                             state=state, slot_ids=torch.arange(num_seqs, device=DEVICE),
                                             has_initial_state=torch.zeros(num_seqs, dtype=torch.bool,
                                                                           device=DEVICE), scale=0.5)
        assert launch.state_config() == expected, num_seqs
        launch.intra()
        outputs = []
        for config in (narrow, wide):
            launch.state(config)
            outputs.append(result.output.clone())
        expected_out = ref_kda.kda_prefill(**_as64(inputs), gate=gate, cu_seqlens=_cu_seqlens(lengths).to(DEVICE),
                                           state=torch.zeros(num_seqs, num_heads, v_dim, k_dim, dtype=torch.float64,
                                                             device=DEVICE),
                                           slot_ids=torch.arange(num_seqs, device=DEVICE),
                                           has_initial_state=torch.zeros(num_seqs, dtype=torch.bool, device=DEVICE),
                                           scale=0.5).output
        for out in outputs:
            torch.testing.assert_close(out.double(), expected_out, **KDA_OUT_TOL)


@pytest.mark.parametrize("form,chunk_size,lengths,k_dim,v_dim,interval,strong",
                         [case for case in PREFILL_CASES if sum(case[2]) > 0][::2] + [PREFILL_CASES[7]])
@pytest.mark.parametrize("split_pass", ["intra", "state", "both", "prefetch", "state+prefetch"])
def test_split_passes_match_reference(form, chunk_size, lengths, k_dim, v_dim, interval, strong, split_pass):
    """KernelConfig(split=True): the intra pass as two kernels (kda_chunk_split), the state pass with its outputs
    from a parallel kernel (kda_chunk_output_kernel), or both, give the reference's outputs, states and
    checkpoints, on both gate forms and with empty sequences in the batch. The same with the state pass loading
    each chunk's inputs one step ahead (KernelConfig(prefetch=True)), alone and with the split state pass."""
    import dataclasses

    from kernels.triton.kda_prefill import prepare_kda_prefill

    def run(**kwargs):
        launch, out = prepare_kda_prefill(**kwargs)
        launch.intra(dataclasses.replace(kernel_config("kda_intra"), split=split_pass in ("intra", "both")))
        launch.state(dataclasses.replace(launch.state_config(), split=split_pass in ("state", "both", "state+prefetch"),
                                         prefetch="prefetch" in split_pass))
        return out

    _check_prefill_case(form, chunk_size, lengths, k_dim, v_dim, interval, strong, run)

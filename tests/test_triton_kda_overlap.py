"""KDA prefill's overlapped launch: the intra pass publishing each (chunk, head) in a flag and the state pass reading a
chunk only once its flag is set, against the float64 reference (set-up in kda_helpers), what a flag that never
comes does, and where kda_prefill overlaps the passes at all. The interpreter runs one program at a time, so here
the intra pass runs to the end before the state pass starts; the concurrency itself runs only on a GPU."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")     # also set by conftest.py; kept for running this file alone
pytest.importorskip("triton")

import kernels.torch.kda as ref_kda  # noqa: E402
from kda_helpers import (  # noqa: E402
    DEVICE,
    KDA_OUT_TOL,
    PREFILL_CASES,
    _as64,
    _check_prefill_case,
    _cu_seqlens,
    _gate,
    _inputs,
    _long_memory_gate,
    nan_poisoned_empty,  # noqa: F401 (autouse fixture: every torch.empty starts as NaN)
)
from kernels.triton import kda_prefill as prefill_module  # noqa: E402
from kernels.triton.kda_prefill import prepare_kda_prefill, state_pass_overlaps  # noqa: E402
from kernels.triton.tuning import KernelConfig, kernel_config  # noqa: E402


def _flags_for(launch) -> torch.Tensor:
    return torch.zeros(launch.num_chunks * launch.num_heads, dtype=torch.int32, device=DEVICE)


def _through_flags(state_edit=lambda config: config):
    """kda_prefill's two passes handing every chunk over by flag; checks that the intra pass set every flag."""
    def run(**kwargs):
        launch, out = prepare_kda_prefill(**kwargs)
        if launch is not None:
            flags = _flags_for(launch)
            launch.intra(flags=flags)
            assert torch.equal(flags.cpu(), torch.ones_like(flags.cpu())), "a (chunk, head) was never published"
            launch.state(state_edit(launch.state_config()), flags=flags)
        return out
    return run


@pytest.mark.parametrize("form,chunk_size,lengths,k_dim,v_dim,interval,strong", PREFILL_CASES)
def test_prefill_through_flags_matches_reference(form, chunk_size, lengths, k_dim, v_dim, interval, strong):
    """Outputs, final states and checkpoints as without flags, on every case (tails, empty sequences, initial
    states, checkpoints on and off the chunk grid)."""
    _check_prefill_case(form, chunk_size, lengths, k_dim, v_dim, interval, strong, _through_flags())


@pytest.mark.parametrize("prefetch", [False, True])
def test_prefill_through_flags_carries_a_long_memory_state(prefetch):
    """Both state forms waiting by flag (the prefetching one waits for the chunk after the current one, and past a
    sequence's end for its last), on a gate whose state lasts across every chunk of these sequences."""
    run = _through_flags(lambda config: dataclasses.replace(config, prefetch=prefetch))
    _check_prefill_case("lower_bound", 16, [0, 75, 33], 16, 16, 0, False, run, gate=_long_memory_gate(2, 16))


@pytest.mark.parametrize("prefetch", [False, True])
def test_state_pass_writes_nan_from_the_first_chunk_whose_flag_never_comes(prefetch):
    """A chunk whose intra program never published it: the state pass gives up after max_polls polls instead of
    hanging, and every output from that chunk on is NaN (so is the final state); the chunks before it are right."""
    lengths, chunk = [40], 16                                   # chunks of 16, 16 and 8 tokens
    heads, dim = 2, 16
    cu_seqlens = _cu_seqlens(lengths).to(DEVICE)
    inputs = _inputs(sum(lengths), heads, dim, dim, False)
    gate = _gate("lower_bound", heads, dim, False)
    state = torch.zeros(1, heads, dim, dim, device=DEVICE)
    args = dict(**inputs, gate=gate, cu_seqlens=cu_seqlens, state=state,
                slot_ids=torch.zeros(1, dtype=torch.int64, device=DEVICE),
                has_initial_state=torch.zeros(1, dtype=torch.bool, device=DEVICE), scale=0.37)
    launch, out = prepare_kda_prefill(**args, chunk_size=chunk)
    launch.intra()
    flags = _flags_for(launch)
    flags[:heads] = 1                                           # only chunk 0 was published
    launch.state(dataclasses.replace(launch.state_config(), prefetch=prefetch), flags=flags, max_polls=3)
    expected = ref_kda.kda_prefill(**_as64(inputs), gate=gate, cu_seqlens=cu_seqlens,
                                   state=torch.zeros(1, heads, dim, dim, dtype=torch.float64, device=DEVICE),
                                   slot_ids=args["slot_ids"], has_initial_state=args["has_initial_state"], scale=0.37)
    torch.testing.assert_close(out.output[:chunk].double(), expected.output[:chunk], **KDA_OUT_TOL)
    assert torch.isnan(out.output[chunk:]).all()
    assert torch.isnan(state).all()


def test_intra_pass_without_flags_writes_none():
    """The plain launch passes a stand-in for the flags and must not write through it: it is the chunk length
    table, which the state pass reads afterwards."""
    inputs = _inputs(40, 2, 16, 16, False)
    launch, _ = prepare_kda_prefill(**inputs, gate=_gate("lower_bound", 2, 16, False),
                                    cu_seqlens=_cu_seqlens([40]).to(DEVICE), state=torch.zeros(1, 2, 16, 16),
                                    slot_ids=torch.zeros(1, dtype=torch.int64), has_initial_state=torch.zeros(1),
                                    scale=0.37, chunk_size=16)
    lengths_before = launch.plan.chunk_len.clone()
    launch.intra()
    assert torch.equal(launch.plan.chunk_len, lengths_before)


def test_overlap_only_where_every_wait_can_be_met():
    """The passes run at the same time only on a GPU, for a one-kernel state pass the table asks to overlap, and
    with fewer state programs than SMs (so an SM is always left for the intra programs the state programs wait on).
    K3 at B=1 on an H200: 12 heads x 8 value blocks = 96 programs on 132 SMs."""
    overlap = KernelConfig(block_v=16, num_warps=4, num_stages=2, prefetch=True, overlap=True)
    assert state_pass_overlaps(overlap, 96, 132, on_gpu=True)
    assert not state_pass_overlaps(overlap, 132, 132, on_gpu=True)         # every SM could hold a waiting program
    assert not state_pass_overlaps(overlap, 96, 132, on_gpu=False)         # the interpreter: one program at a time
    assert not state_pass_overlaps(dataclasses.replace(overlap, segment_chunks=4), 96, 132, on_gpu=True)
    assert not state_pass_overlaps(dataclasses.replace(overlap, overlap=False), 96, 132, on_gpu=True)


def test_segmented_state_pass_refuses_flags():
    inputs = _inputs(40, 2, 16, 16, False)
    launch, _ = prepare_kda_prefill(**inputs, gate=_gate("lower_bound", 2, 16, False),
                                    cu_seqlens=_cu_seqlens([40]).to(DEVICE), state=torch.zeros(1, 2, 16, 16),
                                    slot_ids=torch.zeros(1, dtype=torch.int64), has_initial_state=torch.zeros(1),
                                    scale=0.37, chunk_size=16)
    launch.intra()
    with pytest.raises(ValueError, match="segmented"):
        launch.state(dataclasses.replace(launch.state_config(), segment_chunks=1), flags=_flags_for(launch))


def test_tables_overlap_only_on_nvidia(monkeypatch):
    """NVIDIA's narrow state entry overlaps (measured there); AMD's does not (not run on AMD hardware), nor does a
    wide entry (many programs: the overlap rule would refuse it anyway)."""
    monkeypatch.setattr("kernels.triton.tuning.detect_vendor", lambda: "nvidia")
    assert kernel_config("kda_state").overlap and not kernel_config("kda_state_wide").overlap
    monkeypatch.setattr("kernels.triton.tuning.detect_vendor", lambda: "amd")
    assert not kernel_config("kda_state").overlap


def test_state_config_drops_prefetch_past_the_checked_chunk_size():
    """The prefetching narrow state kernel was checked at 32-token chunks and broke on longer ones on the H200
    (kda_prefill.PREFETCH_CHECKED_CHUNK); the config for 64-token chunks runs without it."""
    inputs = _inputs(200, 2, 16, 16, False)
    common = dict(**inputs, gate=_gate("lower_bound", 2, 16, False), cu_seqlens=_cu_seqlens([200]).to(DEVICE),
                  state=torch.zeros(1, 2, 16, 16), slot_ids=torch.zeros(1, dtype=torch.int64),
                  has_initial_state=torch.zeros(1), scale=0.37)
    prefetching = dataclasses.replace(kernel_config("kda_state"), prefetch=True, block_v=16)
    for chunk, expected in ((32, True), (64, False)):
        launch, _ = prepare_kda_prefill(**common, chunk_size=chunk)
        original = prefill_module.kernel_config
        try:
            prefill_module.kernel_config = lambda kind: prefetching if kind.startswith("kda_state") else original(kind)
            assert launch.state_config().prefetch is expected
        finally:
            prefill_module.kernel_config = original

"""KDA prefill with both passes in one launch (`kernels/triton/kda_chunk_fused.py`): every intra program publishes
its (chunk, head) and the state programs read a chunk only once its flag is set, against the float64 reference
(set-up in kda_helpers); what a flag that never comes does; where the fused launch applies. The interpreter runs
one program at a time in id order, so there the intra programs come first and finish before any state program
starts: these tests check the roles, indices and flags, not the concurrency, which runs only on a GPU."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")     # also set by conftest.py; kept for running this file alone
pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import kernels.torch.kda as ref_kda  # noqa: E402
from kda_helpers import (  # noqa: E402
    DEVICE,
    KDA_OUT_TOL,
    _as64,
    _check_prefill_case,
    _cu_seqlens,
    _gate,
    _inputs,
    _long_memory_gate,
    nan_poisoned_empty,  # noqa: F401 (autouse fixture: every torch.empty starts as NaN)
)
from kernels.triton import kda_chunk_fused  # noqa: E402
from kernels.triton import kda_prefill as prefill_module  # noqa: E402
from kernels.triton.kda_prefill import prepare_kda_prefill  # noqa: E402
from kernels.triton.tuning import KernelConfig, kernel_config  # noqa: E402

INTRA = KernelConfig(block_t=32, sub_chunk=16, num_warps=1, two_block=True)       # two 16-token halves
STATE = KernelConfig(block_v=16, num_warps=1, num_stages=1, prefetch=True)


def _fused_run(monkeypatch, state=STATE):
    """kda_prefill as one fused launch (room for every state program: the rule itself is tested below); checks
    that every (chunk, head) was published."""
    monkeypatch.setattr(prefill_module, "compute_units", lambda device: 1 << 20)

    def run(**kwargs):
        launch, out = prepare_kda_prefill(**kwargs)
        if launch is not None:
            flags = launch.fused(INTRA, state)
            assert torch.equal(flags.cpu(), torch.ones_like(flags.cpu())), "a (chunk, head) was never published"
        return out
    return run


@pytest.mark.parametrize("lengths,k_dim,v_dim,interval", [
    ([1], 16, 16, 0), ([40], 16, 32, 32), ([1, 40, 15, 1, 70], 16, 32, 32), ([0, 33, 0, 64], 16, 16, 0),
    ([50, 24], 16, 16, 24), ([33, 2], 64, 64, 0)])
def test_fused_prefill_matches_reference(monkeypatch, lengths, k_dim, v_dim, interval):
    """Outputs, final states and checkpoints of the fused launch: single and several sequences, empty ones, tails,
    initial states, checkpoints on and off the chunk grid (32-token chunks as two 16-token halves)."""
    _check_prefill_case("lower_bound", 32, lengths, k_dim, v_dim, interval, False, _fused_run(monkeypatch))


def test_fused_prefill_carries_a_long_memory_state(monkeypatch):
    """A gate whose state lasts across every chunk: a chunk read before its intra program wrote it, or the wrong
    chunk's workspace, would show in every later output."""
    _check_prefill_case("lower_bound", 32, [0, 75, 97], 16, 16, 0, False, _fused_run(monkeypatch),
                        gate=_long_memory_gate(2, 16))


@triton.jit
def _publish_all_but_chunk_one(flag_ptr, i_chunk, i_h, H: tl.constexpr):
    if i_chunk != 1:
        tl.debug_barrier()
        tl.atomic_xchg(flag_ptr + i_chunk * H + i_h, 1, sem="release", scope="gpu")


def test_a_flag_that_never_comes_gives_nan_from_its_chunk_on(monkeypatch):
    """Chunk 1 never published: the state programs give up after max_spins polls instead of hanging, every output
    from chunk 1 on is NaN and so is the final state; chunk 0's outputs are right."""
    monkeypatch.setattr(kda_chunk_fused, "_publish", _publish_all_but_chunk_one)
    monkeypatch.setattr(prefill_module, "compute_units", lambda device: 1 << 20)
    lengths, chunk, heads, dim = [80], 32, 2, 16
    cu_seqlens = _cu_seqlens(lengths).to(DEVICE)
    inputs = _inputs(sum(lengths), heads, dim, dim, False)
    gate = _gate("lower_bound", heads, dim, False)
    state = torch.zeros(1, heads, dim, dim, device=DEVICE)
    args = dict(**inputs, gate=gate, cu_seqlens=cu_seqlens, state=state,
                slot_ids=torch.zeros(1, dtype=torch.int64, device=DEVICE),
                has_initial_state=torch.zeros(1, dtype=torch.bool, device=DEVICE), scale=0.37)
    launch, out = prepare_kda_prefill(**args, chunk_size=chunk)
    flags = launch.fused(INTRA, STATE, max_spins=3)
    assert flags.view(-1, heads)[:, 0].tolist() == [1, 0, 1]
    expected = ref_kda.kda_prefill(**_as64(inputs), gate=gate, cu_seqlens=cu_seqlens,
                                   state=torch.zeros(1, heads, dim, dim, dtype=torch.float64, device=DEVICE),
                                   slot_ids=args["slot_ids"], has_initial_state=args["has_initial_state"], scale=0.37)
    torch.testing.assert_close(out.output[:chunk].double(), expected.output[:chunk], **KDA_OUT_TOL)
    assert torch.isnan(out.output[chunk:]).all()
    assert torch.isnan(state).all()


def test_fused_launch_applies_only_where_every_wait_can_be_met(monkeypatch):
    """The two-block intra program and the prefetching, unsegmented state loop only, and no more state programs
    than SMs/CUs (half of every SM's two slots stays for the intra programs the state programs wait on). K3 at
    B=1 on an H200: 12 heads x 8 value blocks = 96 programs on 132 SMs."""
    inputs = _inputs(200, 2, 16, 32, False)
    common = dict(**inputs, gate=_gate("lower_bound", 2, 16, False), state=torch.zeros(4, 2, 32, 16, device=DEVICE),
                  has_initial_state=torch.zeros(2, device=DEVICE), scale=0.37, chunk_size=32)
    launch, _ = prepare_kda_prefill(**common, cu_seqlens=_cu_seqlens([120, 80]).to(DEVICE),
                                    slot_ids=torch.tensor([0, 2], device=DEVICE))
    monkeypatch.setattr(prefill_module, "compute_units", lambda device: 8)       # 2 seqs x 2 heads x 2 blocks
    assert launch.fused_unavailable(INTRA, STATE) == ""
    monkeypatch.setattr(prefill_module, "compute_units", lambda device: 7)
    assert "state programs" in launch.fused_unavailable(INTRA, STATE)
    with pytest.raises(ValueError, match="state programs"):
        launch.fused(INTRA, STATE)
    monkeypatch.setattr(prefill_module, "compute_units", lambda device: 8)
    assert "two-block" in launch.fused_unavailable(dataclasses.replace(INTRA, two_block=False), STATE)
    assert "prefetching" in launch.fused_unavailable(INTRA, dataclasses.replace(STATE, prefetch=False))
    assert "unsegmented" in launch.fused_unavailable(INTRA, dataclasses.replace(STATE, segment_chunks=2))


def test_plain_state_pass_unchanged_by_the_flag_arguments():
    """The plain state kernel passes a stand-in for the flags (the chunk length table) and must never wait on or
    write through it: the table is intact and the two-pass op still matches (kda_helpers' cases cover the rest)."""
    inputs = _inputs(40, 2, 16, 16, False)
    launch, _ = prepare_kda_prefill(**inputs, gate=_gate("lower_bound", 2, 16, False),
                                    cu_seqlens=_cu_seqlens([40]).to(DEVICE),
                                    state=torch.zeros(1, 2, 16, 16, device=DEVICE),
                                    slot_ids=torch.zeros(1, dtype=torch.int64, device=DEVICE),
                                    has_initial_state=torch.zeros(1, device=DEVICE), scale=0.37, chunk_size=16)
    lengths_before = launch.plan.chunk_len.clone()
    launch.intra()
    launch.state(dataclasses.replace(kernel_config("kda_state"), prefetch=True))
    assert torch.equal(launch.plan.chunk_len, lengths_before)

"""The forms of the Triton KDA state pass (table, wide blocks, prefetch, segmented), the vendor tables'
entries, and the state carried from chunk to chunk on a long-memory gate, each against the float64 reference
(set-up in kda_helpers)."""
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
from kernels.triton.kda_prefill import prepare_kda_prefill  # noqa: E402
from kernels.triton.tuning import kernel_config  # noqa: E402


def _state_pass_with(edit):
    """kda_prefill's two passes with the table's intra pass and the state pass's table config changed by
    `edit(config) -> config`."""
    def run(**kwargs):
        launch, out = prepare_kda_prefill(**kwargs)
        launch.intra()
        launch.state(edit(launch.state_config()))
        return out
    return run


@pytest.mark.parametrize("form,chunk_size,lengths,k_dim,v_dim,interval,strong", PREFILL_CASES)
@pytest.mark.parametrize("segment_chunks", [1, 2])
def test_segmented_state_pass_matches_reference(form, chunk_size, lengths, k_dim, v_dim, interval, strong,
                                                segment_chunks):
    """KernelConfig(segment_chunks=n): each sequence's chunks as segments of n chunks, their affine maps, the scan over them and the state pass per segment give the
    reference's outputs, final states and checkpoints, also for empty sequences and initial states."""
    run = _state_pass_with(lambda config: dataclasses.replace(config, segment_chunks=segment_chunks))
    _check_prefill_case(form, chunk_size, lengths, k_dim, v_dim, interval, strong, run)


# explicit checkpoints (what the engine asks for when a chunk crosses cache checkpoint positions): inside a chunk,
# on a chunk end, at a sequence's last token or not, none for one sequence, next to an empty sequence
EXPLICIT_CASES = [(16, [50, 0, 74], [[7, 16, 50], [], [1, 33, 40, 70]]), (32, [130, 5], [[64, 129], [5]]),
                  (16, [20], [[]])]


@pytest.mark.parametrize("chunk_size,lengths,marks", EXPLICIT_CASES)
@pytest.mark.parametrize("segment_chunks", [0, 1, 3])
def test_explicit_checkpoint_lengths_match_reference(chunk_size, lengths, marks, segment_chunks):
    """checkpoint_lengths: the states after exactly the asked token counts, in both state passes."""
    run = _state_pass_with(lambda config: dataclasses.replace(config, segment_chunks=segment_chunks))
    _check_prefill_case("lower_bound", chunk_size, lengths, 16, 32, marks, False, run,
                        gate=_long_memory_gate(2, 16))


LONG_MEMORY_CASES = [(16, [100, 0, 37], 0), (32, [130, 70], 32), (16, [75], 24)]   # chunk, lengths, interval


@pytest.mark.parametrize("chunk_size,lengths,interval", LONG_MEMORY_CASES)
@pytest.mark.parametrize("variant", ["table", "prefetch", "segments of 1", "segments of 3"])
def test_state_carried_across_chunks_with_a_long_memory_gate(chunk_size, lengths, interval, variant):
    """Every form of the state pass, on a gate that keeps the state for hundreds of tokens: the state handed from
    chunk to chunk (and from segment to segment) is what the outputs depend on here."""
    def edit(config):
        changes = {"table": {}, "prefetch": {"prefetch": not config.prefetch},
                   "segments of 1": {"segment_chunks": 1}, "segments of 3": {"segment_chunks": 3}}[variant]
        return dataclasses.replace(config, **changes)

    run = _state_pass_with(edit)
    _check_prefill_case("lower_bound", chunk_size, lengths, 16, 16, interval, False, run,
                        gate=_long_memory_gate(2, 16))


def test_state_config_segments_only_sequences_long_enough_for_two_segments(monkeypatch):
    """A table entry with segment_chunks (none has it: the segmented pass lost on the H200) applies to a batch only
    when its longest sequence spans two segments; shorter batches get the same entry without it."""
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


def test_segments_cut_every_segment_chunks_and_checkpoint_rows_follow_the_chunks():
    from kernels.triton.kda_prefill import NO_CHECKPOINT, host_chunk_plan, plan_segments

    bounds = [0, 50, 50, 124]                        # 50 tokens, an empty sequence, 74 tokens
    marks = [[24, 50], [], [10, 24, 74]]
    host = host_chunk_plan(bounds, 16, marks)        # chunks end at 16, 24, 32, 48, 50 | - | 10, 16, 24, 32, 48, 64, 74
    assert host.seq_chunk == [0, 5, 5, 12]
    assert host.chunk_ckpt == [NO_CHECKPOINT, 0, NO_CHECKPOINT, NO_CHECKPOINT, 1,
                               2, NO_CHECKPOINT, 3, NO_CHECKPOINT, NO_CHECKPOINT, NO_CHECKPOINT, 4]
    assert host.ckpt_seq_ids == [0, 0, 2, 2, 2] and host.ckpt_lengths == [24, 50, 10, 24, 74]
    segments = plan_segments(host, 2, torch.device("cpu"))
    assert segments.seg_chunk.tolist() == [0, 2, 4, 5, 5, 7, 9, 11, 12]
    assert segments.seq_seg.tolist() == [0, 3, 4, 8] and segments.last_seg.tolist() == [2, 3, 7]
    assert host_chunk_plan(bounds, 16, None).chunk_ckpt == []
    with pytest.raises(ValueError, match="segment_chunks"):
        plan_segments(host, 0, torch.device("cpu"))


@pytest.mark.parametrize("case", [PREFILL_CASES[5], PREFILL_CASES[6]])
def test_prefill_with_the_amd_table_matches_reference(case):
    """The AMD entries (never run on AMD hardware) give the reference's results under the interpreter: their
    chunk size, value blocks and solve precision; num_warps and num_stages only matter when compiled."""
    form, _, lengths, k_dim, v_dim, interval, strong = case

    def run(**kwargs):
        kwargs["chunk_size"] = kernel_config("kda_intra", "amd").block_t
        launch, out = prepare_kda_prefill(**kwargs)
        launch.intra(kernel_config("kda_intra", "amd"))
        launch.state(kernel_config("kda_state", "amd"))
        return out

    _check_prefill_case(form, kernel_config("kda_intra", "amd").block_t, lengths, k_dim, v_dim, interval, strong,
                        run)


def test_state_pass_takes_wide_value_blocks_only_past_one_resident_wave_of_narrow_programs():
    """kda_state while its programs (sequences x heads x value blocks) can all be resident at once
    (NARROW_STATE_PROGRAMS_PER_UNIT per compute unit), else kda_state_wide (16-bit inputs, or the interpreter); both
    configs give the reference's output (the many-sequence PREFILL_CASES run the wide one under the interpreter)."""
    from kernels.triton.kda_prefill import NARROW_STATE_PROGRAMS_PER_UNIT
    from kernels.triton.tuning_ops import compute_units
    num_heads, k_dim, v_dim = 2, 16, 32
    gate = _gate("lower_bound", num_heads, k_dim, False)
    wide, narrow = kernel_config("kda_state_wide"), kernel_config("kda_state")
    assert wide.block_v > narrow.block_v
    per_seq = num_heads * -(-v_dim // narrow.block_v)                # narrow programs per sequence
    resident = NARROW_STATE_PROGRAMS_PER_UNIT * compute_units(DEVICE)
    most = resident // per_seq                                      # the most sequences still in one wave
    # float32 on a real GPU always keeps kda_state (shared memory); the interpreter has no such limit
    wide_ok = os.environ.get("TRITON_INTERPRET", "0") == "1"
    for num_seqs, expected in ((1, narrow), (most, narrow), (most + 1, wide if wide_ok else narrow)):
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


@pytest.mark.parametrize("block_v,chunk,prefetch", [(16, 32, True), (16, 64, False), (32, 128, False),
                                                     (64, 64, True), (128, 128, True)])
def test_state_config_prefetches_narrow_blocks_only_on_checked_chunks(monkeypatch, block_v, chunk, prefetch):
    """A prefetching kda_state entry keeps prefetch at 32-token chunks, and for narrow value blocks (<= 32) loses
    it on longer chunks, where that form gave wrong outputs on the H200 (kda_prefill.PREFETCH_CHECKED_CHUNK); wide
    blocks keep it everywhere. Everything else in the entry stays."""
    import kernels.triton.kda_prefill as prefill_module
    entry = dataclasses.replace(kernel_config("kda_state"), block_v=block_v, prefetch=True)
    real = prefill_module.kernel_config
    monkeypatch.setattr(prefill_module, "kernel_config",
                        lambda kind: entry if kind in ("kda_state", "kda_state_wide") else real(kind))
    inputs = _inputs(200, 2, 16, 16, strong=False)
    launch, _ = prepare_kda_prefill(**inputs, gate=_gate("lower_bound", 2, 16, False),
                                    cu_seqlens=_cu_seqlens([200]).to(DEVICE),
                                    state=torch.zeros(1, 2, 16, 16, device=DEVICE),
                                    slot_ids=torch.zeros(1, dtype=torch.int64, device=DEVICE),
                                    has_initial_state=torch.zeros(1, dtype=torch.bool, device=DEVICE), scale=0.5,
                                    chunk_size=chunk)
    assert launch.state_config() == dataclasses.replace(entry, prefetch=prefetch)


@pytest.mark.parametrize("form,chunk_size,lengths,k_dim,v_dim,interval,strong",
                         [case for case in PREFILL_CASES if sum(case[2]) > 0][::2] + [PREFILL_CASES[7]])
@pytest.mark.parametrize("prefetch", [True, False])
def test_state_pass_with_and_without_prefetch_matches_reference(form, chunk_size, lengths, k_dim, v_dim, interval,
                                                                strong, prefetch):
    """The state pass loading each chunk's inputs one step ahead (KernelConfig(prefetch=True), the table's) or in
    the step itself gives the reference's outputs, states and checkpoints, on both gate forms and with empty
    sequences in the batch."""
    run = _state_pass_with(lambda config: dataclasses.replace(config, prefetch=prefetch))
    _check_prefill_case(form, chunk_size, lengths, k_dim, v_dim, interval, strong, run)

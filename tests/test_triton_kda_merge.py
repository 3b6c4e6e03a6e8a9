"""KDA prefill with chunk pairs merged after the intra pass (KernelConfig.merge_levels, `kda_chunk_merge`): the state
pass on the merged chunks, in each of its forms, against the float64 reference (set-up in kda_helpers), and the rule
that decides which chunks pair."""
from __future__ import annotations

import dataclasses
import itertools
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")     # also set by conftest.py; kept for running this file alone
pytest.importorskip("triton")

from kda_helpers import (  # noqa: E402
    DEVICE,
    KDA_OUT_TOL,
    PREFILL_CASES,
    _check_prefill_case,
    _cu_seqlens,
    _gate,
    _inputs,
    _long_memory_gate,
    nan_poisoned_empty,  # noqa: F401 (autouse fixture: every torch.empty starts as NaN)
)
from kernels.triton.kda_prefill import host_chunk_plan, pair_chunks, prepare_kda_prefill  # noqa: E402
from kernels.triton.tuning import kernel_config  # noqa: E402

# Cases where chunks do pair (most PREFILL_CASES checkpoint at every chunk end, so nothing merges there): tails,
# empty sequences and odd chunk counts; checkpoint intervals of none, a multiple of both merged sizes (64), of the
# first only (32), of neither (24, off the chunk grid); K != V; the table's chunk size (32, merged to 64 and 128).
MERGE_CASES = [
    # form, chunk_size, lengths, K, V, checkpoint_interval, strong gate
    ("lower_bound", 16, [100, 0, 37, 64], 16, 32, 0, False),
    ("lower_bound", 16, [96, 50], 16, 16, 64, False),
    ("softplus", 16, [80, 17], 16, 16, 32, False),
    ("lower_bound", 16, [75, 40], 32, 16, 24, True),
    ("lower_bound", 32, [1, 40, 15, 1, 70, 128], 16, 32, 0, False),
]


def _merged_run(levels: int, edit_state=lambda config: config, merged: list[bool] | None = None):
    """kda_prefill's passes with the table's intra config merged `levels` times and the state pass's table config
    changed by `edit_state`; appends to `merged` whether the state pass walked fewer chunks than the intra pass."""
    def run(**kwargs):
        launch, out = prepare_kda_prefill(**kwargs)
        launch.intra(dataclasses.replace(kernel_config("kda_intra"), merge_levels=levels))
        assert launch.chunks.chunk_size == kwargs["chunk_size"] << levels
        if merged is not None:
            merged.append(launch.chunks.plan.chunk_len.numel() < launch.num_chunks)
        launch.state(edit_state(launch.state_config()))
        return out
    return run


@pytest.mark.parametrize("form,chunk_size,lengths,k_dim,v_dim,interval,strong", MERGE_CASES + PREFILL_CASES)
@pytest.mark.parametrize("levels", [1, 2])
def test_prefill_on_merged_chunks_matches_reference(form, chunk_size, lengths, k_dim, v_dim, interval, strong,
                                                    levels):
    """Outputs, final states and checkpoints of the state pass on chunks merged once (2x the tokens) or twice (4x),
    with initial states on some sequences."""
    merged = []
    _check_prefill_case(form, chunk_size, lengths, k_dim, v_dim, interval, strong, _merged_run(levels, merged=merged))
    if (form, chunk_size, lengths, k_dim, v_dim, interval, strong) in MERGE_CASES:
        assert merged == [True]


@pytest.mark.parametrize("form,chunk_size,lengths,k_dim,v_dim,interval,strong", MERGE_CASES)
@pytest.mark.parametrize("levels,segment_chunks", [(1, 1), (1, 2), (2, 1)])
def test_segmented_state_pass_on_merged_chunks_matches_reference(form, chunk_size, lengths, k_dim, v_dim, interval,
                                                                 strong, levels, segment_chunks):
    """The segmented state pass (its maps, scan and per-segment pass) walks the merged chunks too."""
    run = _merged_run(levels, lambda config: dataclasses.replace(config, segment_chunks=segment_chunks))
    _check_prefill_case(form, chunk_size, lengths, k_dim, v_dim, interval, strong, run)


LONG_MEMORY_CASES = [(16, [100, 0, 37], 0), (32, [130, 70], 64), (16, [75], 24)]   # chunk, lengths, interval


@pytest.mark.parametrize("chunk_size,lengths,interval", LONG_MEMORY_CASES)
@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("variant", ["table", "prefetch", "segments of 2"])
def test_merged_chunks_carry_the_state_with_a_long_memory_gate(chunk_size, lengths, interval, levels, variant):
    """On a gate that keeps the state for hundreds of tokens, the outputs depend on the state each merged chunk
    hands on, and so on every term of the merge that feeds it (W, U0, Kd and decay of both halves)."""
    def edit(config):
        changes = {"table": {}, "prefetch": {"prefetch": not config.prefetch},
                   "segments of 2": {"segment_chunks": 2}}[variant]
        return dataclasses.replace(config, **changes)

    _check_prefill_case("lower_bound", chunk_size, lengths, 16, 16, interval, False, _merged_run(levels, edit),
                        gate=_long_memory_gate(2, 16))


def test_one_launch_runs_any_merge_level_again_and_its_state_pass_repeatedly():
    """As the tuning sweep uses a launch: intra() at one merge level, then state() twice, then intra() at other
    levels (each planned once, then reused) on the same workspace. Every run matches the last one, which is checked
    against the reference."""
    outputs, launches = [], []

    def run(**kwargs):
        launch, out = prepare_kda_prefill(**kwargs)
        launches.append(launch)
        pool = kwargs["state"].clone()
        for levels in (2, 0, 1, 2):
            launch.intra(dataclasses.replace(kernel_config("kda_intra"), merge_levels=levels))
            for prefetch in (False, True):
                kwargs["state"].copy_(pool)                    # every state() starts from the initial states
                launch.state(dataclasses.replace(launch.state_config(), prefetch=prefetch))
                outputs.append(out.output.clone())
        return out

    _check_prefill_case("lower_bound", 16, [70, 33], 16, 16, 64, False, run, gate=_long_memory_gate(2, 16))
    launch = launches[0]
    assert [level.chunk_size for level in launch.levels] == [16, 32, 64] and launch.chunks is launch.levels[2]
    for output in outputs[:-1]:
        torch.testing.assert_close(output, outputs[-1], **KDA_OUT_TOL)


def test_merge_levels_must_not_be_negative():
    inputs = _inputs(20, 2, 16, 16, strong=False)
    launch, _ = prepare_kda_prefill(**inputs, gate=_gate("lower_bound", 2, 16, False),
                                    cu_seqlens=_cu_seqlens([20]).to(DEVICE),
                                    state=torch.zeros(1, 2, 16, 16, device=DEVICE),
                                    slot_ids=torch.zeros(1, dtype=torch.int64, device=DEVICE),
                                    has_initial_state=torch.zeros(1, dtype=torch.bool, device=DEVICE), scale=0.5)
    with pytest.raises(ValueError, match="merge_levels"):
        launch.intra(dataclasses.replace(kernel_config("kda_intra"), merge_levels=-1))


def test_pairs_in_a_batch_with_a_checkpoint_interval_off_the_chunk_grid():
    bounds = [0, 50, 50, 124]                        # 50 tokens, an empty sequence, 74 tokens
    host = host_chunk_plan(bounds, 16, 24)           # chunks end at 16, 24, 32, 48, 50 | - | 16, 24, 32, 48, 64, 72, 74
    merged, first_chunk = pair_chunks(bounds, host, 16, 24)
    # 0-16 + 16-24 pair; 24-32 is partial; 32-48 ends at a checkpoint; 48-50 is the last; the same in sequence 2,
    # where 48-64 + 64-72 pair too (the merged chunk may end at a checkpoint, its first half may not)
    assert merged.starts == [0, 24, 32, 48, 50, 74, 82, 98, 122]
    assert merged.lengths == [24, 8, 16, 2, 24, 8, 16, 24, 2]
    assert first_chunk == [0, 2, 3, 4, 5, 7, 8, 9, 11]
    assert merged.seq_chunk == [0, 4, 4, 9]
    assert (merged.seq_ckpt, merged.ckpt_seq_ids, merged.ckpt_lengths) == (host.seq_ckpt, host.ckpt_seq_ids,
                                                                           host.ckpt_lengths)


def test_pairs_never_cross_a_sequence_end_a_checkpoint_or_a_partial_chunk():
    """On random batches, two merge levels deep: every merged chunk is one finer chunk or two consecutive ones of
    one sequence whose first is full and does not end at a checkpoint; every allowed pair is taken (greedily from
    each sequence's start); and every checkpoint position still ends a merged chunk."""
    rng = random.Random(0)
    for _ in range(300):
        lengths = [rng.choice([0, 1, 15, 16, 17, 31, 32, 33, 47, 64, 100, 130]) for _ in range(rng.randint(1, 4))]
        bounds = [0, *itertools.accumulate(lengths)]
        chunk_size, interval = rng.choice([16, 32]), rng.choice([0, 16, 24, 32, 48, 64, 100])
        finer = host_chunk_plan(bounds, chunk_size, interval)
        for _ in range(2):
            merged, first_chunk = pair_chunks(bounds, finer, chunk_size, interval)
            _check_pairs(bounds, finer, merged, first_chunk, chunk_size, interval)
            finer, chunk_size = merged, 2 * chunk_size


def _check_pairs(bounds, finer, merged, first_chunk, chunk_size, interval) -> None:
    for b in range(len(bounds) - 1):
        fine = range(finer.seq_chunk[b], finer.seq_chunk[b + 1])
        mine = range(merged.seq_chunk[b], merged.seq_chunk[b + 1])
        # the merged chunks of sequence b start on its finer chunks, in order, and cover them all
        taken = [first_chunk[m] for m in mine] + [fine.stop]
        assert taken[0] == fine.start or not fine
        for m, (j, nxt) in zip(mine, zip(taken[:-1], taken[1:])):
            assert nxt - j in (1, 2)
            assert merged.starts[m] == finer.starts[j]
            assert merged.lengths[m] == sum(finer.lengths[j:nxt])
            consumed = finer.starts[j] + finer.lengths[j] - bounds[b]
            pairable = (j + 1 < fine.stop and finer.lengths[j] == chunk_size
                        and (interval == 0 or consumed % interval != 0))
            assert (nxt - j == 2) == pairable, (bounds, interval, j)
        if interval:
            ends = {merged.starts[m] + merged.lengths[m] - bounds[b] for m in mine}
            assert set(range(interval, bounds[b + 1] - bounds[b] + 1, interval)) <= ends

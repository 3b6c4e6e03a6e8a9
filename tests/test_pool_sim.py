"""bench.pool_sim: the unified pool runs the toy trace with no failure where the static pool fails, and
admits at least as much on random traces; the outputs (PNG timelines, JSON summaries) are written."""
from __future__ import annotations

import json
import random

import pytest

from bench import pool_sim
from bench.pool_sim import (UNIT_BYTES, SimRequest, Trace, make_pools, main, random_trace, replay, toy_trace,
                            unit_layout)


def test_unit_layout_sizes():
    for slot_units, page_size in ((1, 1), (3, 4), (128, 16), (7, 3)):
        layout = unit_layout(slot_units, page_size)
        assert layout.page_bytes == UNIT_BYTES and layout.slot_bytes == slot_units * UNIT_BYTES
    with pytest.raises(ValueError, match="slot_units"):
        unit_layout(0, 4)


def test_toy_trace_unified_has_no_failures_where_static_has_some(tmp_path):
    results = main(["--trace", "toy", "--out-dir", str(tmp_path)])["toy"]
    static, unified = results["static"], results["unified"]
    assert unified.failures == 0 and unified.admitted == len(toy_trace().requests)
    assert static.failures > 0 and static.refused_with_room > 0
    assert unified.peak_used_units <= 44 and unified.bytes_moved > 0 and static.bytes_moved == 0
    summary = json.loads((tmp_path / "pool_sim_toy.json").read_text())
    assert summary["results"]["unified"]["failures"] == 0
    assert len(summary["timelines"]["static"]["kda_units"]) == toy_trace().num_steps
    assert (tmp_path / "pool_sim_toy.png").stat().st_size > 10_000


def test_tiny_random_trace_writes_outputs_and_unified_admits_at_least_as_much(tmp_path):
    # A fixed seed: admitting a large request early can, on rare traces (about 2% of seeds here), crowd out a
    # later one the static pool would have taken, so "admits at least as much" is a property of a trace, not
    # a theorem (seed 0 at this load is such a trace). The theorem (never refusing while the bytes are free) is
    # checked on fresh seeds below.
    results = main(["--trace", "random", "--out-dir", str(tmp_path), "--num-requests", "40",
                    "--capacity-units", "768", "--slot-units", "16", "--long-prompt", "512,2048",
                    "--long-output", "16,64", "--short-prompt", "16,128", "--short-output", "8,48",
                    "--load", "0.9", "--seed", "2"])["random"]
    assert results["unified"].admitted >= results["static"].admitted
    assert results["unified"].failures == 0 and results["static"].failures > 0
    assert results["unified"].refused_with_room == 0        # it refuses only when the bytes are truly not there
    assert (tmp_path / "pool_sim_random.png").exists() and (tmp_path / "pool_sim_random.json").exists()


def test_replay_accounts_for_every_request_and_frees_everything():
    trace = random_trace(60, (0.0, 0.6), random.randrange(1 << 20), 512, 8, 8, 0.9, (8, 64), (4, 32),
                         (256, 1024), (8, 40), None)
    for pool in make_pools(trace):
        result, timeline = replay(trace, pool)
        assert result.admitted + result.refused == len(trace.requests)
        assert result.completed + result.aborted == result.admitted      # num_steps outlasts every request
        assert pool.num_slots == 0 and pool.num_pages == 0
        assert timeline.kda_units[-1] == 0 and timeline.free_units[-1] * UNIT_BYTES == pool.capacity_bytes
        if type(pool).__name__ == "UnifiedPool":
            assert result.refused_with_room == 0


def test_unified_never_refuses_while_the_bytes_are_free():
    # A request needing the whole pool arrives when it is empty: the unified pool admits it; the static pool
    # cannot put 10 pages in its 4-page MLA partition.
    trace = Trace("edge", (SimRequest(0, 20, 3),), capacity_units=16, slot_units=3, page_size=2, static_slots=4,
                  num_steps=6)
    static, unified = make_pools(trace)
    assert replay(trace, unified)[0].failures == 0
    assert replay(trace, static)[0].refused_with_room == 1
    assert pool_sim.pages_for(20, 2) == 10

"""The KDA prefill sweep's plumbing (`--smoke`, CPU interpreter) and its gate: a config whose output is wrong, or
that raises, is recorded as such, never timed, never picked."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tools.tune import tune_prefill
from kernels.triton.kda_prefill import PrefillLaunch
from kernels.triton.tuning import kernel_config

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke is the CPU path; the GPU run is "
                                                                   "`python -m tools.tune.tune_prefill`")


def test_chunk_sizes_option_picks_what_is_compared(tmp_path):
    result = _run(tmp_path, "--chunk-sizes", "32", "--passes", "")
    assert {t["chunk"] for t in result["trials"]} == {32}
    assert all(t["status"] == "ok" for t in result["trials"])


def _run(tmp_path, *extra: str, exit_code: int | None = None) -> dict:
    """The smoke sweep's JSON; with `exit_code`, run through `main` and check what it returned."""
    argv = ["--smoke", "--out", str(tmp_path), *extra]
    if exit_code is None:
        tune_prefill.run(argv)
    else:
        assert tune_prefill.main(argv) == exit_code
    (json_path,) = tmp_path.glob("tune-prefill-*.json")
    assert json_path.with_suffix(".md").exists()
    return json.loads(json_path.read_text())


def test_smoke_sweep_times_each_pass_and_every_config(tmp_path):
    result = _run(tmp_path, exit_code=0)
    # one row per shape and chunk size: the table's chunk size and 16 in smoke runs
    table_chunk = kernel_config("kda_intra").block_t
    assert [(r["shape"], r["chunk"]) for r in result["summary"]] == [
        (label, chunk) for label, _ in tune_prefill.SMOKE_PREFILL_SHAPES for chunk in (table_chunk, 16)]
    for row in result["summary"]:
        assert row["whole_ms"] > 0 and row["whole_host_ms"] > 0
        assert row["intra_default_ms"] > 0 and row["state_default_ms"] > 0
        mine = [t for t in result["trials"] if (t["shape"], t["chunk"]) == (row["shape"], row["chunk"])]
        # the table config first, then the grid, every one checked and timed
        assert len([t for t in mine if t["kernel"] == "intra"]) == 1 + len(tune_prefill.SMOKE_INTRA_GRID)
        assert len([t for t in mine if t["kernel"] == "state"]) == 1 + len(tune_prefill.SMOKE_STATE_GRID)
        assert all(t["status"] == "ok" and t["error"] < 1e-4 for t in mine)
        for kind in ("intra", "state"):
            assert row[f"{kind}_best"]["ms"] == min(t["ms"] for t in mine if t["kernel"] == kind)


def test_a_wrong_state_config_and_a_failing_intra_config_are_never_timed(tmp_path, monkeypatch):
    real_state, real_intra = PrefillLaunch.state, PrefillLaunch.intra

    def state(self, config=None):
        real_state(self, config)
        if config is not None and config.block_v == 8:
            self.output.mul_(1.01)                   # a subtly wrong kernel

    def intra(self, config=None):
        if config is not None and config.num_warps == 2:
            raise RuntimeError("out of resources (simulated)")
        real_intra(self, config)

    monkeypatch.setattr(PrefillLaunch, "state", state)
    monkeypatch.setattr(PrefillLaunch, "intra", intra)
    result = _run(tmp_path, "--chunk-sizes", "16")                  # the gate is per trial: one chunk size shows it
    wrong = [t for t in result["trials"] if t["kernel"] == "state" and t["config"]["block_v"] == 8]
    failed = [t for t in result["trials"] if t["kernel"] == "intra" and t["config"]["num_warps"] == 2]
    assert wrong and all(t["status"].startswith("wrong: output") and t["ms"] is None for t in wrong)
    assert failed and all(t["status"] == "error: RuntimeError: out of resources (simulated)" and t["ms"] is None
                          for t in failed)
    for row in result["summary"]:
        assert row["state_best"]["config"]["block_v"] != 8 and row["intra_best"]["config"]["num_warps"] != 2


def test_time_budget_skips_what_is_left(tmp_path):
    result = _run(tmp_path, "--budget-s", "0", exit_code=1)
    assert result["trials"] and all(t["status"].startswith("skipped") for t in result["trials"])


def test_passes_limits_the_sweep_but_both_passes_are_still_timed(tmp_path):
    result = _run(tmp_path, "--passes", "state", "--chunk-sizes", "16")
    for row in result["summary"]:
        mine = [t for t in result["trials"] if (t["shape"], t["chunk"]) == (row["shape"], row["chunk"])]
        assert len([t for t in mine if t["kernel"] == "intra"]) == 1 and row["intra_default_ms"] > 0
        assert len([t for t in mine if t["kernel"] == "state"]) == 1 + len(tune_prefill.SMOKE_STATE_GRID)
    with pytest.raises(SystemExit, match="choose from intra, state"):
        tune_prefill.run(["--smoke", "--passes", "gate"])


def test_state_sweep_skips_the_prefetching_narrow_form_past_the_checked_chunk_size():
    """It gave wrong outputs and illegal memory accesses past 32-token chunks on the H200, and an illegal access
    would end the sweep; kda_prefill never runs it there (kda_prefill.PREFETCH_CHECKED_CHUNK)."""
    narrow = dataclasses.replace(kernel_config("kda_state"), block_v=16, prefetch=True)
    assert tune_prefill._state_skip(narrow, 32) == ""
    assert "prefetch" in tune_prefill._state_skip(narrow, 64)
    assert tune_prefill._state_skip(dataclasses.replace(narrow, prefetch=False), 64) == ""
    assert tune_prefill._state_skip(dataclasses.replace(narrow, block_v=64), 128) == ""

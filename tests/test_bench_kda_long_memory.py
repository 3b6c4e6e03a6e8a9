"""bench.kda_long_memory's plumbing on the CPU, and that its number moves when the state carry is wrong."""
from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke is the CPU path; the GPU run is "
                                                                   "`python -m bench.kda_long_memory`")
os.environ.setdefault("TRITON_INTERPRET", "1")

from bench import kda_long_memory  # noqa: E402
from kernels.triton import kda_prefill as triton_kda_prefill  # noqa: E402


def test_smoke_run_writes_both_files_and_reports_fla_as_not_run(tmp_path):
    assert kda_long_memory.main(["--smoke", "--out", str(tmp_path)]) == 0
    (json_path,) = tmp_path.glob("kda-long-memory-*.json")
    assert json_path.with_suffix(".md").exists()
    (row,) = json.loads(json_path.read_text())["rows"]
    assert row["case"] == "long-memory-varlen-ckpt32" and row["ours_state"] < 1.0 and row["ours_output"] < 1.0
    assert row["fla_state"] is None and "not installed" in row["fla_unavailable"]


def test_a_wrong_state_carry_shows_in_the_state_ratio(monkeypatch):
    real = triton_kda_prefill.kda_prefill

    def drifting(*args, **kwargs):                          # 1% too much state after every call
        result = real(*args, **kwargs)
        state, slots = kwargs["state"], kwargs["slot_ids"]
        state[slots.long()] *= 1.01
        return result

    monkeypatch.setattr(triton_kda_prefill, "kda_prefill", drifting)
    row = kda_long_memory.measure("long-memory-varlen-ckpt32", 1, torch.float32, torch.device("cpu"))
    assert row["ours_state"] > 1.0

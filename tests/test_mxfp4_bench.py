"""bench/moe_mxfp4_bench.py runs end to end on the CPU (--smoke) and refuses a speed-up when its check fails."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from bench import moe_mxfp4_bench  # noqa: E402


def test_smoke_run_writes_checked_rows(tmp_path):
    rows = moe_mxfp4_bench.main(["--smoke", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "moe-mxfp4-smoke.json").read_text())
    assert len(data["rows"]) == len(rows) == 3 and {r["phase"] for r in data["rows"]} == {"decode", "prefill"}
    assert all(r["correct"] and r["speedup"] is not None for r in data["rows"])
    assert all(r["mxfp4_bytes"] < r["bf16_bytes"] / 2 for r in data["rows"])   # ~4.25 against 16 bits per value
    assert "commit" in data["meta"] and "| decode | 1 |" in (tmp_path / "moe-mxfp4-smoke.md").read_text()
    assert all(r["tile"] == "16x256x256 w1 s1" for r in data["rows"])        # the interpreter's tile, recorded


def test_a_failing_check_prints_no_speedup(tmp_path, monkeypatch):
    real = moe_mxfp4_bench.load

    def load(target):
        fn = real(target)
        if target == "kernels.triton.moe_mxfp4:moe_experts_mxfp4":
            return lambda *args, **kw: torch.zeros_like(fn(*args, **kw))  # a wrong kernel
        return fn

    monkeypatch.setattr(moe_mxfp4_bench, "load", load)
    monkeypatch.setattr(moe_mxfp4_bench, "SMOKE_DECODE_TOKENS", (2,))
    monkeypatch.setattr(moe_mxfp4_bench, "SMOKE_PREFILL_ROWS", ())
    rows = moe_mxfp4_bench.main(["--smoke", "--out", str(tmp_path)])
    assert len(rows) == 1 and not rows[0].correct and rows[0].speedup is None
    assert "refused: check failed" in (tmp_path / "moe-mxfp4-smoke.md").read_text()

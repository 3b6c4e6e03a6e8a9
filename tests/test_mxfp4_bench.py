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


def test_decode_rows_print_each_ops_kernel_ranking_or_why_there_is_none():
    """On a GPU each decode row carries both ops' kernel rankings (tools.tune.kernel_profile.rank's shape, against
    the graph-timed call); a profiler that cannot run leaves its reason, and the CPU never profiles."""
    assert "error" in moe_mxfp4_bench._profile(lambda: None, torch.device("cpu"), 1.0)
    rank = pytest.importorskip("tools.tune.kernel_profile").rank
    mxfp4 = rank([("gate_up_gluon_kernel", 60.0), ("down_gluon_kernel", 40.0), ("_group_pairs_kernel", 5.0)], 1,
                 0.119)
    row = moe_mxfp4_bench.Row("decode", 1, 16, 16, 1e-3, 1e-3, 2e-2, True, 0.119, 0.28, 1, 4, 0.5, 0.9, 2.37,
                              "graph", "8x64x256", {"mxfp4": mxfp4, "bf16": {"error": "RuntimeError: no CUPTI"}})
    text = moe_mxfp4_bench._markdown(dict(device="gpu", commit="c", date="d", torch="t", triton="tr", shape={},
                                          copy_tbps=4.0, smoke=False), [row])
    assert "decode 1 token(s), mxfp4: 105 us of kernels and 3 launches per step; kernels busy 88% of the 0.119 ms" \
        in text
    assert "| `gate_up_gluon_kernel` |" in text and "decode 1 token(s), bf16: no profile (RuntimeError: no CUPTI)." \
        in text


def test_tokens_and_no_prefill_choose_the_cases(tmp_path):
    rows = moe_mxfp4_bench.main(["--smoke", "--out", str(tmp_path), "--tokens", "2,5", "--no-prefill"])
    assert [(row.phase, row.tokens) for row in rows] == [("decode", 2), ("decode", 5)]
    assert all(row.correct for row in rows)
    for bad in ("0", "1,x", ""):
        with pytest.raises(SystemExit):
            moe_mxfp4_bench.main(["--smoke", "--out", str(tmp_path), "--tokens", bad])

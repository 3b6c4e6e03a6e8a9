"""The kernel benchmark's plumbing and, above all, its correctness gate: a wrong kernel must never get a ratio."""
from __future__ import annotations

import json
import math

import pytest
import torch

import kernels.triton.attn_res as triton_attn_res
import kernels.triton.mla_decode as triton_mla_decode
from bench import kernels as bench_kernels
from bench.report import check

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke is the CPU path; the GPU run is "
                                                                   "scripts/gpu.sh kernels")


def _run(tmp_path, only: str) -> dict:
    bench_kernels.run(["--smoke", "--only", only, "--out", str(tmp_path), "--seed", "3"])
    (json_path,) = tmp_path.glob("kernels-*.json")
    assert (tmp_path / json_path.name.replace(".json", ".md")).exists()
    return json.loads(json_path.read_text())


def test_smoke_rows_pass_and_carry_ratios_only_with_a_running_anchor(tmp_path):
    result = _run(tmp_path, "attn_res,kda_decode")
    rows = result["rows"]
    assert {r["case"] for r in rows} == {"attn_res", "kda_decode"}
    assert all(r["status"] == "ok" for r in rows), [r["status"] for r in rows]
    for row in rows:
        if row["case"] == "attn_res":            # the naive anchor runs on the CPU: a ratio is reported
            assert row["anchor_status"] == "ok" and row["ratio"] is not None and row["ratio"] > 0
        else:                                    # fla cannot run here: said so, and no ratio is invented
            assert row["anchor_status"].startswith("anchor unavailable: ") and row["ratio"] is None
    env = result["environment"]
    assert env["device_slug"] == "cpu-smoke" and env["torch"] and env["triton"] and env["commit"] and env["date"]
    assert result["ceilings"]["copy_tbps"] > 0 and result["ceilings"]["matmul_tflops"] > 0


def test_gate_refuses_a_speedup_for_a_wrong_kernel(tmp_path, monkeypatch):
    def garbage(bank, num_valid, live, query, eps):      # fast and wrong: returns the live row unmixed
        return live.clone()

    monkeypatch.setattr(triton_attn_res, "attn_res_read", garbage)
    result = _run(tmp_path, "attn_res")
    for row in result["rows"]:
        assert row["status"].startswith("FAILED"), row["status"]
        assert row["ratio"] is None and row["ours_ms"] is None and row["tbps"] is None
    markdown = next(tmp_path.glob("kernels-*.md")).read_text()
    table_rows = [line for line in markdown.splitlines() if line.startswith("| attn_res")]
    assert table_rows and all("FAILED" in line for line in table_rows)
    assert bench_kernels.main(["--smoke", "--only", "attn_res", "--out", str(tmp_path)]) == 1


def test_gate_catches_an_unwritten_element(tmp_path, monkeypatch):
    real = triton_attn_res.attn_res_read

    def forgets_one(bank, num_valid, live, query, eps):
        out = real(bank, num_valid, live, query, eps)
        out[-1, -1] = float("nan")                         # what a missed tail element of a poisoned output reads as
        return out

    monkeypatch.setattr(triton_attn_res, "attn_res_read", forgets_one)
    rows = _run(tmp_path, "attn_res")["rows"]
    assert all(r["status"].startswith("FAILED") and r["ratio"] is None for r in rows)


def test_gate_checks_every_output_tensor(tmp_path, monkeypatch):
    real = triton_mla_decode.mla_decode

    def wrong_lse(*args, **kwargs):                       # right output, LSE off by log(2)
        result = real(*args, **kwargs)
        return result._replace(lse=result.lse + math.log(2.0))

    monkeypatch.setattr(triton_mla_decode, "mla_decode", wrong_lse)
    rows = _run(tmp_path, "mla_decode")["rows"]
    assert rows and all("lse" in r["status"] and r["ratio"] is None for r in rows)
    assert all(r["anchor_status"] == "ok" for r in rows)  # the naive anchor itself is fine


def test_check_never_passes_nan_and_sees_past_the_slice():
    ref = torch.randn(6, 5, dtype=torch.float64)
    assert check(ref.float(), ref, 1e-6, "same").ok
    assert not check(torch.full_like(ref, float("nan")), ref, 1.0, "nan").ok
    full = ref.clone()
    full[5, 4] = float("nan")                             # outside the compared slice
    assert not check(full[:2], ref[:2], 1e-6, "slice", full=full).ok
    assert not check(ref * 1.1, ref, 1e-2, "10% off").ok


def test_unknown_case_is_refused_with_the_list():
    with pytest.raises(SystemExit, match="choose from: kda_prefill"):
        bench_kernels.selected("kda_prefil")


def test_time_pair_alternates_and_reports_every_speedup():
    from bench.timing import Timing, time_pair
    order = []
    ours_ms, anchor_ms = iter([1.0, 2.0, 1.5]), iter([3.0, 3.0, 6.0])

    def ours():
        order.append("ours")
        return Timing(next(ours_ms), "fake")

    def anchor():
        order.append("anchor")
        return Timing(next(anchor_ms), "fake")

    pair = time_pair(ours, anchor, 3)
    assert order == ["ours", "anchor"] * 3                         # alternating, not all of ours first
    assert (pair.ours_ms, pair.anchor_ms) == (1.5, 3.0)            # medians of each side
    assert pair.speedups == (3.0, 1.5, 4.0)                        # per repeat, in order
    assert pair.note("fla") == ("3 alternating timings of ours and fla (medians above): speed-up median 3.000, "
                                "range 1.500-4.000")
    with pytest.raises(ValueError, match="repeats"):
        time_pair(ours, anchor, 0)


def test_repeats_reach_the_context_and_bad_values_are_refused(tmp_path):
    from bench.context import make_context
    assert make_context(smoke=True, repeats=3).repeats == 3
    with pytest.raises(SystemExit, match="repeats"):
        make_context(smoke=True, repeats=0)
    rows = bench_kernels.run(["--smoke", "--only", "kda_decode", "--out", str(tmp_path), "--repeats", "2"])
    assert rows and all(row.passed for row in rows)

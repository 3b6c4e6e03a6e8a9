"""The decode tuning sweep's plumbing (`--smoke`, CPU interpreter) and its gate: a wrong or failing config is
recorded as such, never timed, never picked."""
from __future__ import annotations

import json

import pytest
import torch

import kernels.triton.kda_decode as triton_kda_decode
import kernels.triton.mla_decode as triton_mla_decode
from tools.tune import tune_decode

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke is the CPU path; the GPU run is "
                                                                   "`python -m tools.tune.tune_decode`")


def _run(tmp_path, *extra: str) -> dict:
    tune_decode.run(["--smoke", "--out", str(tmp_path), *extra])
    (json_path,) = tmp_path.glob("tune-decode-*.json")
    assert json_path.with_suffix(".md").exists()
    return json.loads(json_path.read_text())


def test_smoke_sweep_covers_every_shape_and_reports_default_and_best(tmp_path):
    result = _run(tmp_path)
    grid = tune_decode.SMOKE_GRID
    shapes = {(r["op"], r["shape"]) for r in result["summary"]}
    assert shapes == ({("mla_decode", f"B={b} L={n}") for b, n in grid.mla_shapes}
                      | {("kda_decode", f"N={n}") for n in grid.kda_batches})
    for row in result["summary"]:
        assert row["default"]["round"] == "default" and row["default"]["status"] == "ok"
        best = row["best"]
        assert best["status"] == "ok" and best["ms"] > 0 and best["pct_copy"] is not None
        mine = [t for t in result["trials"] if (t["op"], t["shape"]) == (row["op"], row["shape"]) and t["ms"]]
        assert best["ms"] == min(t["ms"] for t in mine)
    rounds = {t["round"] for t in result["trials"] if t["op"] == "mla_decode"}
    assert rounds == {"default", "tiles", "splits", "merge"}
    assert {t["config"]["tiles"] for t in result["trials"] if t["op"] == "mla_decode"} == {"page", "gather"}
    assert {t["config"]["split_policy"] for t in result["trials"] if t["round"] == "splits"} == {"cover", "waves"}
    markdown = next(tmp_path.glob("tune-decode-*.md")).read_text()
    assert '"batch 1-4": MlaDecodeConfig(' in markdown and '"seqs 1-16": KdaDecodeConfig(' in markdown


def test_wrong_configs_are_never_timed_nor_picked(tmp_path, monkeypatch):
    real = triton_mla_decode.mla_decode

    def gather_is_wrong(*args, **kwargs):
        result = real(*args, **kwargs)
        config = args[6] if len(args) > 6 else kwargs["config"]
        return result._replace(output=result.output * 1.01) if config.tiles == "gather" else result

    monkeypatch.setattr(triton_mla_decode, "mla_decode", gather_is_wrong)
    result = _run(tmp_path, "--only", "mla")
    gather = [t for t in result["trials"] if t["config"]["tiles"] == "gather"]
    assert gather and all(t["status"].startswith("wrong: output") and t["ms"] is None for t in gather)
    assert all(row["best"]["config"]["tiles"] == "page" for row in result["summary"])


def test_configs_that_raise_are_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch):
    real = triton_kda_decode.kda_decode

    def small_blocks_fail(*args, **kwargs):
        if args[-1].block_v < 16:
            raise RuntimeError("out of resources (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_kda_decode, "kda_decode", small_blocks_fail)
    result = _run(tmp_path, "--only", "kda")
    failed = [t for t in result["trials"] if t["config"]["block_v"] < 16]
    assert failed and all(t["status"] == "error: RuntimeError: out of resources (simulated)" and t["ms"] is None
                          for t in failed)
    assert all(row["best"]["config"]["block_v"] >= 16 and row["counts"]["error"] == 1 for row in result["summary"])


def test_time_budget_skips_what_is_left(tmp_path):
    result = _run(tmp_path, "--only", "kda", "--budget-s", "0")
    assert result["trials"] and all(t["status"] == "skipped: time budget spent" for t in result["trials"])
    assert tune_decode.main(["--smoke", "--only", "kda", "--budget-s", "0", "--out", str(tmp_path)]) == 1


def test_mla_shapes_filter_and_incumbent_tiles(tmp_path, monkeypatch):
    # a table tile that round 1's grid never makes (2 warps; the smoke grid has 1): only round 2's incumbents run it
    real = tune_decode.mla_decode_config
    monkeypatch.setattr(tune_decode, "mla_decode_config",
                        lambda *args, **kwargs: real(*args, **kwargs)._replace(num_warps=2))
    result = _run(tmp_path, "--only", "mla", "--mla-shapes", "1x50")
    assert {t["shape"] for t in result["trials"]} == {"B=1 L=50"}
    assert not any(t["round"] == "tiles" and t["config"]["num_warps"] == 2 for t in result["trials"])
    assert any(t["round"] == "splits" and t["config"]["num_warps"] == 2 for t in result["trials"])
    with pytest.raises(SystemExit, match="batch x context"):
        tune_decode.run(["--smoke", "--out", str(tmp_path), "--mla-shapes", "1y50"])

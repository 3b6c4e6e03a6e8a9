"""bench.moe_mxfp4_model end to end, tiny on the CPU: both expert formats built, gated against the reference, timed."""
from __future__ import annotations

import json

from bench import moe_mxfp4_model


def test_model_bench_gates_both_formats_before_reporting(tmp_path):
    assert moe_mxfp4_model.main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "moe-mxfp4-model-smoke.json").read_text())
    assert {"torch", "triton", "commit", "date"} <= set(result["meta"])            # provenance of every result
    for fmt in ("bf16", "mxfp4"):
        row = result["formats"][fmt]
        assert row["gate"]["passed"] and row["decode_step_ms_bs1"] > 0
    mx, bf = result["formats"]["mxfp4"]["weight_bytes"], result["formats"]["bf16"]["weight_bytes"]
    assert mx["other"] == bf["other"] and mx["routed_all"] < bf["routed_all"] / 3    # packed: 4.25 bits a weight
    assert "speedup_bs1" in result
    from k3core.config import load_config
    moe_layers = load_config("k3-tiny").mlp_types.count("moe")
    for fmt in ("bf16", "mxfp4"):                     # every MoE layer's experts timed, at both batch sizes
        share = result["formats"][fmt]["experts"]
        assert share["moe_layers"] == moe_layers > 0
        assert share["experts_ms_bs1"] > 0 and share["experts_ms_bs2"] > 0
        assert {"rest_ms_bs1", "rest_ms_bs2"} <= set(share)


def test_a_failed_gate_prints_no_speedup(tmp_path, monkeypatch):
    monkeypatch.setattr(moe_mxfp4_model, "correctness_gate", lambda *a: (1.0, 0.1))
    assert moe_mxfp4_model.main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "moe-mxfp4-model-smoke.json").read_text())
    assert "speedup_bs1" not in result and result["speedup"].startswith("not reported")

"""conformance.model_check's MXFP4 form: the whole network from a K3-format checkpoint with MXFP4 routed experts,
through the cuda backend's Triton kernels (interpreted here, on the CPU), against the torch backend's per-call
dequantising reference on the same bytes."""
from __future__ import annotations

import json

import pytest

from conformance import model_check


def test_mxfp4_checkpoint_through_the_cuda_backend_matches_the_reference(tmp_path, monkeypatch):
    monkeypatch.setattr(model_check, "PROMPT_LENGTHS", (1, 9))         # the interpreter: short prompts
    monkeypatch.setattr(model_check, "GREEDY_TOKENS", 3)
    report = model_check.run("cuda", "cpu", ["float32"], expert_format="mxfp4")
    (result,) = report["results"]
    assert result["providers"]["moe_experts_mxfp4"] == "cuda.triton.moe_experts_mxfp4"   # the packed kernels ran
    assert result["passed"] and result["greedy_tokens_identical"], result
    # float32 on both sides from the same exactly dequantised values: far inside the tf32-sized tolerance
    assert result["worst_relative_error"] < 1e-4, result["worst_relative_error"]
    model_check.write_report(report, str(tmp_path / "model"))
    assert "MXFP4 experts from a K3-format checkpoint" in (tmp_path / "model.md").read_text()
    assert json.loads((tmp_path / "model.json").read_text())["expert_format"] == "mxfp4"


def test_an_unknown_expert_format_is_refused_by_name():
    with pytest.raises(ValueError, match="expert_format must be one of bf16, mxfp4, got 'fp8'"):
        model_check.run("cuda", "cpu", ["float32"], expert_format="fp8")

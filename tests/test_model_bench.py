"""The whole-model benchmark's plumbing (--smoke: k3-tiny on the CPU, no graphs) and its correctness gate."""
from __future__ import annotations

import json

import pytest
import torch

from bench import model_bench
from k3core.config import load_config
from k3core.memory import PoolLayout
from k3core.model.weights import count_parameters

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke is the CPU path; the GPU run is "
                                                                   "`python -m bench.model_bench --model k3-mini`")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("model_bench")
    result = model_bench.run(["--smoke", "--out", str(out), "--seed", "2"])
    return result, out


def test_smoke_gate_passes_and_every_measurement_has_both_backends(smoke):
    result, out = smoke
    gate = result["gate"]
    assert gate["passed"] and gate["cuda_error_vs_fp32"] <= gate["tolerance"]
    assert gate["graph_passed"] is None and "no CUDA graphs" in gate["graph_note"]
    rows = result["rows"]
    for what in ("decode BS=1 at 40 context", "prefill one 36-token prompt", "decode BS=2 at 36 context"):
        timed = {(r["backend"], r["mode"]) for r in rows if r["what"] == what and r["ms"] is not None}
        assert {("cuda", "eager"), ("torch", "eager")} <= timed, (what, timed)
        graph_rows = [r for r in rows if r["what"] == what and r["mode"] == "graph"]
        assert all(r["ms"] is None and "no CUDA graphs" in r["note"] for r in graph_rows)
    assert all(r["ms"] > 0 for r in rows if r["ms"] is not None)
    assert next(r for r in rows if r["what"].startswith("decode BS=1"))["percent_of_floor"] > 0
    assert result["providers"]["cuda"]["kda_decode"].startswith("cuda.triton")
    env = result["environment"]
    assert env["device_slug"] == "cpu-smoke" and env["torch"] and env["triton"] and env["commit"] and env["date"]
    (json_path,) = out.glob("model-k3-tiny-*.json")
    assert json.loads(json_path.read_text())["gate"]["passed"]
    assert "| decode BS=1 at 40 context | cuda | eager |" in json_path.with_suffix(".md").read_text()


def test_failed_gate_times_nothing(tmp_path, monkeypatch):
    def failing_gate(*args, **kwargs):
        return {"prompt_len": 1, "routing": "-", "cuda_error_vs_fp32": 1.0, "torch_error_vs_fp32": 0.0,
                "tolerance": 5e-3, "logits_passed": False, "graph_passed": None, "graph_note": "-", "passed": False}

    monkeypatch.setattr(model_bench, "correctness_gate", failing_gate)
    monkeypatch.setattr(model_bench, "bench_decode", lambda *a, **k: pytest.fail("timed after a failed gate"))
    assert model_bench.main(["--smoke", "--out", str(tmp_path)]) == 1
    (json_path,) = tmp_path.glob("model-*.json")
    result = json.loads(json_path.read_text())
    assert result["rows"] == [] and result["speedups"] == []
    assert "FAILED: no timings" in json_path.with_suffix(".md").read_text()


@pytest.mark.parametrize("model", ["k3-tiny", "k3-mini"])
def test_memory_floor_counts_active_weights_once(model):
    """With every weight in float32 the weight bytes are 4 x (active parameters - the embedding table + one row);
    the state is read and written, the MLA context read."""
    config = load_config(model)
    layout = PoolLayout.from_config(config, page_size=16, kv_dtype=torch.bfloat16, conv_dtype=torch.bfloat16)
    floor = model_bench.decode_bytes_per_token(config, torch.float32, layout, context_len=1000)
    embedding = config.vocab_size * config.hidden_size
    assert floor["weights"] == 4 * (count_parameters(config).active - embedding + config.hidden_size)
    state_bytes = layout.state_layer_bytes + layout.conv_layer_bytes
    assert floor["kda_state"] == 2 * layout.num_kda_layers * state_bytes
    assert floor["mla_kv"] == layout.num_mla_layers * 1001 * layout.latent_width * 2
    assert floor["total"] == floor["weights"] + floor["kda_state"] + floor["mla_kv"]

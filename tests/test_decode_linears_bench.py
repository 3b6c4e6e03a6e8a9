"""bench.decode_linears: the projections it fuses are the model's own (shapes from the weight table), and the smoke
run checks every fused GEMM against the separate ones before it times anything."""
from __future__ import annotations

import json

import pytest

from bench import decode_linears
from k3core.config import load_config
from k3core.model.weights import expected_tensors


@pytest.mark.parametrize("model", ["k3-tiny", "k3-mini", "k3"])
def test_groups_are_the_weight_tables_projections_of_one_input(model):
    config = load_config(model)
    table = expected_tensors(config)
    kda, mla = config.kda_layer_ids[0], config.mla_layer_ids[0]
    moe = config.mlp_types.index("moe")

    def rows(layer: int, names: list[str]) -> list[int]:
        return [table[f"model.layers.{layer}.{name}"].shape[0] for name in names]
    qkv = sum(rows(kda, [f"self_attn.{p}_proj.weight" for p in "qkv"]))
    groups = decode_linears.groups(config)
    assert groups["kda"] == (len(config.kda_layer_ids), [qkv, *rows(kda, [
        "self_attn.f_a_proj.weight", "self_attn.b_proj.weight", "self_attn.g_proj.weight"])])
    assert groups["mla"][1] == rows(mla, ["self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
                                          "self_attn.g_proj.weight"])
    shared = sum(rows(moe, ["mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"]))
    assert groups["moe"] == (config.mlp_types.count("moe"),
                             [*rows(moe, ["mlp.routed_expert_down_proj.weight"]), shared])


def test_smoke_run_checks_then_times_every_group(tmp_path):
    assert decode_linears.main(["--smoke", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("decode-linears-k3-tiny-*.json")
    result = json.loads(path.read_text())
    assert {"torch", "triton", "commit", "date", "device"} <= set(result["environment"])
    assert {(r["layer"], r["batch"]) for r in result["rows"]} == {(k, b) for k in ("kda", "mla", "moe")
                                                                  for b in (1, 64)}
    assert all(r["checked"] and r["separate_ms"] > 0 and r["fused_ms"] > 0 for r in result["rows"])
    assert "saved_ms_bs1" in result and "saved_ms_bs64" in result

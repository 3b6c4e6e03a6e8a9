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


def test_the_reference_keeps_routed_experts_as_held_and_gives_the_same_logits():
    """The gate's float32 reference upcasts the bf16 experts expert by expert instead of holding a float32 copy
    (63 GB for k3-mini, which did not fit the H100): same logits, bit for bit, as the all-float32 reference."""
    import dataclasses

    import torch

    from k3core import LLM
    from k3core.backend import OpSpec, select_ops
    from k3core.llm import scratch_forward
    from k3core.model.network import Network
    llm = LLM("k3-tiny", backend="torch", device="cpu", dtype="bfloat16", seed=0, memory_bytes=64 << 20)
    config = dataclasses.replace(llm.config, num_experts_per_token=llm.config.num_experts)
    weights = llm.network.weights
    kept = moe_mxfp4_model.reference_weights(weights)
    routed = [name for name in weights if moe_mxfp4_model.is_routed(name)]
    assert routed and all(kept[name] is weights[name] for name in routed)
    assert all(t.dtype == torch.float32 for n, t in kept.items() if n not in routed and t.is_floating_point())
    prompt = list(range(3, 20))

    def logits(held):
        network = Network(config, held, select_ops("torch", OpSpec(config, torch.float32, torch.device("cpu"))))
        return network.forward(*scratch_forward(config, prompt, torch.float32, torch.device("cpu")))
    everything = {n: t.float() if t.is_floating_point() else t for n, t in weights.items()}
    assert torch.equal(logits(kept), logits(everything))
    llm.engine.close()


def test_the_floor_counts_what_a_decode_token_reads_as_the_model_bench_does():
    """Both floors agree on the bf16 model: one row of an untied embedding table (not the whole table, 2.3 GB of
    k3-mini's), the lm_head whole, top-k experts; the MXFP4 model's experts in packed bytes (codes and one scale
    byte per 32 weights), everything else the same."""
    import torch

    from bench.model_bench import decode_bytes_per_token
    from k3core import LLM
    held = {}
    for fmt in ("bf16", "mxfp4"):
        llm = LLM("k3-tiny", backend="torch", device="cpu", dtype="bfloat16", seed=0, memory_bytes=64 << 20,
                  expert_format=fmt)
        held[fmt] = moe_mxfp4_model.decode_weight_bytes(llm.network, llm.config)
        if fmt == "bf16":
            config, layout = llm.config, llm.engine.pool.layout
        llm.engine.close()
    assert not config.tie_word_embeddings
    expected = decode_bytes_per_token(config, torch.bfloat16, layout, context_len=24)
    assert held["bf16"]["total"] == expected["weights"]
    assert held["mxfp4"]["other"] == held["bf16"]["other"]
    weights_routed = held["bf16"]["routed_all"] // 2                               # bf16: 2 bytes a weight
    assert held["mxfp4"]["routed_all"] == weights_routed // 2 + weights_routed // 32

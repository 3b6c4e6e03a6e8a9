"""Sizing reports what the engine holds: packed MXFP4 experts, tensors sharded by the plan's rules, a fit verdict."""
from __future__ import annotations

import pytest
import torch

from k3core.config import ModelConfig
from k3core.model.weights import init_random_weights
from k3core.parallel.plan import ParallelPlan
from k3core.parallel.shard import shard_model
from k3core.sizing import main as sizing_main, per_gpu_weights, weight_bytes


@pytest.mark.parametrize("tp, ep", [(2, 1), (2, 2)])
@pytest.mark.parametrize("expert_format", ["mxfp4", "bf16"])
def test_per_gpu_weights_equal_what_shard_model_gives_a_rank(tp, ep, expert_format):
    # 64 expert columns: 32 per rank under tp=2, one whole MXFP4 scale group each
    config = ModelConfig.preset("k3-tiny").replace(expert_format=expert_format, moe_intermediate_size=64)
    weights = init_random_weights(config, seed=1, dtype=torch.bfloat16)
    local = shard_model(config, weights, ParallelPlan(tp=tp, ep=ep), rank=1)
    held = sum(t.numel() * t.element_size() for t in local.weights.values())
    assert per_gpu_weights(config, tp=tp, ep=ep).total == held
    packed = [t for name, t in local.weights.items() if ".mlp.experts." in name]
    assert all(t.dtype == (torch.uint8 if expert_format == "mxfp4" else torch.bfloat16) for t in packed)


def test_tp_split_of_mxfp4_experts_needs_whole_scale_groups():
    config = ModelConfig.preset("k3-tiny").replace(expert_format="mxfp4")       # 32 expert columns
    with pytest.raises(ValueError, match="multiple of 32"):
        ParallelPlan(tp=2).check(config)
    ParallelPlan(tp=2, ep=2).check(config)                                        # experts whole on each rank


def test_mxfp4_experts_are_4_25_bits_per_value():
    config = ModelConfig.preset("k3")
    dense = per_gpu_weights(config, tp=8, expert_format="bf16").routed_experts
    assert per_gpu_weights(config, tp=8).routed_experts == pytest.approx(dense * 4.25 / 16, rel=1e-12)
    assert weight_bytes(config) < weight_bytes(config, expert_format="bf16") / 3


def test_k3_at_tp8_fits_288gb_and_bf16_experts_do_not(capsys):
    sizing_main(["--model", "k3", "--tp", "8", "--gpu-memory", "288GB"])
    out = capsys.readouterr().out
    assert "plan: fits on 288.00 GB GPUs" in out and "MXFP4 packed" in out and "routed experts 180.81 GB" in out
    sizing_main(["--model", "k3", "--tp", "8", "--gpu-memory", "288GB", "--expert-format", "bf16"])
    assert "does NOT fit on 288.00 GB GPUs" in capsys.readouterr().out

"""Sizing reports what the engine holds: packed MXFP4 experts, tensors sharded by the plan's rules, a fit verdict."""
from __future__ import annotations

import pytest
import torch

from k3core.config import ModelConfig
from k3core.model.weights import init_random_weights
from k3core.parallel.plan import ParallelPlan
from k3core.parallel.shard import shard_model
from k3core.sizing import main as sizing_main, per_gpu_weights, weight_bytes


# Tensors a built network derives from the table and holds besides it (each well under 0.1% of K3's weights a GPU):
# MLA's value-absorption matrix (a transposed copy of part of kv_b) and AttnRes's folded float32 queries.
DERIVED = ("w_vc", "q_attn_res_attn", "q_attn_res_mlp", "q_attn_res_out")


def held_storages(network) -> tuple[dict[int, int], int]:
    """({storage pointer: bytes} of every tensor the network holds, bytes of the DERIVED ones among them)."""
    storages, derived = {}, 0

    def visit(obj, name: str, depth: int) -> None:
        nonlocal derived
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in storages:
                storages[storage.data_ptr()] = storage.nbytes()
                derived += storage.nbytes() if name in DERIVED else 0
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item, name, depth + 1)
        elif isinstance(obj, dict):
            for key, item in obj.items():
                visit(item, key, depth + 1)
        elif depth < 6 and hasattr(obj, "__dict__") and not callable(obj):
            for key, item in vars(obj).items():
                if key != "ops":
                    visit(item, key, depth + 1)
    visit(network.weights, "weights", 0)         # the table first: its storages are not derived
    visit(network, "network", 0)
    return storages, derived


@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 1), (2, 2)])
@pytest.mark.parametrize("expert_format", ["mxfp4", "bf16"])
def test_per_gpu_weights_equal_what_a_rank_network_holds(tp, ep, expert_format):
    """Sizing counts what the built network holds: every tensor once (fused projections share the table's
    storage, the float32 router replaces the bf16 one), sharded by the plan, nothing but DERIVED besides."""
    from k3core.backend import OpSpec, select_ops
    from k3core.llm import _own_storage
    from k3core.model.network import Network
    # 64 expert columns: 32 per rank under tp=2, one whole MXFP4 scale group each
    config = ModelConfig.preset("k3-tiny").replace(expert_format=expert_format, moe_intermediate_size=64)
    weights = init_random_weights(config, seed=1, dtype=torch.bfloat16)
    local = shard_model(config, weights, ParallelPlan(tp=tp, ep=ep), rank=tp - 1)
    table = {name: _own_storage(t) for name, t in local.weights.items()}
    ops = select_ops("torch", OpSpec(local.config, torch.bfloat16, torch.device("cpu")))
    network = Network(local.config, table, ops, None, local.layer_ids, local.expert_offset)
    storages, derived = held_storages(network)
    assert per_gpu_weights(config, tp=tp, ep=ep).total == sum(storages.values()) - derived
    kda = [layer.mixer for layer in network.layers if hasattr(layer.mixer, "conv_weight")]
    assert network.padding_bytes > 0 and all(mixer.w_x.shape[0] % 128 == 0 for mixer in kda)
    assert all(not mixer.w_x[sum(mixer.x_rows):].any() for mixer in kda)                   # zero rows
    assert sum(t.numel() * t.element_size() for t in network.weights.values()) == \
        sum(storages.values()) - derived - network.padding_bytes
    packed = [t for name, t in network.weights.items() if ".mlp.experts." in name]
    assert all(t.dtype == (torch.uint8 if expert_format == "mxfp4" else torch.bfloat16) for t in packed)
    assert network.layers[0].mixer.w_x.untyped_storage().data_ptr() == \
        network.weights["model.layers.0.self_attn.q_proj.weight"].untyped_storage().data_ptr()


def test_a_second_network_on_the_same_table_shares_its_fused_tensors():
    """The correctness gates build more networks on a model's table: they must not copy the fused projections."""
    from k3core.backend import OpSpec, select_ops
    from k3core.model.network import Network
    config = ModelConfig.preset("k3-tiny")
    weights = init_random_weights(config, seed=1, dtype=torch.bfloat16)
    ops = select_ops("torch", OpSpec(config, torch.bfloat16, torch.device("cpu")))
    first = Network(config, weights, ops)
    table = {name: t.untyped_storage().data_ptr() for name, t in weights.items()}
    second = Network(config, weights, ops)
    assert {name: t.untyped_storage().data_ptr() for name, t in weights.items()} == table
    for a, b in zip(first.layers, second.layers):
        held = [getattr(a.mlp, "shared", a.mlp).w_gate_up, getattr(b.mlp, "shared", b.mlp).w_gate_up,
                a.mixer.w_x, b.mixer.w_x]
        if hasattr(a.mixer, "conv_weight"):
            held += [a.mixer.conv_weight, b.mixer.conv_weight]
        if hasattr(a.mlp, "w_router"):
            held += [a.mlp.w_router, b.mlp.w_router, a.mlp.w_x, b.mlp.w_x]
        assert all(t.untyped_storage().data_ptr() in table.values() for t in held)
        assert held[0].data_ptr() == held[1].data_ptr()


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

"""The model holds MXFP4 routed experts packed: a K3-format MXFP4 checkpoint loads its bytes as they are, and its
logits match the same checkpoint with the experts dequantised to dense weights; a preset or bf16 checkpoint can
be held as MXFP4 (quantised at load)."""
from __future__ import annotations

import math

import pytest
import torch

from k3core import LLM
from k3core.config import ModelConfig
from k3core.model.checkpoint_writer import save_k3_checkpoint
from k3core.model.loader import load_checkpoint
from k3core.model.mxfp4 import quantize_mxfp4
from k3core.model.weights import init_random_weights
from k3core.sizing import weight_bytes

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2]
# Both sides compute in float32 from the same (exactly dequantised) weights; they differ only in where the
# dequantisation happens, and in the order of float32 sums of the expert GEMMs: ~1e-6 of the largest logit.
LOGIT_RTOL = 1e-5


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    config = ModelConfig.preset("k3-tiny")
    directory = tmp_path_factory.mktemp("k3_mxfp4")
    held = save_k3_checkpoint(init_random_weights(config, seed=31), config, directory, mxfp4_experts=True,
                              num_shards=2)
    return config, directory, held


def _expert_names(weights: dict[str, torch.Tensor]) -> list[str]:
    return [name for name in weights if ".mlp.experts." in name]


def test_mxfp4_checkpoint_loads_packed_bytes(mxfp4_checkpoint):
    config, directory, _ = mxfp4_checkpoint
    llm = LLM(str(directory), backend="torch", device="cpu", dtype="float32")
    assert llm.config.expert_format == "mxfp4"
    E, inner, width = config.num_experts, config.moe_intermediate_size, config.expert_width
    want = {"w13_packed": E * 2 * inner * width // 2, "w13_scale": E * 2 * inner * width // 32,
            "w2_packed": E * width * inner // 2, "w2_scale": E * width * inner // 32}
    names = _expert_names(llm.weights)
    assert names and all(name.rpartition(".")[2] in want for name in names)        # no dense expert anywhere
    for name in names:
        tensor = llm.weights[name]
        assert tensor.dtype == torch.uint8 and tensor.numel() == want[name.rpartition(".")[2]], name
    moe_layers = config.mlp_types.count("moe")
    packed_bytes = sum(llm.weights[n].numel() for n in names)
    assert packed_bytes == moe_layers * sum(want.values())
    # what the sizing tool reports is what the engine holds
    assert weight_bytes(llm.config, dtype="fp32") == \
        sum(t.numel() * t.element_size() for t in llm.weights.values()) + llm.network.padding_bytes
    # the stored bytes are loaded unchanged
    from safetensors import safe_open
    stored = {}
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            stored.update({k: handle.get_tensor(k) for k in handle.keys() if ".experts.3.w3." in k and ".layers.2." in k})
    loaded = llm.weights["model.layers.2.mlp.experts.w13_packed"][3, inner:]
    assert torch.equal(loaded, stored["language_model.model.layers.2.block_sparse_moe.experts.3.w3.weight_packed"])


def test_mxfp4_logits_match_the_dequantised_model(mxfp4_checkpoint):
    _, directory, _ = mxfp4_checkpoint
    packed = LLM(str(directory), backend="torch", device="cpu", dtype="float32")
    dense = LLM(str(directory), backend="torch", device="cpu", dtype="float32", expert_format="bf16")
    assert dense.config.expert_format == "bf16" and dense.weights["model.layers.1.mlp.experts.w13"].dtype == torch.float32
    got, want = packed.prompt_logits(PROMPT), dense.prompt_logits(PROMPT)
    error = (got - want).abs().max().item() / want.abs().max().item()
    assert error <= LOGIT_RTOL, f"relative max logit error {error:.2e}"
    # and greedy decoding through the engine (prefill + decode steps) agrees
    from k3core import SamplingParams
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert packed.generate([PROMPT], params)[0].token_ids == dense.generate([PROMPT], params)[0].token_ids


def test_bf16_checkpoint_and_preset_quantised_at_load(tmp_path):
    config = ModelConfig.preset("k3-tiny")
    weights = init_random_weights(config, seed=32)
    save_k3_checkpoint(weights, config, tmp_path, mxfp4_experts=False)
    loaded = load_checkpoint(tmp_path, config.replace(expert_format="mxfp4"), dtype=torch.float32)
    packed, scale = quantize_mxfp4(weights["model.layers.1.mlp.experts.w2"])
    assert torch.equal(loaded["model.layers.1.mlp.experts.w2_packed"], packed)
    assert torch.equal(loaded["model.layers.1.mlp.experts.w2_scale"], scale)
    # a preset with expert_format="mxfp4": the bf16 preset's draws, quantised
    preset = LLM("k3-tiny", backend="torch", device="cpu", dtype="float32", expert_format="mxfp4", seed=32)
    assert preset.weights["model.layers.1.mlp.experts.w2_packed"].dtype == torch.uint8
    assert torch.equal(preset.weights["model.layers.1.mlp.experts.w2_packed"], packed)
    assert not any(name.endswith((".w13", ".w2")) for name in preset.weights)
    assert math.isfinite(preset.prompt_logits(PROMPT).abs().max().item())

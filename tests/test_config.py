"""ModelConfig presets, the K3 layer schedule, validation errors, and Hugging Face config.json parsing.

The K3 config dict is written by hand from K3_ARCHITECTURE.md §1 (the published config.json); the Kimi-Linear
dicts come from transformers' own KimiLinearConfig (what `save_pretrained` writes) and from the original release's
field spelling (§8). Both must give the same ModelConfig as the matching preset.
"""
from __future__ import annotations

import copy
import json

import pytest

from k3core.config import ConfigError, ModelConfig, list_presets, load_config
from k3core.hf_config import k3_config_dict, parse_hf_config
from k3core.model.weights import count_parameters, expected_tensors

K3_MLA_LAYERS = [3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47, 51, 55, 59, 63, 67, 71, 75, 79, 83, 87, 91, 92]
KIMI_LINEAR_FULL_ATTN_1_BASED = [4, 8, 12, 16, 20, 24, 27]


def _same_model(a: ModelConfig, b: ModelConfig) -> bool:
    return a.replace(name="x") == b.replace(name="x")


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_loads_and_has_a_weight_table(name):
    config = ModelConfig.preset(name)
    assert config.name == name and load_config(name) == config
    specs = expected_tensors(config)
    assert all(all(d > 0 for d in spec.shape) for spec in specs.values())
    count = count_parameters(config)
    assert 0 < count.active <= count.total


def test_presets_cover_the_four_models():
    assert {"k3", "k3-mini", "k3-tiny", "kimi-linear-48b"} <= set(list_presets())
    with pytest.raises(ConfigError, match="unknown preset 'k4'; choose one of"):
        ModelConfig.preset("k4")


def test_k3_layer_schedule():
    config = ModelConfig.preset("k3")
    assert config.mla_layer_ids == K3_MLA_LAYERS
    assert len(config.kda_layer_ids) == 69
    assert config.mlp_types[0] == "dense" and config.mlp_types[1:] == ("moe",) * 92
    assert config.num_attn_res_blocks == 8


@pytest.mark.parametrize("field, value", [
    ("hidden_size", 0), ("layer_types", ("kda",) * 3), ("activation", "gelu"), ("num_experts_per_token", 99),
    ("kda_gate_lower_bound", 1.0), ("moe_latent_size", -4),
])
def test_invalid_model_config_names_the_field(field, value):
    base = ModelConfig.preset("k3-tiny").to_dict()
    base[field] = value
    with pytest.raises(ConfigError, match=f"`{field}`"):
        ModelConfig.from_dict(base)


def test_unknown_yaml_field_is_named():
    data = ModelConfig.preset("k3-tiny").to_dict()
    data["num_heads"] = 4
    with pytest.raises(ConfigError, match="`num_heads`: unknown field"):
        ModelConfig.from_dict(data)


# ---- Hugging Face configs -------------------------------------------------------------------------------------

def _k3_published() -> dict:
    """K3's config.json as published (K3_ARCHITECTURE.md §1), written by hand."""
    full = [i + 1 for i in K3_MLA_LAYERS]
    text = {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": 163840, "hidden_size": 7168, "num_hidden_layers": 93, "rms_norm_eps": 1e-5,
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "intermediate_size": 33792, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2, "moe_intermediate_size": 3072,
        "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True, "moe_router_activation_func": "sigmoid",
        "topk_method": "noaux_tc", "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
        "moe_renormalize": True, "routed_scaling_factor": 1.0,
        "num_attention_heads": 96, "num_key_value_heads": 96, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
        "mla_use_output_gate": True, "max_position_embeddings": 1048576, "attn_res_block_size": 12,
        "num_nextn_predict_layers": 0, "tie_word_embeddings": False,
        "linear_attn_config": {"num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                               "use_full_rank_gate": True, "full_attn_layers": full,
                               "kda_layers": [i for i in range(1, 94) if i not in full]},
        "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"},
    }
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "bos_token_id": 163584,
            "eos_token_id": 163586, "pad_token_id": 163839, "media_placeholder_token_id": 163605,
            "tie_word_embeddings": False, "dtype": "bfloat16", "text_config": text,
            "vision_config": {"model_type": "moonvit3d"}}


def test_k3_published_config_matches_the_preset():
    config = parse_hf_config(_k3_published(), name="k3")
    assert config == ModelConfig.preset("k3")
    assert config.mla_layer_ids == K3_MLA_LAYERS
    assert config.kda_gate == "lower_bound" and config.kda_output_gate == "full_rank"
    assert config.extra["hf_model_type"] == "kimi_k3"
    assert "mxfp4" in json.dumps(config.extra["quantization_config"])


def _kimi_linear_release() -> dict:
    """The original Kimi-Linear release's spelling (K3_ARCHITECTURE.md §8)."""
    full = KIMI_LINEAR_FULL_ATTN_1_BASED
    return {
        "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 2304, "num_hidden_layers": 27,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 163584, "eos_token_id": 163586,
        "pad_token_id": 163839, "hidden_act": "silu", "intermediate_size": 9216, "first_k_dense_replace": 1,
        "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1, "moe_intermediate_size": 1024,
        "moe_router_activation_func": "sigmoid", "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
        "moe_renormalize": True, "routed_scaling_factor": 2.446, "num_attention_heads": 32,
        "num_key_value_heads": 32, "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True, "head_dim": 72,
        "linear_attn_config": {"num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4,
                               "full_attn_layers": full, "kda_layers": [i for i in range(1, 28) if i not in full]},
    }


def test_kimi_linear_release_config_matches_the_preset():
    config = parse_hf_config(_kimi_linear_release())
    assert _same_model(config, ModelConfig.preset("kimi-linear-48b"))
    assert config.mla_layer_ids == [3, 7, 11, 15, 19, 23, 26]
    assert config.kda_gate == "softplus" and config.kda_output_gate == "low_rank" and not config.attn_res


def _transformers_dict(**kwargs) -> dict:
    transformers = pytest.importorskip("transformers")
    full = KIMI_LINEAR_FULL_ATTN_1_BASED
    linear = {"num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4, "full_attn_layers": full,
              "kda_layers": [i for i in range(1, 28) if i not in full]}
    return transformers.KimiLinearConfig(linear_attn_config=linear, **kwargs).to_dict()


def test_transformers_saved_config_matches_the_preset():
    data = _transformers_dict()
    assert "layer_types" in data and "mlp_layer_types" in data
    assert _same_model(parse_hf_config(data), ModelConfig.preset("kimi-linear-48b"))
    # the flat spelling alone (what a save_pretrained of a model built from flat fields writes)
    data.pop("linear_attn_config")
    assert _same_model(parse_hf_config(data), ModelConfig.preset("kimi-linear-48b"))


def test_head_dim_trap():
    # transformers writes head_dim = qk_rope_head_dim; it is neither the KDA head size nor the MLA q/k head size
    transformers = pytest.importorskip("transformers")
    kinds = ["full_attention" if i + 1 in KIMI_LINEAR_FULL_ATTN_1_BASED else "linear_attention" for i in range(27)]
    data = transformers.KimiLinearConfig(linear_head_dim=32, qk_rope_head_dim=16, layer_types=kinds).to_dict()
    assert data["head_dim"] == 16 and "linear_attn_config" not in data
    config = parse_hf_config(data)
    assert config.kda_head_dim == 32 and config.qk_head_dim == 128 + 16
    data["head_dim"] = 999
    assert parse_hf_config(data) == config


def test_small_transformers_config_from_disk(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.KimiLinearConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=5, num_attention_heads=2, num_key_value_heads=2,
        linear_num_heads=2, linear_head_dim=16, num_experts=4, num_experts_per_token=2, moe_intermediate_size=32,
        intermediate_size=96, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"],
        mlp_layer_types=["dense", "dense", "sparse", "sparse", "sparse"], eos_token_id=[257, 259],
        bos_token_id=256, pad_token_id=258)
    hf.save_pretrained(tmp_path)
    config = ModelConfig.from_hf(tmp_path)
    assert config.layer_types == ("kda", "mla", "kda", "kda", "mla")
    assert config.mlp_types == ("dense", "dense", "moe", "moe", "moe")
    assert (config.kda_num_heads, config.kda_head_dim, config.num_experts) == (2, 16, 4)
    assert config.eos_token_id == 257 and config.extra["eos_token_ids"] == [257, 259]
    assert config.router_correction_bias and config.routed_scaling_factor == pytest.approx(2.446)


def _edit(data: dict, path: str, value) -> dict:
    data = copy.deepcopy(data)
    node = data
    keys = path.split(".")
    for key in keys[:-1]:
        node = node[key]
    if value is _DELETE:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return data


_DELETE = object()


@pytest.mark.parametrize("path, value, field", [
    ("model_type", "llama", "model_type"),
    ("text_config", _DELETE, "text_config"),
    ("text_config.num_hidden_layers", _DELETE, "num_hidden_layers"),
    ("text_config.num_expert_group", 5, "num_expert_group"),      # does not divide the 896 experts
    ("text_config.topk_group", 2, "topk_group"),                  # more groups to keep than the one there is
    ("text_config.hidden_act", "gelu", "hidden_act"),
    ("text_config.num_key_value_heads", 8, "num_key_value_heads"),
    ("text_config.mla_use_nope", False, "mla_use_nope"),
    ("text_config.moe_router_activation_func", "relu", "moe_router_activation_func"),
    ("text_config.linear_attn_config.kda_layers", [0, 1, 2], "linear_attn_config.kda_layers"),
    ("text_config.linear_attn_config.full_attn_layers", [1, 4], "linear_attn_config.full_attn_layers"),
    ("text_config.linear_attn_config.full_attn_layers", [4, 8], "linear_attn_config.kda_layers"),
    ("text_config.linear_attn_config.gate_lower_bound", 2.0, "kda_gate_lower_bound"),
    ("text_config.vocab_size", "big", "vocab_size"),
])
def test_invalid_hf_config_names_the_field(path, value, field):
    with pytest.raises(ConfigError, match=f"`{field}`"):
        parse_hf_config(_edit(_k3_published(), path, value))


def test_invalid_transformers_layer_lists_name_the_field():
    data = _transformers_dict()
    with pytest.raises(ConfigError, match="`layer_types`"):
        parse_hf_config(_edit(data, "layer_types", ["linear_attention"] * 3))
    with pytest.raises(ConfigError, match="`mlp_layer_types`"):
        parse_hf_config(_edit(data, "mlp_layer_types", ["dense"] + ["expert"] * 26))


@pytest.mark.parametrize("name", list_presets())
def test_k3_config_dict_round_trips(name):
    config = ModelConfig.preset(name)
    assert parse_hf_config(json.loads(json.dumps(k3_config_dict(config))), name=name) == config

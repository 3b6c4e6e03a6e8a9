"""Hugging Face `config.json` <-> ModelConfig.

Two layouts reach k3core:

* `model_type: kimi_linear`, flat. Either as transformers 5.x `save_pretrained` writes it (`layer_types`,
  `mlp_layer_types`, `linear_num_heads`, `linear_head_dim`, `linear_conv_kernel_dim`, `num_experts`, ...) or as the
  original release wrote it (`linear_attn_config` with 1-based `kda_layers`/`full_attn_layers`,
  `first_k_dense_replace`, `num_experts_per_token`, ...).
* `model_type: kimi_k3`: the multimodal wrapper; the language model is a Kimi-Linear config under `text_config`
  with K3 additions (SiTU activation, LatentMoE, AttnRes, gated MLA, the lower-bounded "safe" KDA gate).

Trap: transformers writes a top-level `head_dim` equal to `qk_rope_head_dim`. It is neither the KDA head size
(`linear_head_dim` / `linear_attn_config.head_dim`) nor the MLA q/k head size (nope + rope), so it is ignored.

`k3_config_dict` is the inverse for K3: the `config.json` that K3 publishes, used by the checkpoint writer.
"""
from __future__ import annotations

from typing import Any

from k3core.config import ConfigError, ModelConfig

SUPPORTED_MODEL_TYPES = ("kimi_linear", "kimi_k3")

# transformers' defaults for a Kimi-Linear config (KimiLinearConfig), used when a field is absent so that k3core
# builds the same network transformers would build from the same file.
_KDA_DEFAULTS = {"num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4}
_LAYER_KINDS = {"linear_attention": "kda", "full_attention": "mla"}
MXFP4_FORMAT = "mxfp4-pack-quantized"
_MLP_KINDS = {"dense": "dense", "sparse": "moe", "moe": "moe"}

# Sane bounds of the size fields (inclusive), far above any Kimi model (K3: hidden 7168, 61 layers, 384 experts),
# so that a corrupt or hostile config.json is refused by name before shapes are derived from it.
_BOUNDS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 23), "hidden_size": (1, 1 << 17), "num_hidden_layers": (1, 1024),
    "intermediate_size": (0, 1 << 20), "max_position_embeddings": (1, 1 << 31),
    "bos_token_id": (0, 1 << 23), "pad_token_id": (0, 1 << 23),
    "num_attention_heads": (1, 1024), "num_key_value_heads": (1, 1024), "q_lora_rank": (1, 1 << 16),
    "kv_lora_rank": (1, 1 << 16), "qk_nope_head_dim": (1, 4096), "qk_rope_head_dim": (0, 4096),
    "v_head_dim": (1, 4096), "num_experts": (0, 1 << 14), "num_experts_per_token": (0, 1024),
    "moe_intermediate_size": (0, 1 << 20), "num_shared_experts": (0, 64), "routed_expert_hidden_size": (1, 1 << 17),
    "num_expert_group": (1, 1 << 14), "topk_group": (1, 1 << 14), "first_k_dense_replace": (0, 1024),
    "moe_layer_freq": (1, 1024), "attn_res_block_size": (1, 1024), "num_nextn_predict_layers": (0, 64),
    "linear_attn_config.num_heads": (1, 1024), "linear_attn_config.head_dim": (1, 4096),
    "linear_attn_config.short_conv_kernel_size": (1, 64),
}


def _bounded(field: str, value: int) -> int:
    low, high = _BOUNDS.get(field, (None, None))
    if low is not None and not low <= value <= high:
        raise _fail(field, f"is {value}, outside the sane range {low}..{high}")
    return value


def _float(text: dict[str, Any], name: str, default: float | None) -> float | None:
    value = text.get(name)
    if value is None:
        value = default
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
        raise _fail(name, f"must be a finite number, got {value!r}")
    return float(value)


def _fail(field: str, why: str) -> ConfigError:
    return ConfigError(f"invalid Hugging Face config field `{field}`: {why}")


def _first(data: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The value of the first of `names` present (and not None) in `data`: configs spell some fields two ways."""
    for name in names:
        if data.get(name) is not None:
            return data[name]
    return default


def parse_hf_config(data: dict[str, Any], name: str = "custom") -> ModelConfig:
    """Map a Kimi-Linear or Kimi-K3 `config.json` (already parsed) to a ModelConfig; ConfigError names a bad field."""
    if not isinstance(data, dict):
        raise ConfigError("a Hugging Face config must be a JSON object")
    model_type = data.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _fail("model_type", f"got {model_type!r}; k3core reads {', '.join(SUPPORTED_MODEL_TYPES)}")
    if model_type == "kimi_k3":
        text = data.get("text_config")
        if not isinstance(text, dict):
            raise _fail("text_config", "a kimi_k3 config must hold the language model config as an object")
        # the wrapper carries the token ids and tie flag; the text config wins where both have a value
        merged = {k: data[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")
                  if k in data}
        merged.update({k: v for k, v in text.items() if v is not None})
        text = merged
    else:
        text = data
    fields = _parse_text(text)
    fields["name"] = name
    quantization = text.get("quantization_config") or data.get("quantization_config")
    fields["expert_format"] = "mxfp4" if is_mxfp4_quantization(quantization) else "bf16"
    fields["extra"] = {"hf_model_type": model_type, "quantization_config": quantization,
                       "eos_token_ids": _as_id_list(text.get("eos_token_id")),
                       "num_nextn_predict_layers": _int(text, "num_nextn_predict_layers", default=0)}
    try:
        return ModelConfig(**fields)
    except TypeError as exc:  # a field of the wrong type that validate() cannot even compare
        raise ConfigError(f"invalid Hugging Face config: {exc}") from None


def is_mxfp4_quantization(quantization: Any) -> bool:
    """Whether a `quantization_config` says compressed-tensors `mxfp4-pack-quantized` (K3's routed experts)."""
    if not isinstance(quantization, dict):
        return False
    groups = quantization.get("config_groups") or {}
    formats = [quantization.get("format")] + [g.get("format") for g in groups.values() if isinstance(g, dict)]
    return MXFP4_FORMAT in formats


def mxfp4_quantization_config() -> dict[str, Any]:
    """The `quantization_config` of a checkpoint whose routed experts are MXFP4, in the published K3's layout:
    compressed-tensors, 4-bit float weights in groups of 32 with uint8 (E8M0) scales, no activation quantisation,
    everything but the routed experts ignored."""
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 32, "strategy": "group",
               "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax",
               "observer_kwargs": {}, "scale_dtype": "torch.uint8", "zp_dtype": None}
    return {"quant_method": "compressed-tensors", "format": MXFP4_FORMAT, "quantization_status": "compressed",
            "config_groups": {"group_0": {"format": MXFP4_FORMAT, "targets": ["Linear"], "weights": weights,
                                          "input_activations": None, "output_activations": None}},
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                       "lm_head", "re:vision_tower.*", "re:mm_projector.*"],
            "kv_cache_scheme": None, "global_compression_ratio": None}


def _as_id_list(value: Any, field: str = "eos_token_id") -> list[int]:
    if value is None:
        return []
    ids = list(value) if isinstance(value, (list, tuple)) else [value]
    for v in ids:
        if isinstance(v, bool) or not isinstance(v, int):
            raise _fail(field, f"must be an integer or a list of integers, got {value!r}")
        _bounded("bos_token_id", v)
    return ids


def _int(text: dict[str, Any], *names: str, default: Any = None, required: bool = False) -> Any:
    value = _first(text, *names, default=default)
    if value is None:
        if required:
            raise _fail(names[0], "is missing")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(names[0], f"must be an integer, got {value!r}")
    return _bounded(names[0], value)


def _parse_text(text: dict[str, Any]) -> dict[str, Any]:
    num_layers = _int(text, "num_hidden_layers", required=True)
    if num_layers <= 0:
        raise _fail("num_hidden_layers", "must be a positive integer")
    linear = text.get("linear_attn_config") or {}
    if not isinstance(linear, dict):
        raise _fail("linear_attn_config", "must be an object")

    eos = _as_id_list(text.get("eos_token_id"))
    out: dict[str, Any] = {
        "vocab_size": _int(text, "vocab_size", required=True),
        "hidden_size": _int(text, "hidden_size", required=True),
        "num_layers": num_layers,
        "layer_types": _layer_types(text, linear, num_layers),
        "mlp_types": _mlp_types(text, num_layers),
        "rms_norm_eps": _float(text, "rms_norm_eps", 1e-5),
        "tie_word_embeddings": bool(text.get("tie_word_embeddings", False)),
        "max_position_embeddings": _int(text, "max_position_embeddings", "model_max_length", default=1 << 20),
        "bos_token_id": _int(text, "bos_token_id"),
        "eos_token_id": eos[0] if eos else None,
        "pad_token_id": _int(text, "pad_token_id"),
        "intermediate_size": _int(text, "intermediate_size", default=0),
    }
    out.update(_activation(text))
    out.update(_kda(text, linear))
    out.update(_mla(text))
    out.update(_moe(text))
    block = text.get("attn_res_block_size")
    out["attn_res"] = block is not None
    if block is not None:
        out["attn_res_block_size"] = _int(text, "attn_res_block_size")
    return out


def _layer_types(text: dict[str, Any], linear: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    if text.get("layer_types") is not None:
        kinds = text["layer_types"]
        if not isinstance(kinds, list):
            raise _fail("layer_types", f"must be a list, got {kinds!r}")
        if len(kinds) != num_layers:
            raise _fail("layer_types", f"has {len(kinds)} entries but num_hidden_layers is {num_layers}")
        bad = [k for k in kinds if k not in _LAYER_KINDS]
        if bad:
            raise _fail("layer_types", f"entry {bad[0]!r} is not one of {', '.join(_LAYER_KINDS)}")
        return tuple(_LAYER_KINDS[k] for k in kinds)
    if "kda_layers" not in linear or "full_attn_layers" not in linear:
        raise _fail("linear_attn_config.kda_layers",
                    "the config needs `layer_types` or linear_attn_config.kda_layers and full_attn_layers")
    kinds: list[str | None] = [None] * num_layers
    for field, kind in (("kda_layers", "kda"), ("full_attn_layers", "mla")):
        if not isinstance(linear[field], list):
            raise _fail(f"linear_attn_config.{field}", f"must be a list, got {linear[field]!r}")
        for layer in linear[field]:
            # the released configs number layers from 1
            if not isinstance(layer, int) or not 1 <= layer <= num_layers:
                raise _fail(f"linear_attn_config.{field}", f"entry {layer!r} is not a 1-based layer in 1..{num_layers}")
            if kinds[layer - 1] is not None:
                raise _fail(f"linear_attn_config.{field}", f"layer {layer} is listed twice")
            kinds[layer - 1] = kind
    if None in kinds:
        missing = kinds.index(None) + 1
        raise _fail("linear_attn_config.kda_layers",
                    f"1-based layer {missing} is in neither kda_layers nor full_attn_layers")
    return tuple(kinds)  # type: ignore[arg-type]


def _mlp_types(text: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    if text.get("mlp_layer_types") is not None:
        kinds = text["mlp_layer_types"]
        if not isinstance(kinds, list):
            raise _fail("mlp_layer_types", f"must be a list, got {kinds!r}")
        if len(kinds) != num_layers:
            raise _fail("mlp_layer_types", f"has {len(kinds)} entries but num_hidden_layers is {num_layers}")
        bad = [k for k in kinds if k not in _MLP_KINDS]
        if bad:
            raise _fail("mlp_layer_types", f"entry {bad[0]!r} is not 'dense' or 'sparse'")
        return tuple(_MLP_KINDS[k] for k in kinds)
    first_dense = _int(text, "first_k_dense_replace", default=1)  # transformers' default
    frequency = _int(text, "moe_layer_freq", default=1)
    if frequency <= 0:
        raise _fail("moe_layer_freq", "must be a positive integer")
    return tuple("moe" if i >= first_dense and i % frequency == 0 else "dense" for i in range(num_layers))


def _activation(text: dict[str, Any]) -> dict[str, Any]:
    act = text.get("hidden_act", "silu")
    if act not in ("silu", "situ"):
        raise _fail("hidden_act", f"got {act!r}; k3core supports 'silu' (SwiGLU) and 'situ' (SiTU-GLU)")
    out: dict[str, Any] = {"activation": act}
    if act == "situ":
        out["situ_beta"] = _float(text, "activation_situ_beta", 1.0)  # HF default when unset
        out["situ_linear_beta"] = _float(text, "activation_situ_linear_beta", None)
    return out


def _kda(text: dict[str, Any], linear: dict[str, Any]) -> dict[str, Any]:
    def pick(inner: str, flat: str) -> int:
        value = linear.get(inner, text.get(flat, _KDA_DEFAULTS[inner]))
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(f"linear_attn_config.{inner}", f"must be an integer, got {value!r}")
        return _bounded(f"linear_attn_config.{inner}", value)

    lower = linear.get("gate_lower_bound")
    return {
        "kda_num_heads": pick("num_heads", "linear_num_heads"),
        "kda_head_dim": pick("head_dim", "linear_head_dim"),
        "conv_kernel_size": pick("short_conv_kernel_size", "linear_conv_kernel_dim"),
        "kda_gate": "softplus" if lower is None else "lower_bound",
        "kda_gate_lower_bound": -5.0 if lower is None else _float(linear, "gate_lower_bound", None),
        "kda_output_gate": "full_rank" if linear.get("use_full_rank_gate") else "low_rank",
    }


def _mla(text: dict[str, Any]) -> dict[str, Any]:
    heads = _int(text, "num_attention_heads", default=32)
    kv_heads = _int(text, "num_key_value_heads")
    if kv_heads is not None and kv_heads != heads:
        raise _fail("num_key_value_heads", f"is {kv_heads} but MLA expands its latent to one key/value per query head "
                    f"({heads}); set it equal to num_attention_heads")
    if text.get("mla_use_nope") is False:
        raise _fail("mla_use_nope", "is false but k3core implements the NoPE MLA of the Kimi family only")
    return {
        "mla_num_heads": heads,
        "q_lora_rank": _int(text, "q_lora_rank"),
        "kv_lora_rank": _int(text, "kv_lora_rank", default=512),
        "qk_nope_head_dim": _int(text, "qk_nope_head_dim", default=128),
        "qk_rope_head_dim": _int(text, "qk_rope_head_dim", default=64),
        "v_head_dim": _int(text, "v_head_dim", default=128),
        "mla_output_gate": bool(text.get("mla_use_output_gate", False)),
    }


def _moe(text: dict[str, Any]) -> dict[str, Any]:
    # transformers' Kimi-Linear router always runs the grouped top-k, whatever `use_grouped_topk` says
    groups = _int(text, "num_expert_group", "n_group", default=1)
    topk_group = _int(text, "topk_group", default=1)
    scoring = text.get("moe_router_activation_func", "sigmoid")
    if scoring not in ("sigmoid", "softmax"):
        raise _fail("moe_router_activation_func", f"got {scoring!r}; expected 'sigmoid' or 'softmax'")
    # transformers' Kimi-Linear router always carries e_score_correction_bias; a config that names another
    # topk_method than noaux_tc has none
    method = text.get("topk_method")
    latent = _int(text, "routed_expert_hidden_size")
    return {
        "num_experts": _int(text, "num_experts", "num_local_experts", "n_routed_experts", default=0),
        "num_experts_per_token": _int(text, "num_experts_per_token", "num_experts_per_tok", default=0),
        "moe_intermediate_size": _int(text, "moe_intermediate_size", default=0),
        "num_shared_experts": _int(text, "num_shared_experts", "n_shared_experts", default=0),
        "router_scoring": scoring,
        "router_correction_bias": method is None or method == "noaux_tc",
        "moe_renormalize": bool(_first(text, "moe_renormalize", "norm_topk_prob", default=True)),
        "routed_scaling_factor": _float(text, "routed_scaling_factor", 1.0),
        "moe_latent_size": latent,
        "moe_latent_norm": bool(text.get("latent_moe_use_norm", False)),
        "num_expert_group": groups,
        "topk_group": topk_group,
    }


def k3_config_dict(config: ModelConfig) -> dict[str, Any]:
    """The `config.json` of a K3-format checkpoint for `config` (the layout K3 publishes: §1 of K3_ARCHITECTURE.md)."""
    if config.attn_res and config.attn_res_block_size <= 0:
        raise ConfigError("invalid config field `attn_res_block_size`: must be positive")
    text: dict[str, Any] = {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "rms_norm_eps": config.rms_norm_eps,
        "hidden_act": config.activation,
        "intermediate_size": config.intermediate_size,
        "first_k_dense_replace": _leading_dense(config),
        "moe_layer_freq": 1,
        "num_experts": config.num_experts,
        "num_experts_per_token": config.num_experts_per_token,
        "num_shared_experts": config.num_shared_experts,
        "moe_intermediate_size": config.moe_intermediate_size,
        "moe_router_activation_func": config.router_scoring,
        "topk_method": "noaux_tc" if config.router_correction_bias else "greedy",
        "use_grouped_topk": True,
        "num_expert_group": config.num_expert_group,
        "topk_group": config.topk_group,
        "moe_renormalize": config.moe_renormalize,
        "routed_scaling_factor": config.routed_scaling_factor,
        "num_attention_heads": config.mla_num_heads,
        "num_key_value_heads": config.mla_num_heads,
        "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        "mla_use_nope": True,
        "mla_use_output_gate": config.mla_output_gate,
        "max_position_embeddings": config.max_position_embeddings,
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": config.tie_word_embeddings,
        "linear_attn_config": {
            "num_heads": config.kda_num_heads,
            "head_dim": config.kda_head_dim,
            "short_conv_kernel_size": config.conv_kernel_size,
            "use_full_rank_gate": config.kda_output_gate == "full_rank",
            "kda_layers": [i + 1 for i in config.kda_layer_ids],          # 1-based, as released
            "full_attn_layers": [i + 1 for i in config.mla_layer_ids],
        },
    }
    if config.kda_gate == "lower_bound":
        text["linear_attn_config"]["gate_lower_bound"] = config.kda_gate_lower_bound
    if config.activation == "situ":
        text["activation_situ_beta"] = config.situ_beta
        text["activation_situ_linear_beta"] = config.situ_linear_beta
    if config.moe_latent_size is not None:
        text["routed_expert_hidden_size"] = config.moe_latent_size
        text["latent_moe_use_norm"] = config.moe_latent_norm
    if config.attn_res:
        text["attn_res_block_size"] = config.attn_res_block_size
    if config.expert_format == "mxfp4":
        text["quantization_config"] = mxfp4_quantization_config()
    ids = {k: getattr(config, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], **ids,
            "tie_word_embeddings": config.tie_word_embeddings, "dtype": "bfloat16", "text_config": {**text, **ids}}


def _leading_dense(config: ModelConfig) -> int:
    """first_k_dense_replace for `config`; a pattern that is not "N dense layers, then MoE" has no K3 spelling."""
    count = 0
    while count < config.num_layers and config.mlp_types[count] == "dense":
        count += 1
    if any(kind == "dense" for kind in config.mlp_types[count:]) or "moe" not in config.mlp_types:
        raise ConfigError("invalid config field `mlp_types`: a K3 config.json can only say "
                          "`first_k_dense_replace` dense layers followed by MoE layers")
    return count

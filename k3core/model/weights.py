"""The canonical weight table: every tensor the network reads, by name, with its shape and storage class.

The network (`k3core/model/network.py`), the loader, the random initialiser, the checkpoint writer and the
parallel planner all key on these names, so a name exists here exactly once. Storage classes:
"weight" tensors take the model dtype; "fp32" tensors (short-conv weights, dt_bias, A_log, the router's
correction bias) stay float32 because the KDA gate, the conv and expert selection compute in float32.

Layouts worth knowing: `mlp.experts.w13` is [E, 2*I, De] with the gate (w1) rows first and the up (w3) rows
second (non-interleaved); `mlp.experts.w2` is [E, De, I]; De is `config.expert_width` (the LatentMoE width).
With `config.expert_format == "mxfp4"` the routed experts are held packed instead, as the checkpoint stores them
("uint8" tensors): `mlp.experts.w13_packed` [E, 2*I, De/2] + `mlp.experts.w13_scale` [E, 2*I, De/32] and
`mlp.experts.w2_packed` [E, De, I/2] + `mlp.experts.w2_scale` [E, De, I/32] (k3core.model.mxfp4).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from k3core.config import ModelConfig
from k3core.model.mxfp4 import quantize_mxfp4


class TensorSpec(NamedTuple):
    shape: tuple[int, ...]
    kind: str            # "weight" (model dtype), "fp32" (always float32) or "uint8" (MXFP4 codes and scales)


DENSE_EXPERT_FIELDS = ("w13", "w2")
MXFP4_EXPERT_FIELDS = ("w13_packed", "w13_scale", "w2_packed", "w2_scale")


def is_routed_expert(name: str) -> bool:
    """Whether a canonical name is a routed-expert tensor (dense or MXFP4), dimension 0 being the expert."""
    return name.rpartition(".mlp.experts.")[2] in DENSE_EXPERT_FIELDS + MXFP4_EXPERT_FIELDS


class ParamCount(NamedTuple):
    total: int
    active: int          # per token: top-k of the routed experts in each MoE layer, everything else in full


def layer_prefix(layer_id: int) -> str:
    return f"model.layers.{layer_id}."


def expected_tensors(config: ModelConfig) -> dict[str, TensorSpec]:
    """Canonical name -> TensorSpec for every tensor of `config`, globals first, then layer by layer."""
    H, V = config.hidden_size, config.vocab_size
    specs: dict[str, TensorSpec] = {"model.embed_tokens.weight": TensorSpec((V, H), "weight"),
                                    "model.norm.weight": TensorSpec((H,), "weight")}
    if not config.tie_word_embeddings:
        specs["lm_head.weight"] = TensorSpec((V, H), "weight")
    if config.attn_res:
        specs["model.output_attn_res_norm.weight"] = TensorSpec((H,), "weight")
        specs["model.output_attn_res_proj.weight"] = TensorSpec((1, H), "weight")
    for layer_id in range(config.num_layers):
        prefix = layer_prefix(layer_id)
        layer = {"input_layernorm.weight": TensorSpec((H,), "weight"),
                 "post_attention_layernorm.weight": TensorSpec((H,), "weight")}
        if config.attn_res:
            for site in ("self_attention_res", "mlp_res"):
                layer[f"{site}_norm.weight"] = TensorSpec((H,), "weight")
                layer[f"{site}_proj.weight"] = TensorSpec((1, H), "weight")
        if config.layer_types[layer_id] == "kda":
            layer.update(_kda_tensors(config))
        else:
            layer.update(_mla_tensors(config))
        layer.update(_dense_mlp_tensors(config) if config.mlp_types[layer_id] == "dense" else _moe_tensors(config))
        specs.update({prefix + name: spec for name, spec in layer.items()})
    return specs


def _kda_tensors(config: ModelConfig) -> dict[str, TensorSpec]:
    H, P = config.hidden_size, config.kda_proj_size
    heads, head_dim, kernel = config.kda_num_heads, config.kda_head_dim, config.conv_kernel_size
    out: dict[str, TensorSpec] = {}
    for part in "qkv":
        out[f"self_attn.{part}_proj.weight"] = TensorSpec((P, H), "weight")
        out[f"self_attn.{part}_conv1d.weight"] = TensorSpec((P, 1, kernel), "fp32")
    out.update({
        "self_attn.f_a_proj.weight": TensorSpec((head_dim, H), "weight"),
        "self_attn.f_b_proj.weight": TensorSpec((P, head_dim), "weight"),
        "self_attn.dt_bias": TensorSpec((P,), "fp32"),
        "self_attn.A_log": TensorSpec((heads,), "fp32"),
        "self_attn.b_proj.weight": TensorSpec((heads, H), "weight"),
    })
    if config.kda_output_gate == "full_rank":
        out["self_attn.g_proj.weight"] = TensorSpec((P, H), "weight")
    else:
        out["self_attn.g_a_proj.weight"] = TensorSpec((head_dim, H), "weight")
        out["self_attn.g_b_proj.weight"] = TensorSpec((P, head_dim), "weight")
    out["self_attn.o_norm.weight"] = TensorSpec((head_dim,), "weight")
    out["self_attn.o_proj.weight"] = TensorSpec((H, P), "weight")
    return out


def _mla_tensors(config: ModelConfig) -> dict[str, TensorSpec]:
    H, heads, rank = config.hidden_size, config.mla_num_heads, config.q_lora_rank
    q_rows = heads * config.qk_head_dim
    out: dict[str, TensorSpec] = {}
    if rank is not None:
        out["self_attn.q_a_proj.weight"] = TensorSpec((rank, H), "weight")
        out["self_attn.q_a_layernorm.weight"] = TensorSpec((rank,), "weight")
        out["self_attn.q_b_proj.weight"] = TensorSpec((q_rows, rank), "weight")
    else:
        out["self_attn.q_proj.weight"] = TensorSpec((q_rows, H), "weight")
    out.update({
        "self_attn.kv_a_proj_with_mqa.weight": TensorSpec((config.mla_latent_width, H), "weight"),
        "self_attn.kv_a_layernorm.weight": TensorSpec((config.kv_lora_rank,), "weight"),
        "self_attn.kv_b_proj.weight": TensorSpec((heads * (config.qk_nope_head_dim + config.v_head_dim),
                                                  config.kv_lora_rank), "weight"),
        "self_attn.o_proj.weight": TensorSpec((H, heads * config.v_head_dim), "weight"),
    })
    if config.mla_output_gate:
        out["self_attn.g_proj.weight"] = TensorSpec((heads * config.v_head_dim, H), "weight")
    return out


def _dense_mlp_tensors(config: ModelConfig) -> dict[str, TensorSpec]:
    H, inner = config.hidden_size, config.intermediate_size
    return {"mlp.gate_proj.weight": TensorSpec((inner, H), "weight"),
            "mlp.up_proj.weight": TensorSpec((inner, H), "weight"),
            "mlp.down_proj.weight": TensorSpec((H, inner), "weight")}


def _moe_tensors(config: ModelConfig) -> dict[str, TensorSpec]:
    H, E, inner, width = config.hidden_size, config.num_experts, config.moe_intermediate_size, config.expert_width
    out = {"mlp.gate.weight": TensorSpec((E, H), "weight")}
    if config.router_correction_bias:
        out["mlp.gate.e_score_correction_bias"] = TensorSpec((E,), "fp32")
    if config.expert_format == "mxfp4":
        out["mlp.experts.w13_packed"] = TensorSpec((E, 2 * inner, width // 2), "uint8")
        out["mlp.experts.w13_scale"] = TensorSpec((E, 2 * inner, width // 32), "uint8")
        out["mlp.experts.w2_packed"] = TensorSpec((E, width, inner // 2), "uint8")
        out["mlp.experts.w2_scale"] = TensorSpec((E, width, inner // 32), "uint8")
    else:
        out["mlp.experts.w13"] = TensorSpec((E, 2 * inner, width), "weight")
        out["mlp.experts.w2"] = TensorSpec((E, width, inner), "weight")
    if config.num_shared_experts:
        shared = inner * config.num_shared_experts
        out["mlp.shared_experts.gate_proj.weight"] = TensorSpec((shared, H), "weight")
        out["mlp.shared_experts.up_proj.weight"] = TensorSpec((shared, H), "weight")
        out["mlp.shared_experts.down_proj.weight"] = TensorSpec((H, shared), "weight")
    if config.moe_latent_size is not None:
        out["mlp.routed_expert_down_proj.weight"] = TensorSpec((width, H), "weight")
        out["mlp.routed_expert_up_proj.weight"] = TensorSpec((H, width), "weight")
        if config.moe_latent_norm:
            out["mlp.routed_expert_norm.weight"] = TensorSpec((width,), "weight")
    return out


def count_parameters(config: ModelConfig) -> ParamCount:
    """Total parameters and the parameters one token touches (top-k routed experts per MoE layer)."""
    total = active = 0
    for name, spec in expected_tensors(config).items():
        numel = math.prod(spec.shape)
        if name.endswith("_scale") and spec.kind == "uint8":
            continue                                                          # MXFP4 scales are not parameters
        if name.endswith("_packed") and spec.kind == "uint8":
            numel *= 2                                                        # two parameters per byte
        total += numel
        if is_routed_expert(name):
            numel = numel // config.num_experts * config.num_experts_per_token   # dim 0 is the expert
        active += numel
    return ParamCount(total=total, active=active)


# ---- random initialisation -----------------------------------------------------------------------------------

_NORM_SUFFIXES = ("layernorm.weight", "norm.weight")


def init_random_weights(config: ModelConfig, seed: int, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Random weights for every canonical tensor, deterministic for (seed, device type).

    Scaled so that a deep tiny model gives non-degenerate logits: projections N(0, 1/fan_in), embeddings N(0, 1),
    norm weights U(0.9, 1.1) (not exactly 1, so a transposed or misplaced norm weight shows up in tests),
    A_log = log U(1, 16) and dt_bias as flash-linear-attention initialises them, a small random router bias and
    small AttnRes pseudo-queries (all-zero queries would make every depth mix uniform and hide bugs).
    MXFP4 experts are the bf16 format's draws (same stream), quantised: the MXFP4 model of a seed is the nearest
    MXFP4 model to the bf16 one.
    """
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, spec in expected_tensors(config).items():
        if spec.kind == "uint8":
            if name.endswith("_packed"):
                dense_shape = (*spec.shape[:-1], spec.shape[-1] * 2)
                dense = _random_tensor(name, TensorSpec(dense_shape, "weight"), config, generator, device)
                weights[name], weights[name.removesuffix("_packed") + "_scale"] = quantize_mxfp4(dense)
            continue
        value = _random_tensor(name, spec, config, generator, device)       # float32
        weights[name] = value if spec.kind == "fp32" else value.to(dtype)
    return {name: weights[name] for name in expected_tensors(config)}


def _random_tensor(name: str, spec: TensorSpec, config: ModelConfig, generator: torch.Generator,
                   device: torch.device) -> torch.Tensor:
    shape = spec.shape

    def uniform(low: float, high: float) -> torch.Tensor:
        return torch.rand(shape, generator=generator, device=device) * (high - low) + low

    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device) * std

    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    if name.endswith(_NORM_SUFFIXES):
        return uniform(0.9, 1.1)
    if name.endswith("res_proj.weight"):
        # scores are r_j * sum_h v_h q_h ~ sqrt(H) * std: O(0.5) keeps the depth softmax neither flat nor one-hot
        return normal(0.5 / math.sqrt(config.hidden_size))
    if name.endswith("A_log"):
        return uniform(1.0, 16.0).log()
    if name.endswith("dt_bias"):
        # flash-linear-attention: dt ~ logU(1e-3, 1e-1), dt_bias = softplus^-1(dt)
        dt = uniform(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
        return dt + torch.log(-torch.expm1(-dt))
    if name.endswith("e_score_correction_bias"):
        return normal(0.01)
    if name.endswith("conv1d.weight"):
        return normal(1.0 / math.sqrt(shape[-1]))
    # every remaining tensor is a projection [..., out, in]
    return normal(1.0 / math.sqrt(shape[-1]))

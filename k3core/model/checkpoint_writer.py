"""Write canonical weights as a Kimi-K3-format checkpoint directory (for tests and bench tooling).

The directory looks like the published K3 release (K3_ARCHITECTURE.md §1 and §4): `config.json` with
`model_type: kimi_k3` and the language model under `text_config`; tensors under the `language_model.` prefix;
`block_sparse_moe.*` on MoE layers; `A_log` padded to [max(heads, head_dim)]; routed experts per expert as
`experts.{e}.{w1,w3,w2}` and, with `mxfp4_experts`, as MXFP4 `weight_packed` + `weight_scale` pairs. With
`num_shards` > 1 the tensors are spread over that many files named by a `model.safetensors.index.json`.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from k3core.config import ModelConfig
from k3core.hf_config import k3_config_dict
from k3core.model.loader import SAFETENSORS_FILE, SAFETENSORS_INDEX
from k3core.model.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from k3core.model.weights import expected_tensors, is_routed_expert

K3_PREFIX = "language_model."


def save_k3_checkpoint(weights: dict[str, torch.Tensor], config: ModelConfig, directory: str | Path,
                       mxfp4_experts: bool = True, num_shards: int = 1) -> dict[str, torch.Tensor]:
    """Write `weights` (canonical names) as a K3 checkpoint; returns the canonical weights the directory now holds.

    The returned dict equals `weights` except that MXFP4-quantised experts are replaced by their dequantised values
    (in the dtype they were given), so a caller can compare a loaded checkpoint against it exactly. Experts that
    are already MXFP4 (`config.expert_format == "mxfp4"`: packed + scale tensors) are written byte for byte, or
    dequantised to float32 when `mxfp4_experts` is False, and returned as given. With `mxfp4_experts` the
    config.json carries the published `quantization_config` (compressed-tensors `mxfp4-pack-quantized`).
    """
    expected = expected_tensors(config)
    absent = [name for name in expected if name not in weights]
    if absent:
        raise ValueError(f"cannot write a checkpoint without {absent[0]} (and {len(absent) - 1} more); "
                         "pass every tensor of expected_tensors(config)")
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    stored: dict[str, torch.Tensor] = {}
    held = dict(weights)
    for name in expected:
        tensor = weights[name].detach().cpu()
        if is_routed_expert(name):
            continue   # written expert by expert below
        if name.endswith(".self_attn.A_log"):
            stored[K3_PREFIX + name] = _padded_a_log(tensor, config)
        else:
            stored[_k3_name(name, config)] = tensor.clone()
    for name in expected:
        if name.endswith(".mlp.experts.w13"):
            prefix = name[: -len(".w13")]
            held[name], held[prefix + ".w2"] = _write_experts(prefix, weights[name].detach().cpu(),
                                                              weights[prefix + ".w2"].detach().cpu(),
                                                              config, mxfp4_experts, stored)
        elif name.endswith(".mlp.experts.w13_packed"):
            _write_packed_experts(name[: -len(".w13_packed")], weights, config, mxfp4_experts, stored)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "config.json", "w") as handle:
        json.dump(k3_config_dict(config.replace(expert_format="mxfp4" if mxfp4_experts else "bf16")), handle,
                  indent=2)
    _write_shards(stored, directory, num_shards)
    return held


def _k3_name(name: str, config: ModelConfig) -> str:
    """Canonical -> K3 release name: the wrapper prefix, and `block_sparse_moe` for the MLP of MoE layers."""
    parts = name.split(".")
    if name.startswith("model.layers.") and parts[3] == "mlp" and config.mlp_types[int(parts[2])] == "moe":
        parts[3] = "block_sparse_moe"
    return K3_PREFIX + ".".join(parts)


def _padded_a_log(a_log: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """K3 stores A_log as [head_dim] (128 entries for 96 heads); entries past the heads are unused padding."""
    length = max(config.kda_num_heads, config.kda_head_dim)
    out = torch.zeros(length, dtype=torch.float32)
    out[: config.kda_num_heads] = a_log.float()
    return out


def _write_experts(prefix: str, w13: torch.Tensor, w2: torch.Tensor, config: ModelConfig, mxfp4: bool,
                   stored: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Store per-expert w1/w3/w2 under `prefix`; return (w13, w2) as stored (dequantised when MXFP4)."""
    inner = config.moe_intermediate_size
    k3_prefix = _k3_name(prefix, config)
    held13, held2 = w13.clone(), w2.clone()
    for expert in range(config.num_experts):
        parts = {"w1": w13[expert, :inner], "w3": w13[expert, inner:], "w2": w2[expert]}   # [I, De], [I, De], [De, I]
        for part, value in parts.items():
            base = f"{k3_prefix}.{expert}.{part}"
            if not mxfp4:
                stored[base + ".weight"] = value.clone()
                continue
            packed, scale = quantize_mxfp4(value)
            stored[base + ".weight_packed"], stored[base + ".weight_scale"] = packed, scale
            dense = dequantize_mxfp4(packed, scale).to(value.dtype)
            if part == "w2":
                held2[expert] = dense
            else:
                rows = slice(0, inner) if part == "w1" else slice(inner, 2 * inner)
                held13[expert, rows] = dense
    return held13, held2


def _write_packed_experts(prefix: str, weights: dict[str, torch.Tensor], config: ModelConfig, mxfp4: bool,
                          stored: dict[str, torch.Tensor]) -> None:
    """Store MXFP4-held experts per expert: their bytes as they are, or dequantised (float32) when not `mxfp4`."""
    inner = config.moe_intermediate_size
    k3_prefix = _k3_name(prefix, config)
    tensors = {field: weights[f"{prefix}.{field}"].detach().cpu()
               for field in ("w13_packed", "w13_scale", "w2_packed", "w2_scale")}
    for expert in range(config.num_experts):
        for part, source, rows in (("w1", "w13", slice(0, inner)), ("w3", "w13", slice(inner, 2 * inner)),
                                   ("w2", "w2", slice(None))):
            packed = tensors[source + "_packed"][expert, rows].clone()
            scale = tensors[source + "_scale"][expert, rows].clone()
            base = f"{k3_prefix}.{expert}.{part}"
            if mxfp4:
                stored[base + ".weight_packed"], stored[base + ".weight_scale"] = packed, scale
            else:
                stored[base + ".weight"] = dequantize_mxfp4(packed, scale)


def _write_shards(stored: dict[str, torch.Tensor], directory: Path, num_shards: int) -> None:
    from safetensors.torch import save_file
    names = list(stored)
    if num_shards == 1:
        save_file(stored, str(directory / SAFETENSORS_FILE), metadata={"format": "pt"})
        return
    num_shards = min(num_shards, len(names))
    total = sum(t.numel() * t.element_size() for t in stored.values())
    shards: list[list[str]] = [[] for _ in range(num_shards)]
    running = 0
    for name in names:
        # contiguous runs of roughly equal bytes, as save_pretrained shards
        shard = min(num_shards - 1, running * num_shards // max(total, 1))
        shards[shard].append(name)
        running += stored[name].numel() * stored[name].element_size()
    shards = [s for s in shards if s]
    weight_map: dict[str, str] = {}
    for index, shard_names in enumerate(shards):
        file_name = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: stored[n] for n in shard_names}, str(directory / file_name), metadata={"format": "pt"})
        weight_map.update({n: file_name for n in shard_names})
    with open(directory / SAFETENSORS_INDEX, "w") as handle:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, handle, indent=2)

"""Applying a ParallelPlan to an unchanged model's weights: the local weights and config of one rank."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from k3core.config import ModelConfig
from k3core.parallel.plan import ParallelPlan


@dataclass(frozen=True)
class LocalModel:
    config: ModelConfig                  # heads divided by tp; everything else as the full model
    weights: dict[str, torch.Tensor]     # only this stage's layers (plus the ends it owns), sharded
    layer_ids: list[int]                 # global layer ids this rank runs
    expert_offset: int                   # first routed expert id held here (EP), else 0
    first_stage: bool
    last_stage: bool


def _split(tensor: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    size = tensor.shape[dim]
    if size % parts:
        raise ValueError(f"cannot split a dimension of {size} into {parts} equal parts")
    return tensor.narrow(dim, index * (size // parts), size // parts).contiguous()


def shard_tensor(plan: ParallelPlan, name: str, tensor: torch.Tensor, tp_rank: int, ep_rank: int) -> torch.Tensor:
    rule = plan.weight_rule(name)
    if rule == "replicate" or (plan.tp == 1 and rule not in ("experts",)):
        return tensor
    if rule == "rows":
        return _split(tensor, 0, plan.tp, tp_rank)
    if rule == "cols":
        return _split(tensor, 1, plan.tp, tp_rank)
    if rule == "gate_up_rows":                                    # w13 [E, 2I, De]: split gate and up halves alike
        gate, up = tensor.chunk(2, dim=1)
        return torch.cat([_split(gate, 1, plan.tp, tp_rank), _split(up, 1, plan.tp, tp_rank)], dim=1)
    if rule == "expert_cols":                                     # w2 [E, De, I]
        return _split(tensor, 2, plan.tp, tp_rank)
    if rule == "experts":
        return _split(tensor, 0, plan.ep, ep_rank)
    raise ValueError(f"unknown shard rule {rule!r} for {name}")


def _layer_of(name: str) -> int | None:
    if name.startswith("model.layers."):
        return int(name.split(".")[2])
    return None


def shard_model(config: ModelConfig, weights: dict[str, torch.Tensor], plan: ParallelPlan, rank: int) -> LocalModel:
    plan.check(config)
    coords = plan.coords(rank)
    layers = plan.layer_ranges(config)[coords.stage]
    first, last = coords.stage == 0, coords.stage == plan.pp - 1
    ep_rank = coords.stage_rank if plan.ep > 1 else 0
    local: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        layer = _layer_of(name)
        if layer is not None and layer not in layers:
            continue
        if layer is None:
            needed = (name == "model.embed_tokens.weight" and (first or (last and config.tie_word_embeddings))) or (
                last and name in ("lm_head.weight", "model.norm.weight", "model.output_attn_res_norm.weight",
                                  "model.output_attn_res_proj.weight"))
            if not needed:
                continue
        local[name] = shard_tensor(plan, name, tensor, coords.tp_rank, ep_rank)
    local_config = config.replace(kda_num_heads=config.kda_num_heads // plan.tp,
                                  mla_num_heads=config.mla_num_heads // plan.tp)
    expert_offset = ep_rank * (config.num_experts // plan.ep) if plan.ep > 1 else 0
    return LocalModel(local_config, local, list(layers), expert_offset, first, last)

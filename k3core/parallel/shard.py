"""Applying a ParallelPlan to an unchanged model's weights: the local weights and config of one rank.

One definition of what a rank holds serves both ways of getting there: `RankShare` says which canonical tensors
a rank owns and which slices of each (`pieces`), `shard_model` cuts them out of weights already in memory, and the
checkpoint loader (`k3core.model.loader.load_checkpoint(..., plan=, rank=)`) reads only those slices from disk.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from k3core.config import ModelConfig
from k3core.parallel.plan import ParallelPlan

Index = tuple[slice, ...]


@dataclass(frozen=True)
class LocalModel:
    config: ModelConfig                  # heads divided by tp; everything else as the full model
    weights: dict[str, torch.Tensor]     # only this stage's layers (plus the ends it owns), sharded
    layer_ids: list[int]                 # global layer ids this rank runs
    expert_offset: int                   # first routed expert id held here (EP), else 0
    first_stage: bool
    last_stage: bool


def _part(size: int, parts: int, index: int) -> slice:
    if size % parts:
        raise ValueError(f"cannot split a dimension of {size} into {parts} equal parts")
    step = size // parts
    return slice(index * step, (index + 1) * step)


def _along(dim: int, piece: slice) -> Index:
    return (slice(None),) * dim + (piece,)


def shard_pieces(plan: ParallelPlan, name: str, shape: tuple[int, ...], tp_rank: int,
                 ep_rank: int) -> tuple[list[Index], int]:
    """(indices, dim): the rank's shard of `name` (of `shape`) is the concatenation along `dim` of
    `tensor[index]` for each index; a single `()` index means the whole tensor."""
    rule = plan.weight_rule(name)
    if rule == "replicate" or (plan.tp == 1 and rule not in ("experts",)):
        return [()], 0
    if rule == "rows":
        return [_along(0, _part(shape[0], plan.tp, tp_rank))], 0
    if rule == "cols":
        return [_along(1, _part(shape[1], plan.tp, tp_rank))], 1
    if rule == "gate_up_rows":                                    # w13 [E, 2I, De]: split gate and up halves alike
        half = shape[1] // 2
        local = _part(half, plan.tp, tp_rank)
        return [_along(1, local), _along(1, slice(half + local.start, half + local.stop))], 1
    if rule == "expert_cols":                                     # w2 [E, De, I]
        return [_along(2, _part(shape[2], plan.tp, tp_rank))], 2
    if rule == "experts":
        return [_along(0, _part(shape[0], plan.ep, ep_rank))], 0
    raise ValueError(f"unknown shard rule {rule!r} for {name}")


def shard_tensor(plan: ParallelPlan, name: str, tensor: torch.Tensor, tp_rank: int, ep_rank: int) -> torch.Tensor:
    indices, dim = shard_pieces(plan, name, tuple(tensor.shape), tp_rank, ep_rank)
    if indices == [()]:
        return tensor
    pieces = [tensor[index] for index in indices]
    return pieces[0].contiguous() if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def _layer_of(name: str) -> int | None:
    if name.startswith("model.layers."):
        return int(name.split(".")[2])
    return None


@dataclass(frozen=True)
class RankShare:
    """What one rank of a plan holds of a model: its layers, ends, experts and the TP slice of each tensor."""
    config: ModelConfig
    plan: ParallelPlan
    rank: int

    def __post_init__(self) -> None:
        self.plan.check(self.config)

    @property
    def coords(self):
        return self.plan.coords(self.rank)

    @property
    def layers(self) -> range:
        return self.plan.layer_ranges(self.config)[self.coords.stage]

    @property
    def first_stage(self) -> bool:
        return self.coords.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.coords.stage == self.plan.pp - 1

    @property
    def ep_rank(self) -> int:
        return self.coords.stage_rank if self.plan.ep > 1 else 0

    @property
    def tp_rank(self) -> int:
        return self.coords.tp_rank

    @property
    def expert_offset(self) -> int:
        return self.ep_rank * (self.config.num_experts // self.plan.ep) if self.plan.ep > 1 else 0

    @property
    def experts(self) -> range:
        """Routed expert ids held here."""
        per_rank = self.config.num_experts // self.plan.ep
        return range(self.expert_offset, self.expert_offset + per_rank)

    def owns(self, name: str) -> bool:
        layer = _layer_of(name)
        if layer is not None:
            return layer in self.layers
        first, last = self.first_stage, self.last_stage
        return (name == "model.embed_tokens.weight" and (first or (last and self.config.tie_word_embeddings))) or (
            last and name in ("lm_head.weight", "model.norm.weight", "model.output_attn_res_norm.weight",
                              "model.output_attn_res_proj.weight"))

    def pieces(self, name: str, shape: tuple[int, ...]) -> tuple[list[Index], int]:
        return shard_pieces(self.plan, name, shape, self.tp_rank, self.ep_rank)

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return shard_tensor(self.plan, name, tensor, self.tp_rank, self.ep_rank)

    def local_model(self, weights: dict[str, torch.Tensor]) -> LocalModel:
        """The LocalModel around `weights`, which already are this rank's shards."""
        local_config = self.config.replace(kda_num_heads=self.config.kda_num_heads // self.plan.tp,
                                           mla_num_heads=self.config.mla_num_heads // self.plan.tp)
        return LocalModel(local_config, weights, list(self.layers), self.expert_offset, self.first_stage,
                          self.last_stage)


def shard_model(config: ModelConfig, weights: dict[str, torch.Tensor], plan: ParallelPlan, rank: int) -> LocalModel:
    share = RankShare(config, plan, rank)
    local = {name: share.shard(name, tensor) for name, tensor in weights.items() if share.owns(name)}
    return share.local_model(local)

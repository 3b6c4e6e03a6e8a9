"""ParallelPlan: how one model is spread over ranks, as data.

A plan has four sizes. `pp` pipeline stages own contiguous layers. Inside a stage, `stage_size = max(tp, dcp)`
ranks work together:
* TP (`tp`): KDA and MLA heads, the dense/shared MLP intermediate and (without EP) each routed expert's
  intermediate are split; an all-reduce over the TP group follows every row-parallel projection.
* DCP (`dcp`): MLA KV is split by token position (token i on DCP rank i mod dcp); every rank computes partial
  attention over its tokens with the LSE and one exchange merges the partials exactly. The DCP group is built
  inside the stage, so with dcp == tp (the launch write-up's DCP8 inside TP8) it is the same ranks as TP.
* EP (`ep`, 1 or stage_size): the routed experts are split over the stage; each rank sends its slice of the
  tokens to the ranks holding their chosen experts and gets the weighted results back (all-to-all dispatch and
  combine, `k3core.parallel.expert_dispatch`), then an all-gather rebuilds the token set.

Rank r of a stage has tp_rank = r % tp (TP group: the tp consecutive ranks containing r) and dcp_rank = r % dcp
(DCP group: the dcp consecutive ranks containing r). Global rank = stage * stage_size + r.

`weight_rule(name)` says how each canonical weight is sharded; `layer_ranges()` which layers each stage owns;
`collective_after(op)` which collective follows an op. `k3core.parallel.shard` applies a plan to weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from k3core.config import ModelConfig

# How a weight is split over the TP group (or the EP group for "experts").
Rule = Literal["replicate", "rows", "cols", "gate_up_rows", "experts", "expert_rows", "expert_cols"]


@dataclass(frozen=True)
class RankCoords:
    rank: int
    stage: int
    stage_rank: int
    tp_rank: int
    dcp_rank: int


@dataclass(frozen=True)
class ParallelPlan:
    tp: int = 1
    pp: int = 1
    dcp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dcp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if max(self.tp, self.dcp) % min(self.tp, self.dcp):
            raise ValueError(f"tp ({self.tp}) and dcp ({self.dcp}) must divide one another: the DCP group is built "
                             "inside the ranks of a stage")
        if self.ep not in (1, self.stage_size):
            raise ValueError(f"ep ({self.ep}) must be 1 or the ranks per stage ({self.stage_size} = max(tp, dcp))")

    @property
    def stage_size(self) -> int:
        return max(self.tp, self.dcp)

    @property
    def world_size(self) -> int:
        return self.pp * self.stage_size

    @property
    def is_single(self) -> bool:
        return self.world_size == 1

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the plan's world of {self.world_size}")
        stage, stage_rank = divmod(rank, self.stage_size)
        return RankCoords(rank, stage, stage_rank, stage_rank % self.tp, stage_rank % self.dcp)

    def tp_group(self, rank: int) -> list[int]:
        base = rank - rank % self.tp
        return list(range(base, base + self.tp))

    def dcp_group(self, rank: int) -> list[int]:
        base = rank - rank % self.dcp
        return list(range(base, base + self.dcp))

    def stage_group(self, stage: int) -> list[int]:
        return list(range(stage * self.stage_size, (stage + 1) * self.stage_size))

    # ---- validation against a model --------------------------------------------------------------
    def check(self, config: ModelConfig) -> None:
        def need(cond: bool, message: str) -> None:
            if not cond:
                raise ValueError(message)
        need(self.pp <= config.num_layers, f"pp ({self.pp}) exceeds the {config.num_layers} layers")
        if config.kda_layer_ids:
            need(config.kda_num_heads % self.tp == 0,
                 f"tp ({self.tp}) must divide the {config.kda_num_heads} KDA heads")
        if config.mla_layer_ids:
            need(config.mla_num_heads % self.tp == 0,
                 f"tp ({self.tp}) must divide the {config.mla_num_heads} MLA heads")
        if "dense" in config.mlp_types:
            need(config.intermediate_size % self.tp == 0,
                 f"tp ({self.tp}) must divide intermediate_size ({config.intermediate_size})")
        if "moe" in config.mlp_types:
            shared = config.moe_intermediate_size * config.num_shared_experts
            need(shared % self.tp == 0, f"tp ({self.tp}) must divide the shared-expert width ({shared})")
            if self.ep > 1:
                need(config.num_experts % self.ep == 0,
                     f"ep ({self.ep}) must divide the {config.num_experts} routed experts")
            else:
                need(config.moe_intermediate_size % self.tp == 0,
                     f"tp ({self.tp}) must divide moe_intermediate_size ({config.moe_intermediate_size})")
                need(config.expert_format != "mxfp4" or (config.moe_intermediate_size // self.tp) % 32 == 0,
                     f"MXFP4 experts split by tp ({self.tp}) need a multiple of 32 of moe_intermediate_size "
                     f"({config.moe_intermediate_size}) per rank (one scale per 32 columns); use ep or bf16 experts")

    # ---- layers -----------------------------------------------------------------------------------
    def layer_ranges(self, config: ModelConfig) -> list[range]:
        """Contiguous layers per stage, as even as possible (earlier stages take the remainder)."""
        base, extra = divmod(config.num_layers, self.pp)
        ranges, start = [], 0
        for stage in range(self.pp):
            size = base + (1 if stage < extra else 0)
            ranges.append(range(start, start + size))
            start += size
        return ranges

    # ---- weights ----------------------------------------------------------------------------------
    def weight_rule(self, name: str) -> Rule:
        """How the canonical weight `name` is split over the ranks of a stage."""
        if ".self_attn." in name:
            field = name.split(".self_attn.", 1)[1]
            if field.startswith(("q_proj.", "k_proj.", "v_proj.", "g_proj.", "q_conv1d.", "k_conv1d.",
                                 "v_conv1d.", "f_b_proj.", "g_b_proj.", "b_proj.", "q_b_proj.", "kv_b_proj.")):
                return "rows"             # split by head: each head's rows are contiguous
            if field in ("dt_bias", "A_log"):
                return "rows"
            if field.startswith("o_proj."):
                return "cols"             # row-parallel output projection: all-reduce after
            return "replicate"            # f_a, g_a, o_norm, q_a, kv_a and their norms (the latent is not split)
        if ".mlp." in name:
            field = name.split(".mlp.", 1)[1]
            if field in ("gate_proj.weight", "up_proj.weight", "shared_experts.gate_proj.weight",
                         "shared_experts.up_proj.weight"):
                return "rows"
            if field in ("down_proj.weight", "shared_experts.down_proj.weight"):
                return "cols"
            if field in ("experts.w13", "experts.w13_packed", "experts.w13_scale"):     # MXFP4 splits alike
                return "experts" if self.ep > 1 else "gate_up_rows"
            if field in ("experts.w2", "experts.w2_packed", "experts.w2_scale"):
                return "experts" if self.ep > 1 else "expert_cols"
            return "replicate"            # router, bias, latent projections and norm
        return "replicate"                # embeddings, lm_head, norms, AttnRes weights

    @staticmethod
    def collective_after(op: str) -> str:
        """The collective that follows each sharded computation (documentation and plan printing)."""
        return {
            "kda.o_proj": "all_reduce(tp)",
            "mla.o_proj": "all_reduce(tp)",
            "mla.decode_attention": "all_gather(dcp) of (partial output, lse) then exact LSE merge",
            "mla.prefill_keys": "all_gather(dcp) of each rank's cached latents",
            "mlp.down_proj": "all_reduce(tp)",
            "moe.routed_experts": "TP: all_reduce(tp) before the latent norm; EP: all_to_all dispatch + combine, "
                                  "all_gather(ep)",
            "moe.shared_experts": "all_reduce(tp)",
            "stage.output": "send/recv(pp) of the residual stream (and the AttnRes bank)",
            "sample": "broadcast from the last stage",
        }[op]

    def describe(self, config: ModelConfig) -> str:
        lines = [f"plan: tp={self.tp} pp={self.pp} dcp={self.dcp} ep={self.ep} "
                 f"({self.world_size} ranks, {self.stage_size} per stage)"]
        for stage, layers in enumerate(self.layer_ranges(config)):
            lines.append(f"  stage {stage}: layers {layers.start}..{layers.stop - 1}, ranks {self.stage_group(stage)}")
        lines.append(f"  KDA heads per rank: {config.kda_num_heads // self.tp}; MLA heads per rank: "
                     f"{config.mla_num_heads // self.tp}; MLA tokens per rank: 1/{self.dcp}")
        if "moe" in config.mlp_types:
            lines.append(f"  routed experts per rank: {config.num_experts // self.ep}"
                         + ("" if self.ep > 1 else f" (each 1/{self.tp} of its intermediate width)"))
        ops = ["kda.o_proj", "mla.o_proj", "mlp.down_proj", "moe.routed_experts", "moe.shared_experts"]
        if self.dcp > 1:
            ops += ["mla.prefill_keys", "mla.decode_attention"]
        if self.pp > 1:
            ops.append("stage.output")
        if not self.is_single:
            lines += [f"  after {op}: {self.collective_after(op)}" for op in ops + ["sample"]]
        return "\n".join(lines)

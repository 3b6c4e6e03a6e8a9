"""The feed-forward sublayers: a dense GLU MLP and the (Latent)MoE (K3_ARCHITECTURE.md §3.4)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from k3core.config import ModelConfig
from k3core.model.held import fuse_rows, hold_float32
from k3core.model.mxfp4 import max_scale_of


class DenseMlp:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str):
        self.config = config
        self.w_gate_up = fuse_rows(weights, [prefix + "gate_proj.weight", prefix + "up_proj.weight"])   # [2I, H]
        self.w_down = weights[prefix + "down_proj.weight"]                              # [H, I]

    def forward(self, ops, x: torch.Tensor) -> torch.Tensor:
        return self.down(ops, F.linear(x, self.w_gate_up))

    def down(self, ops, gate_up: torch.Tensor) -> torch.Tensor:
        """The rest of forward from the gate/up projection's output [T, 2I] (which a caller may have computed in a
        larger GEMM)."""
        c = self.config
        return F.linear(ops.glu_activation(gate_up, c.activation, c.situ_beta, c.situ_linear_beta), self.w_down)


class RoutedExperts:
    """This rank's routed experts in the format the config holds them: dense (w13 [E, 2I, De], w2 [E, De, I]) for
    `moe_experts`, or MXFP4 (packed codes + E8M0 scales, k3core.model.mxfp4) for `moe_experts_mxfp4`."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str):
        self.config = config
        self.packed = config.expert_format == "mxfp4"
        names = ("w13_packed", "w13_scale", "w2_packed", "w2_scale") if self.packed else ("w13", "w2")
        self.tensors = tuple(weights[prefix + name] for name in names)
        # a bound on every scale byte, measured once here (the kernels may fold a constant with it)
        self.max_scale = max_scale_of(self.tensors[1], self.tensors[3]) if self.packed else None

    @property
    def num_experts(self) -> int:
        return self.tensors[0].shape[0]

    def forward(self, ops, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                expert_offset: int) -> torch.Tensor:
        """x [T, De], weights/expert_ids [T, k] -> [T, De]: the op of the held format."""
        c = self.config
        if self.packed:
            return ops.moe_experts_mxfp4(x, *self.tensors, weights, expert_ids, c.activation, c.situ_beta,
                                         c.situ_linear_beta, expert_offset, max_scale=self.max_scale)
        return ops.moe_experts(x, *self.tensors, weights, expert_ids, c.activation, c.situ_beta,
                               c.situ_linear_beta, expert_offset)


class MoeMlp:
    """Router and shared experts read the full-width x; routed experts run at the latent width when LatentMoE is on,
    and the combined latent output is normalised (after the weighted sum) before projecting back up."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str, comm=None,
                 expert_offset: int = 0):
        w = lambda name: weights[prefix + name]  # noqa: E731
        self.config = config
        # Under TP the routed experts of this rank give a partial sum (its slice of every expert's width), reduced
        # BEFORE the latent norm: the norm of a sum is not a sum of norms. Under EP the tokens are dispatched to the
        # ranks that hold their experts and the results combined back (k3core.parallel.expert_dispatch).
        self.ep_group = comm.ep if comm is not None and comm.plan.ep > 1 else None
        self.reduce_routed = comm.tp.all_reduce if comm is not None and self.ep_group is None else None
        self.reduce_shared = comm.tp.all_reduce if comm else None
        self.expert_offset = expert_offset
        self.w_router = hold_float32(weights, prefix + "gate.weight")                  # [E, H]
        self.correction_bias = w("gate.e_score_correction_bias").float() if config.router_correction_bias else None
        self.experts = RoutedExperts(config, weights, prefix + "experts.")
        # With both a LatentMoE down projection and shared experts, both projections of x are one GEMM, rows
        # concatenated (fused before the shared experts are built, so that their gate/up is a view of it).
        latent, shared = config.moe_latent_size is not None, bool(config.num_shared_experts)
        names = (["routed_expert_down_proj.weight"] if latent else []) + (
            ["shared_experts.gate_proj.weight", "shared_experts.up_proj.weight"] if shared else [])
        self.x_rows = [w(names[0]).shape[0], sum(w(name).shape[0] for name in names[1:])] if latent and shared \
            else None
        self.w_x = fuse_rows(weights, [prefix + name for name in names]) if self.x_rows else None
        self.shared = DenseMlp(config, weights, prefix + "shared_experts.") if shared else None
        self.w_latent_down = w("routed_expert_down_proj.weight") if latent else None    # [De, H]
        self.w_latent_up = w("routed_expert_up_proj.weight") if latent else None        # [H, De]
        self.w_latent_norm = w("routed_expert_norm.weight") if config.moe_latent_norm else None

    def forward(self, ops, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        logits = F.linear(x.float(), self.w_router)                                    # [T, E] float32
        route = ops.moe_route(logits, self.correction_bias, c.num_experts_per_token, c.router_scoring,
                              c.moe_renormalize, c.routed_scaling_factor, c.num_expert_group, c.topk_group)
        shared_gate_up = None
        if self.w_x is not None:
            z, shared_gate_up = F.linear(x, self.w_x).split(self.x_rows, dim=-1)          # [T, De], [T, 2I]
        else:
            z = F.linear(x, self.w_latent_down) if self.w_latent_down is not None else x  # [T, De]
        if self.ep_group is not None:
            from k3core.parallel.expert_dispatch import dispatch_experts
            y = dispatch_experts(ops, self.ep_group, z, route, self.experts, self.expert_offset, c)
        else:
            y = self.experts.forward(ops, z, route.weights, route.expert_ids, self.expert_offset)
        if self.reduce_routed is not None:
            y = self.reduce_routed(y)
        if self.w_latent_norm is not None:
            y = ops.rms_norm(y, self.w_latent_norm, c.rms_norm_eps)
        if self.w_latent_up is not None:
            y = F.linear(y, self.w_latent_up)                                           # [T, H]
        if self.shared is not None:
            shared = (self.shared.forward(ops, x) if shared_gate_up is None
                      else self.shared.down(ops, shared_gate_up))
            y = y + (self.reduce_shared(shared) if self.reduce_shared is not None else shared)
        return y

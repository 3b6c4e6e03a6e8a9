"""Expert parallelism: token dispatch and combine by all-to-all.

Inside an EP group every rank holds the same tokens (they are replicated by TP) and a contiguous 1/ep of the
routed experts. Each rank takes its 1/ep slice of the tokens, sends every (token, chosen expert) pair to the rank
that holds the expert (all-to-all), runs its experts on what it received, sends the weighted results back
(all-to-all) and sums each token's choices in float32; an all-gather rebuilds the full token set. Every expert's
weights are read by exactly one rank and no rank computes another rank's tokens.
"""
from __future__ import annotations

import torch

from k3core.ops import RouteOut


def dispatch_experts(ops, group, z: torch.Tensor, route: RouteOut, experts, expert_offset: int,
                     config) -> torch.Tensor:
    """z [T, De] (replicated in the group), route over all experts -> routed output [T, De] (replicated).
    `experts` is this rank's `k3core.model.ffn.RoutedExperts` (dense or MXFP4)."""
    members, me = group.size, group.index
    num_tokens, top_k = route.expert_ids.shape
    experts_per_rank = experts.num_experts
    bounds = [num_tokens * i // members for i in range(members + 1)]
    start, end = bounds[me], bounds[me + 1]
    ids = route.expert_ids[start:end].reshape(-1)                                     # [Tm * k]
    weights = route.weights[start:end].reshape(-1)                                    # [Tm * k]
    token = torch.arange(start, end, device=z.device).repeat_interleave(top_k)        # [Tm * k] row in z
    owner = torch.div(ids, experts_per_rank, rounding_mode="floor")                   # rank holding each expert
    order = torch.argsort(owner, stable=True)
    send_counts = torch.bincount(owner, minlength=members).tolist()
    rows, recv_counts = group.all_to_all(z[token[order]], send_counts)                # [P, De]
    recv_ids, _ = group.all_to_all(ids[order][:, None], send_counts)                  # [P, 1]
    recv_weights, _ = group.all_to_all(weights[order][:, None].float(), send_counts)  # [P, 1]
    # each received pair is one (row, expert, weight): a top-1 problem for this rank's experts
    out = experts.forward(ops, rows, recv_weights, recv_ids, expert_offset)          # [P, De]
    back, _ = group.all_to_all(out.float(), recv_counts)                              # [Tm * k, De] in `order`
    combined = torch.zeros(end - start, z.shape[1], dtype=torch.float32, device=z.device)
    combined.index_add_(0, token[order] - start, back)                               # sum the k choices
    return torch.cat(group.all_gather_varlen(combined)).to(z.dtype)                   # [T, De]

"""Mixture-of-experts routing (bias-corrected top-k) and the expert computation it feeds."""
from __future__ import annotations

import torch

from k3core.ops import RouteOut
from kernels.torch._dtypes import compute_dtype, float32_unless_float64
from kernels.torch.activation import glu_activation

SCORINGS = ("sigmoid", "softmax")
RENORM_EPS = 1e-20


def moe_route(logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int, scoring: str,
              renormalize: bool, routed_scaling_factor: float, num_expert_group: int = 1,
              topk_group: int = 1) -> RouteOut:
    """logits [T, E] -> RouteOut(weights [T, top_k] float32, expert_ids [T, top_k] int64).

    The bias only chooses the experts; the weights are the unbiased scores at the chosen experts, divided by
    (sum + 1e-20) when renormalize, times routed_scaling_factor. Experts come out in descending order of the
    biased score. With num_expert_group > 1 the choice is grouped first (`grouped_choice`). float64 logits give
    float64 weights.
    """
    num_experts = logits.shape[-1]
    check_groups(num_experts, top_k, num_expert_group, topk_group)
    scores, choice = route_scores(logits, correction_bias, scoring)
    choice = grouped_choice(choice, num_expert_group, topk_group)
    expert_ids = torch.topk(choice, top_k, dim=-1, sorted=True).indices       # [T, top_k]
    return RouteOut(route_weights(scores, expert_ids, renormalize, routed_scaling_factor), expert_ids)


def check_groups(num_experts: int, top_k: int, num_expert_group: int, topk_group: int) -> None:
    if not 0 < top_k <= num_experts:
        raise ValueError(f"moe_route: top_k={top_k} must be between 1 and the number of experts {num_experts}")
    if num_expert_group < 1 or num_experts % num_expert_group or not 1 <= topk_group <= num_expert_group:
        raise ValueError(f"moe_route: num_expert_group={num_expert_group} must divide the {num_experts} experts and "
                         f"topk_group={topk_group} must be in 1..num_expert_group")
    if top_k > topk_group * (num_experts // num_expert_group):
        raise ValueError(f"moe_route: top_k={top_k} is more than the {topk_group} kept groups of "
                         f"{num_experts // num_expert_group} experts hold")


def grouped_choice(choice: torch.Tensor, num_expert_group: int, topk_group: int) -> torch.Tensor:
    """Grouped top-k (DeepSeek-V3 `noaux_tc`, as transformers' Kimi-Linear router runs it): the E experts form
    num_expert_group contiguous groups; a group's score is the sum of its two best choice scores (its best, for
    groups of one); only the topk_group best groups stay choosable, the others' choice scores become -inf.
    Ties between groups go to the lower group index. One group returns `choice` unchanged."""
    if num_expert_group == 1:
        return choice
    num_tokens, num_experts = choice.shape
    groups = choice.view(num_tokens, num_expert_group, num_experts // num_expert_group)   # [T, G, E/G]
    group_scores = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(dim=-1)       # [T, G]
    kept = group_scores.topk(topk_group, dim=-1).indices                                   # [T, topk_group]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)        # [T, G]
    return groups.masked_fill(~keep[:, :, None], float("-inf")).view(num_tokens, num_experts)


def route_scores(logits: torch.Tensor, correction_bias: torch.Tensor | None,
                 scoring: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, choice) [T, E]: the sigmoid or softmax of the logits, and the scores plus the bias, which choose
    the experts; float32 (float64 for float64 logits)."""
    dtype = float32_unless_float64(logits.dtype)
    logits = logits.to(dtype)
    if scoring == "sigmoid":
        scores = torch.sigmoid(logits)                                         # [T, E]
    elif scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)                                 # [T, E]
    else:
        raise ValueError(f"moe_route: unknown scoring {scoring!r}; choose one of {', '.join(SCORINGS)}")
    choice = scores if correction_bias is None else scores + correction_bias.to(device=scores.device, dtype=dtype)
    return scores, choice


def route_weights(scores: torch.Tensor, expert_ids: torch.Tensor, renormalize: bool,
                  routed_scaling_factor: float) -> torch.Tensor:
    """The weights of the chosen experts [T, k]: their scores, renormalized (sum + 1e-20) if asked, scaled."""
    weights = scores.gather(1, expert_ids)                                     # [T, top_k]
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + RENORM_EPS)
    return weights * routed_scaling_factor


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                expert_ids: torch.Tensor, activation: str, situ_beta: float | None, situ_linear_beta: float | None,
                expert_offset: int = 0) -> torch.Tensor:
    """x [T, D], w13 [E, 2I, D] ([gate | up] rows), w2 [E, D, I], weights/expert_ids [T, k] -> y [T, D] (dtype of x).

    y_t = sum_j weights[t, j] * w2_e act(w13_e x_t) with e = expert_ids[t, j] - expert_offset; ids outside
    [expert_offset, expert_offset + E) belong to another rank under expert parallelism and contribute nothing.
    Everything in float32 (float64 for float64 x); one host sync per call for the per-expert counts.
    """
    num_experts, two_inter, hidden = w13.shape
    if x.shape[-1] != hidden or tuple(w2.shape) != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"moe_experts: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} must be "
                         f"[T, D], [E, 2I, D], [E, D, I]")
    if weights.shape != expert_ids.shape or weights.shape[0] != x.shape[0]:
        raise ValueError(f"moe_experts: weights {tuple(weights.shape)} and expert_ids {tuple(expert_ids.shape)} "
                         f"must both be [T, k] with T={x.shape[0]}")
    dtype = compute_dtype(x, weights)
    y = torch.zeros(x.shape[0], hidden, dtype=dtype, device=x.device)
    local = (expert_ids.long() - expert_offset).flatten()                     # [T * k]
    mine = (local >= 0) & (local < num_experts)
    # Sorting the (token, choice) pairs by expert lets each expert run one dense GEMM on its rows.
    order = torch.argsort(torch.where(mine, local, num_experts), stable=True)  # other ranks' pairs sort last
    counts = torch.bincount(local[mine], minlength=num_experts).tolist()
    top_k = expert_ids.shape[1]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // top_k                                                # [n]
        hidden_act = x[tokens].to(dtype) @ w13[expert].to(dtype).T            # [n, 2I]
        act = glu_activation(hidden_act, activation, situ_beta, situ_linear_beta)  # [n, I]
        out = act @ w2[expert].to(dtype).T                                     # [n, D]
        y.index_add_(0, tokens, out * weights.flatten()[pairs].to(dtype)[:, None])
    return y.to(x.dtype)

"""MoE routing: sigmoid or softmax scores, bias-corrected top-k by repeated max, renormalised weights.

One program per token row holds all E scores in registers (E <= 1024 or so); top-k takes k rounds of argmax and
knocks the winner out, which for k <= 16 costs less than a sort and picks experts in descending biased score, the
order of torch.topk(sorted=True). Ties go to the lowest expert id.

Grouped top-k (NUM_GROUPS > 1, kernels.torch.moe.grouped_choice): each group's score is the sum of its two best
choice scores (two rounds of max over the group's lanes), TOPK_GROUP rounds of argmax over the group scores pick
the kept groups (ties to the lower group), and the other experts' choice scores become -inf before the top-k.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3core.ops import RouteOut
from kernels.torch.moe import check_groups
from kernels.triton.tuning_ops import row_config

SCORINGS = ("sigmoid", "softmax")
RENORM_EPS = 1e-20


@triton.jit
def _keep_best_groups(choice, experts, num_experts, NUM_GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr,
                      BLOCK_G: tl.constexpr):
    """choice [BLOCK_E] with -inf outside the TOPK_GROUP best of NUM_GROUPS contiguous expert groups."""
    group_size = num_experts // NUM_GROUPS
    group_of = experts // group_size
    group_ids = tl.arange(0, BLOCK_G)
    group_scores = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    for group in tl.static_range(NUM_GROUPS):
        mine = tl.where(group_of == group, choice, float("-inf"))
        best = tl.argmax(mine, axis=0)
        second = tl.max(tl.where(experts == best, float("-inf"), mine), axis=0)
        score = tl.max(mine, axis=0) + tl.where(group_size > 1, second, 0.0)         # groups of one: the best
        group_scores = tl.where(group_ids == group, score, group_scores)
    keep = experts < 0
    for _ in tl.static_range(TOPK_GROUP):
        winner = tl.argmax(group_scores, axis=0)
        keep = keep | (group_of == winner)
        group_scores = tl.where(group_ids == winner, float("-inf"), group_scores)
    return tl.where(keep, choice, float("-inf"))


@triton.jit
def _moe_route_kernel(logits_ptr, bias_ptr, weights_ptr, expert_ids_ptr, logits_row_stride, num_experts,
                      scaling, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                      IS_SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
                      NUM_GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_G: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    mask = experts < num_experts
    logits = tl.load(logits_ptr + row * logits_row_stride + experts, mask=mask, other=float("-inf"))
    logits = logits.to(tl.float32)
    if IS_SIGMOID:
        scores = tl.sigmoid(logits)
    else:
        shifted = tl.exp(logits - tl.max(logits, axis=0))
        scores = shifted / tl.sum(shifted, axis=0)
    choice = scores
    if HAS_BIAS:
        choice += tl.load(bias_ptr + experts, mask=mask, other=0.0).to(tl.float32)
    choice = tl.where(mask, choice, float("-inf"))
    if NUM_GROUPS > 1:
        choice = _keep_best_groups(choice, experts, num_experts, NUM_GROUPS, TOPK_GROUP, BLOCK_G)

    slots = tl.arange(0, BLOCK_K)
    chosen_weights = tl.zeros((BLOCK_K,), tl.float32)
    chosen_ids = tl.zeros((BLOCK_K,), tl.int64)
    for slot in tl.static_range(TOP_K):
        winner = tl.argmax(choice, axis=0)
        weight = tl.sum(tl.where(experts == winner, scores, 0.0), axis=0)
        chosen_weights = tl.where(slots == slot, weight, chosen_weights)
        chosen_ids = tl.where(slots == slot, winner.to(tl.int64), chosen_ids)
        choice = tl.where(experts == winner, float("-inf"), choice)
    if RENORMALIZE:
        chosen_weights = chosen_weights / (tl.sum(chosen_weights, axis=0) + 1e-20)
    slot_mask = slots < TOP_K
    tl.store(weights_ptr + row * TOP_K + slots, chosen_weights * scaling, mask=slot_mask)
    tl.store(expert_ids_ptr + row * TOP_K + slots, chosen_ids, mask=slot_mask)


def moe_route(logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int, scoring: str,
              renormalize: bool, routed_scaling_factor: float, num_expert_group: int = 1,
              topk_group: int = 1) -> RouteOut:
    num_tokens, num_experts = logits.shape
    if scoring not in SCORINGS:
        raise ValueError(f"moe_route: unknown scoring {scoring!r}; choose one of {', '.join(SCORINGS)}")
    check_groups(num_experts, top_k, num_expert_group, topk_group)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)   # [T, k]
    expert_ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)  # [T, k]
    if num_tokens == 0:
        return RouteOut(weights, expert_ids)
    block_e = triton.next_power_of_2(num_experts)
    bias = correction_bias.to(torch.float32).contiguous() if correction_bias is not None else logits
    _moe_route_kernel[(num_tokens,)](
        logits, bias, weights, expert_ids, logits.stride(0), num_experts, float(routed_scaling_factor),
        TOP_K=top_k, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k), IS_SIGMOID=scoring == "sigmoid",
        HAS_BIAS=correction_bias is not None, RENORMALIZE=renormalize, NUM_GROUPS=num_expert_group,
        TOPK_GROUP=topk_group, BLOCK_G=triton.next_power_of_2(num_expert_group),
        num_warps=row_config(logits.device, block_e).num_warps)
    return RouteOut(weights, expert_ids)

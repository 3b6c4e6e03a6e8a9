"""MoE routing: sigmoid or softmax scores, bias-corrected top-k by repeated max, renormalised weights.

One program per token row holds all E scores in registers (E <= 1024 or so); top-k takes k rounds of argmax and
knocks the winner out, which for k <= 16 costs less than a sort and picks experts in descending biased score, the
order of torch.topk(sorted=True). Ties go to the lowest expert id.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3core.ops import RouteOut
from kernels.triton.tuning_ops import row_config

SCORINGS = ("sigmoid", "softmax")
RENORM_EPS = 1e-20


@triton.jit
def _moe_route_kernel(logits_ptr, bias_ptr, weights_ptr, expert_ids_ptr, logits_row_stride, num_experts,
                      scaling, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                      IS_SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr):
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
              renormalize: bool, routed_scaling_factor: float) -> RouteOut:
    num_tokens, num_experts = logits.shape
    if scoring not in SCORINGS:
        raise ValueError(f"moe_route: unknown scoring {scoring!r}; choose one of {', '.join(SCORINGS)}")
    if not 0 < top_k <= num_experts:
        raise ValueError(f"moe_route: top_k={top_k} must be between 1 and the number of experts {num_experts}")
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
        HAS_BIAS=correction_bias is not None, RENORMALIZE=renormalize,
        num_warps=row_config(logits.device, block_e).num_warps)
    return RouteOut(weights, expert_ids)

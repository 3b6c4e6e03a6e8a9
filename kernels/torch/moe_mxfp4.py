"""MoE expert computation with MXFP4 expert weights: the reference dequantises each used expert per call.

The oracle of `moe_experts_mxfp4` (and its CPU path): an expert's packed codes and E8M0 scales become dense weights
only for the duration of its GEMMs, in the compute dtype (float32, or float64 for float64 x: exact there, with no
float32 overflow at scale byte 254), and the rest is `moe_experts`.
"""
from __future__ import annotations

import torch

from k3core.model.mxfp4 import BLOCK_SIZE, dequantize_mxfp4, max_scale_of
from kernels.torch._dtypes import compute_dtype
from kernels.torch.activation import glu_activation


def check_mxfp4_experts(x: torch.Tensor, w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor,
                        w2_scale: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> tuple[int, int]:
    """(D, I) of a `moe_experts_mxfp4` call, or ValueError naming the argument whose shape or dtype is wrong."""
    for name, tensor in (("w13_packed", w13_packed), ("w13_scale", w13_scale), ("w2_packed", w2_packed),
                         ("w2_scale", w2_scale)):
        if tensor.dtype != torch.uint8 or tensor.dim() != 3:
            raise ValueError(f"moe_experts_mxfp4: {name} must be a uint8 [E, N, K/...] tensor, got "
                             f"{tensor.dtype} {tuple(tensor.shape)}")
    num_experts, two_inter, half_hidden = w13_packed.shape
    hidden, inter = 2 * half_hidden, two_inter // 2
    expected = {"w13_scale": (num_experts, two_inter, hidden // BLOCK_SIZE),
                "w2_packed": (num_experts, hidden, inter // 2), "w2_scale": (num_experts, hidden, inter // BLOCK_SIZE)}
    got = {"w13_scale": w13_scale.shape, "w2_packed": w2_packed.shape, "w2_scale": w2_scale.shape}
    if x.dim() != 2 or x.shape[-1] != hidden or hidden % BLOCK_SIZE or inter % BLOCK_SIZE or two_inter % 2 or any(
            tuple(got[k]) != v for k, v in expected.items()):
        raise ValueError(f"moe_experts_mxfp4: x {tuple(x.shape)}, w13_packed {tuple(w13_packed.shape)}, w13_scale "
                         f"{tuple(w13_scale.shape)}, w2_packed {tuple(w2_packed.shape)}, w2_scale "
                         f"{tuple(w2_scale.shape)} must be [T, D], [E, 2I, D/2], [E, 2I, D/32], [E, D, I/2], "
                         f"[E, D, I/32] with D and I multiples of {BLOCK_SIZE}")
    if weights.shape != expert_ids.shape or weights.shape[0] != x.shape[0]:
        raise ValueError(f"moe_experts_mxfp4: weights {tuple(weights.shape)} and expert_ids "
                         f"{tuple(expert_ids.shape)} must both be [T, k] with T={x.shape[0]}")
    return hidden, inter


def moe_experts_mxfp4(x: torch.Tensor, w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor,
                      w2_scale: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, activation: str,
                      situ_beta: float | None, situ_linear_beta: float | None,
                      expert_offset: int = 0, *, max_scale: int | None = None) -> torch.Tensor:
    """x [T, D], MXFP4 w13 [E, 2I, D] and w2 [E, D, I] (packed + scale), weights/expert_ids [T, k] -> y [T, D].

    y_t = sum_j weights[t, j] * W2_e act(W13_e x_t), e = expert_ids[t, j] - expert_offset, ids outside
    [expert_offset, expert_offset + E) contribute nothing; one host sync per call for the per-expert counts.
    `max_scale` is the caller's bound on every scale byte (kernels may use it; the result does not depend on it):
    checked here, so that a wrong bound fails on the CPU instead of giving wrong numbers on a GPU.
    """
    hidden, _ = check_mxfp4_experts(x, w13_packed, w13_scale, w2_packed, w2_scale, weights, expert_ids)
    if max_scale is not None:
        largest = max_scale_of(w13_scale, w2_scale)
        if largest > max_scale:
            raise ValueError(f"moe_experts_mxfp4: max_scale={max_scale} but a scale byte is {largest}; pass "
                             "the bound the scales have (max_scale_of) or None")
    num_experts = w13_packed.shape[0]
    dtype = compute_dtype(x, weights)
    y = torch.zeros(x.shape[0], hidden, dtype=dtype, device=x.device)                  # [T, D]
    local = (expert_ids.long() - expert_offset).flatten()                                # [T * k]
    mine = (local >= 0) & (local < num_experts)
    order = torch.argsort(torch.where(mine, local, num_experts), stable=True)           # other ranks' pairs last
    counts = torch.bincount(local[mine], minlength=num_experts).tolist()
    top_k = expert_ids.shape[1]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // top_k                                                          # [n]
        w13 = dequantize_mxfp4(w13_packed[expert], w13_scale[expert], dtype)             # [2I, D]
        w2 = dequantize_mxfp4(w2_packed[expert], w2_scale[expert], dtype)                # [D, I]
        act = glu_activation(x[tokens].to(dtype) @ w13.T, activation, situ_beta, situ_linear_beta)  # [n, I]
        y.index_add_(0, tokens, (act @ w2.T) * weights.flatten()[pairs].to(dtype)[:, None])
    return y.to(x.dtype)

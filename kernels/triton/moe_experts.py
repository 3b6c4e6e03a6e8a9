"""Grouped expert GEMM over the expert width: act(x W13^T) W2^T per expert, combined in float32.

1. Bookkeeping (torch, on the device, no host sync): the (token, choice) pairs are sorted by local expert and laid
   out in blocks of BLOCK_M rows that each belong to one expert (an expert's last block is padded with a sentinel).
   Pairs routed to experts of other ranks (expert parallelism) are dropped here.
2. Gate/up kernel: per (row block, column block of I) both halves of W13 in one K loop, SiLU/SiTU fused in float32,
   the activation stored in x's dtype in sorted order.
3. Down kernel: per (row block, column block of D) the W2 GEMM, scaled by the routing weight, written in float32 to
   the pair's own row (no atomics, so results do not depend on scheduling).
4. Combine kernel: each token sums its k rows in a fixed order, in float32, and casts once.
Token chunks bound the float32 pair buffer (T * k * D * 4 bytes) to about 1 GiB.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.triton.activation import check_activation, glu_f32
from kernels.triton.tuning_ops import moe_gemm_config

PAIR_BUFFER_BYTES = 1 << 30


class ExpertBlocks(NamedTuple):
    sorted_pairs: torch.Tensor     # int64 [num_blocks * BLOCK_M]: pair index t * k + j, num_pairs in padding rows
    block_experts: torch.Tensor    # int64 [num_blocks]: local expert of each block, num_experts for an idle block


def group_pairs_by_expert(expert_ids: torch.Tensor, expert_offset: int, num_experts: int,
                          block_m: int) -> ExpertBlocks:
    """Sort the (token, choice) pairs by local expert into BLOCK_M-row blocks of one expert each.

    The number of blocks is the static bound cdiv(P, BLOCK_M) + E (each expert adds at most one partial block),
    so nothing here waits for the device; blocks past the last expert's are idle."""
    local = expert_ids.reshape(-1).long() - expert_offset                       # [P]
    num_pairs = local.numel()
    mine = (local >= 0) & (local < num_experts)
    key = torch.where(mine, local, torch.full_like(local, num_experts))         # other ranks' pairs sort last
    order = torch.argsort(key, stable=True)                                     # [P]
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=local.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]                                               # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded                                          # [E]
    count_start = torch.cumsum(counts, 0) - counts                              # [E]
    sorted_key = key[order]                                                     # [P]
    safe_key = sorted_key.clamp(max=num_experts - 1)
    rank_in_expert = torch.arange(num_pairs, device=local.device) - count_start[safe_key]
    num_blocks = triton.cdiv(num_pairs, block_m) + num_experts
    capacity = num_blocks * block_m
    # pairs of other ranks go to one extra dump row that is cut off below
    destination = torch.where(sorted_key < num_experts, padded_start[safe_key] + rank_in_expert,
                              torch.full_like(sorted_key, capacity))
    sorted_pairs = torch.full((capacity + 1,), num_pairs, dtype=torch.long, device=local.device)
    sorted_pairs.scatter_(0, destination, order)
    block_starts = torch.arange(num_blocks, device=local.device) * block_m
    block_experts = torch.searchsorted(padded_end, block_starts, right=True)    # [num_blocks], E when idle
    return ExpertBlocks(sorted_pairs[:capacity], block_experts)


@triton.jit
def _gate_up_kernel(x_ptr, w13_ptr, hidden_ptr, sorted_pairs_ptr, block_experts_ptr,
                    x_row_stride, w13_expert_stride, w13_row_stride, hidden_row_stride,
                    num_pairs, num_experts, hidden_dim, inter_dim, beta, linear_beta,
                    TOP_K: tl.constexpr, IS_SITU: tl.constexpr, HAS_LINEAR_CLIP: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert >= num_experts:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)                               # sorted positions
    pairs = tl.load(sorted_pairs_ptr + rows)                                     # [BLOCK_M]
    row_mask = pairs < num_pairs
    tokens = pairs // TOP_K
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                    # [BLOCK_N] of I
    col_mask = cols < inter_dim
    w_gate = w13_ptr + expert.to(tl.int64) * w13_expert_stride + cols[None, :].to(tl.int64) * w13_row_stride
    w_up = w_gate + inter_dim * w13_row_stride
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k_start in range(0, hidden_dim, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_mask = ks < hidden_dim
        x_tile = tl.load(x_ptr + tokens[:, None] * x_row_stride + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                         other=0.0)                                              # [BLOCK_M, BLOCK_K]
        w_mask = k_mask[:, None] & col_mask[None, :]
        gate_tile = tl.load(w_gate + ks[:, None], mask=w_mask, other=0.0)        # [BLOCK_K, BLOCK_N]
        up_tile = tl.load(w_up + ks[:, None], mask=w_mask, other=0.0)            # [BLOCK_K, BLOCK_N]
        acc_gate = tl.dot(x_tile, gate_tile, acc_gate, input_precision="ieee")
        acc_up = tl.dot(x_tile, up_tile, acc_up, input_precision="ieee")
    hidden = glu_f32(acc_gate, acc_up, IS_SITU, HAS_LINEAR_CLIP, beta, linear_beta)
    tl.store(hidden_ptr + rows[:, None].to(tl.int64) * hidden_row_stride + cols[None, :],
             hidden.to(hidden_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _down_kernel(hidden_ptr, w2_ptr, pair_out_ptr, sorted_pairs_ptr, block_experts_ptr, route_weights_ptr,
                 hidden_row_stride, w2_expert_stride, w2_row_stride, pair_out_row_stride,
                 num_pairs, num_experts, hidden_dim, inter_dim,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert >= num_experts:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)                                     # [BLOCK_M]
    row_mask = pairs < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                    # [BLOCK_N] of D
    col_mask = cols < hidden_dim
    w_rows = w2_ptr + expert.to(tl.int64) * w2_expert_stride + cols[None, :].to(tl.int64) * w2_row_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k_start in range(0, inter_dim, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_mask = ks < inter_dim
        h_tile = tl.load(hidden_ptr + rows[:, None].to(tl.int64) * hidden_row_stride + ks[None, :],
                         mask=row_mask[:, None] & k_mask[None, :], other=0.0)   # [BLOCK_M, BLOCK_K]
        w_tile = tl.load(w_rows + ks[:, None], mask=k_mask[:, None] & col_mask[None, :],
                         other=0.0)                                              # [BLOCK_K, BLOCK_N]
        acc = tl.dot(h_tile, w_tile, acc, input_precision="ieee")
    route_weight = tl.load(route_weights_ptr + pairs, mask=row_mask, other=0.0)  # [BLOCK_M] float32
    tl.store(pair_out_ptr + pairs[:, None] * pair_out_row_stride + cols[None, :], acc * route_weight[:, None],
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _combine_kernel(pair_out_ptr, expert_ids_ptr, out_ptr, pair_out_row_stride, out_row_stride, expert_offset,
                    num_experts, hidden_dim, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden_dim
    acc = tl.zeros((BLOCK,), tl.float32)
    for choice in tl.static_range(TOP_K):
        local = tl.load(expert_ids_ptr + token * TOP_K + choice) - expert_offset
        mine = (local >= 0) & (local < num_experts)
        acc += tl.load(pair_out_ptr + (token * TOP_K + choice) * pair_out_row_stride + cols, mask=mask & mine,
                       other=0.0)
    tl.store(out_ptr + token * out_row_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _experts_chunk(x, w13, w2, weights, expert_ids, activation, situ_beta, situ_linear_beta, expert_offset, out):
    num_tokens, hidden_dim = x.shape
    num_experts, two_inter, _ = w13.shape
    inter_dim = two_inter // 2
    top_k = expert_ids.shape[1]
    num_pairs = num_tokens * top_k
    config = moe_gemm_config(x.device, num_pairs)
    blocks = group_pairs_by_expert(expert_ids, expert_offset, num_experts, config.block_m)
    num_blocks = blocks.block_experts.numel()
    hidden = torch.empty(num_blocks * config.block_m, inter_dim, dtype=x.dtype, device=x.device)  # [P_pad, I]
    pair_out = torch.empty(num_pairs, hidden_dim, dtype=torch.float32, device=x.device)           # [P, D]
    route_weights = weights.reshape(-1).to(torch.float32).contiguous()                            # [P]
    launch = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter_dim, config.block_n))](
        x, w13, hidden, blocks.sorted_pairs, blocks.block_experts,
        x.stride(0), w13.stride(0), w13.stride(1), hidden.stride(0),
        num_pairs, num_experts, hidden_dim, inter_dim, float(situ_beta if situ_beta is not None else 1.0),
        float(situ_linear_beta) if situ_linear_beta is not None else 1.0,
        TOP_K=top_k, IS_SITU=activation == "situ", HAS_LINEAR_CLIP=situ_linear_beta is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, **launch)
    _down_kernel[(num_blocks, triton.cdiv(hidden_dim, config.block_n))](
        hidden, w2, pair_out, blocks.sorted_pairs, blocks.block_experts, route_weights,
        hidden.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0),
        num_pairs, num_experts, hidden_dim, inter_dim,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, **launch)
    combine_block = min(1024, triton.next_power_of_2(hidden_dim))
    _combine_kernel[(num_tokens, triton.cdiv(hidden_dim, combine_block))](
        pair_out, expert_ids, out, pair_out.stride(0), out.stride(0), expert_offset, num_experts, hidden_dim,
        TOP_K=top_k, BLOCK=combine_block, num_warps=4 if combine_block >= 512 else 1)


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                expert_ids: torch.Tensor, activation: str, situ_beta: float | None, situ_linear_beta: float | None,
                expert_offset: int = 0) -> torch.Tensor:
    check_activation(activation, situ_beta)
    num_tokens, hidden_dim = x.shape
    num_experts, two_inter, w13_width = w13.shape
    if w13_width != hidden_dim or tuple(w2.shape) != (num_experts, hidden_dim, two_inter // 2):
        raise ValueError(f"moe_experts: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} must be "
                         f"[T, D], [E, 2I, D], [E, D, I]")
    if weights.shape != expert_ids.shape or weights.shape[0] != num_tokens:
        raise ValueError(f"moe_experts: weights {tuple(weights.shape)} and expert_ids {tuple(expert_ids.shape)} "
                         f"must both be [T, k] with T={num_tokens}")
    x, w13, w2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, w13, w2))
    expert_ids = expert_ids.long().contiguous()
    out = torch.empty(num_tokens, hidden_dim, dtype=x.dtype, device=x.device)   # [T, D]
    if num_tokens == 0 or expert_ids.shape[1] == 0:
        return out.zero_()
    top_k = expert_ids.shape[1]
    chunk = max(1, PAIR_BUFFER_BYTES // (top_k * hidden_dim * 4))
    for start in range(0, num_tokens, chunk):
        end = min(num_tokens, start + chunk)
        _experts_chunk(x[start:end], w13, w2, weights[start:end], expert_ids[start:end], activation, situ_beta,
                       situ_linear_beta, expert_offset, out[start:end])
    return out

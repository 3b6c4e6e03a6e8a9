"""Grouped expert GEMM over the expert width: act(x W13^T) W2^T per expert, combined in float32.

1. Bookkeeping (`kernels.triton.moe_blocks`, on the device, no host sync): the (token, choice) pairs are sorted by
   local expert and laid out in blocks of BLOCK_M rows that each belong to one expert (an expert's last block is
   padded with a sentinel). Pairs routed to experts of other ranks (expert parallelism) are dropped here.
2. Gate/up kernel: per (row block, column block of I) both halves of W13 in one K loop, SiLU/SiTU fused in float32,
   the activation stored in x's dtype in sorted order.
3. Down kernel: per (row block, column block of D) the W2 GEMM, written in float32 to the same sorted row (no atomics,
   so results do not depend on scheduling).
4. Combine kernel (`combine_expert_rows`, shared with the torch._grouped_mm provider): each token gathers its k rows,
   scales each by its routing weight and sums them in a fixed order, in float32, and casts once.
Token chunks bound the float32 row buffer ((T * k + E * BLOCK_M) * D * 4 bytes) to about 1 GiB plus the padding.
`bench/tune_moe.py` times `gate_up` and `down` alone over their launch parameters (see `moe_gemm_config`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.activation import check_activation, glu_f32
from kernels.triton.moe_blocks import ExpertBlocks, group_pairs_by_expert
from kernels.triton.tuning_ops import GemmConfig, moe_gemm_config

PAIR_BUFFER_BYTES = 1 << 30


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
def _down_kernel(hidden_ptr, w2_ptr, rows_out_ptr, sorted_pairs_ptr, block_experts_ptr,
                 hidden_row_stride, w2_expert_stride, w2_row_stride, rows_out_row_stride,
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
    tl.store(rows_out_ptr + rows[:, None].to(tl.int64) * rows_out_row_stride + cols[None, :],
             acc.to(rows_out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _combine_kernel(rows_ptr, row_of_pair_ptr, weights_ptr, expert_ids_ptr, out_ptr, rows_row_stride,
                    out_row_stride, expert_offset, num_experts, hidden_dim, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden_dim
    acc = tl.zeros((BLOCK,), tl.float32)
    for choice in tl.static_range(TOP_K):
        pair = token * TOP_K + choice
        local = tl.load(expert_ids_ptr + pair) - expert_offset
        mine = (local >= 0) & (local < num_experts)
        # a foreign pair's row index and weight are never used: its row may be a dump slot or garbage
        row = tl.load(row_of_pair_ptr + pair, mask=mine, other=0)
        weight = tl.load(weights_ptr + pair, mask=mine, other=0.0)
        values = tl.load(rows_ptr + row * rows_row_stride + cols, mask=mask & mine, other=0.0)
        acc += values.to(tl.float32) * weight
    tl.store(out_ptr + token * out_row_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine_expert_rows(rows: torch.Tensor, row_of_pair: torch.Tensor, weights: torch.Tensor,
                        expert_ids: torch.Tensor, expert_offset: int, num_experts: int, out: torch.Tensor) -> None:
    """out[t] = sum_j weights[t, j] * rows[row_of_pair[t * k + j]] over the pairs whose expert is local, in float32
    in the order j = 0..k-1 (deterministic: no atomics). rows [R, D] any float dtype; weights, expert_ids [T, k]."""
    num_tokens, top_k = expert_ids.shape
    hidden_dim = out.shape[1]
    if num_tokens == 0:
        return
    weights = weights.reshape(-1).to(torch.float32).contiguous()                 # [P]
    block = min(1024, triton.next_power_of_2(hidden_dim))
    _combine_kernel[(num_tokens, triton.cdiv(hidden_dim, block))](
        rows, row_of_pair.contiguous(), weights, expert_ids.long().contiguous(), out, rows.stride(0), out.stride(0),
        expert_offset, num_experts, hidden_dim, TOP_K=top_k, BLOCK=block, num_warps=4 if block >= 512 else 1)


def gate_up(x: torch.Tensor, w13: torch.Tensor, blocks: ExpertBlocks, top_k: int, activation: str,
            situ_beta: float | None, situ_linear_beta: float | None, block_m: int, tile: GemmConfig) -> torch.Tensor:
    """act(x W13^T) for every sorted row -> [num_blocks * block_m, I] in x.dtype (padding rows left unwritten)."""
    num_pairs = blocks.row_of_pair.numel()
    num_experts, two_inter, hidden_dim = w13.shape
    inter_dim = two_inter // 2
    num_blocks = blocks.block_experts.numel()
    hidden = torch.empty(num_blocks * block_m, inter_dim, dtype=x.dtype, device=x.device)  # [P_pad, I]
    _gate_up_kernel[(num_blocks, triton.cdiv(inter_dim, tile.block_n))](
        x, w13, hidden, blocks.sorted_pairs, blocks.block_experts,
        x.stride(0), w13.stride(0), w13.stride(1), hidden.stride(0),
        num_pairs, num_experts, hidden_dim, inter_dim, float(situ_beta if situ_beta is not None else 1.0),
        float(situ_linear_beta) if situ_linear_beta is not None else 1.0,
        TOP_K=top_k, IS_SITU=activation == "situ", HAS_LINEAR_CLIP=situ_linear_beta is not None,
        BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, num_warps=tile.num_warps,
        num_stages=tile.num_stages)
    return hidden


def down(hidden: torch.Tensor, w2: torch.Tensor, blocks: ExpertBlocks, block_m: int, tile: GemmConfig) -> torch.Tensor:
    """hidden W2^T for every sorted row -> [num_blocks * block_m, D] float32 (padding rows left unwritten)."""
    num_pairs = blocks.row_of_pair.numel()
    num_experts, hidden_dim, inter_dim = w2.shape
    num_blocks = blocks.block_experts.numel()
    rows_out = torch.empty(num_blocks * block_m, hidden_dim, dtype=torch.float32, device=hidden.device)  # [P_pad, D]
    _down_kernel[(num_blocks, triton.cdiv(hidden_dim, tile.block_n))](
        hidden, w2, rows_out, blocks.sorted_pairs, blocks.block_experts,
        hidden.stride(0), w2.stride(0), w2.stride(1), rows_out.stride(0),
        num_pairs, num_experts, hidden_dim, inter_dim,
        BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, num_warps=tile.num_warps,
        num_stages=tile.num_stages)
    return rows_out


def _experts_chunk(x, w13, w2, weights, expert_ids, activation, situ_beta, situ_linear_beta, expert_offset, out):
    num_experts = w13.shape[0]
    top_k = expert_ids.shape[1]
    config = moe_gemm_config(x.device, x.shape[0] * top_k, x.element_size())
    blocks = group_pairs_by_expert(expert_ids, expert_offset, num_experts, config.block_m)
    hidden = gate_up(x, w13, blocks, top_k, activation, situ_beta, situ_linear_beta, config.block_m, config.gate_up)
    rows_out = down(hidden, w2, blocks, config.block_m, config.down)
    combine_expert_rows(rows_out, blocks.row_of_pair, weights, expert_ids, expert_offset, num_experts, out)


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

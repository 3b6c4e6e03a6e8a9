"""Grouped expert GEMM over the expert width: act(x W13^T) W2^T per expert, combined in float32.

1. Bookkeeping (`kernels.triton.moe_blocks`, on the device, no host sync): the (token, choice) pairs are sorted by
   local expert and laid out in blocks of BLOCK_M rows that each belong to one expert (an expert's last block is
   padded with a sentinel). Pairs routed to experts of other ranks (expert parallelism) are dropped here.
2. Gate/up kernel: per (row block, column block of I) both halves of W13 in one K loop, SiLU/SiTU fused in float32,
   the activation stored in x's dtype in sorted order. The halves are two dots per K step, or one dot over a weight
   operand of the gate and the up columns together (`GemmConfig.fused_gate_up`: the x tile is read once per K step
   and the MMA is twice as wide), its accumulator split into gate and up after the loop; a descriptor then
   addresses W13 as [E, 2, I, D].
3. Down kernel: per (row block, column block of D) the W2 GEMM, written in float32 to the same sorted row (no atomics,
   so results do not depend on scheduling).
   Both GEMM kernels can take a row block as two halves that share each weight tile (`GemmConfig.sub_blocks`),
   the second skipped when it is all padding, and can read the weight tiles through a tensor descriptor
   (`GemmConfig.weight_desc`, TMA on sm90+; the weights are then addressed as [E * N, K] rows, and a tile that runs
   past an expert's rows only reaches output columns that the store masks). Why: at K3 prefill the measurements
   point at L2 traffic, each row block reading its expert's weights once (bench/README.md); taller row tiles cut it.
4. Combine kernel (`combine_expert_rows`, shared with the torch._grouped_mm provider): each token gathers its k rows,
   scales each by its routing weight and sums them in a fixed order, in float32, and casts once.
Token chunks bound the float32 row buffer ((T * k + E * BLOCK_M) * D * 4 bytes) to about 1 GiB plus the padding.
`tools/tune/tune_moe.py` times `gate_up` and `down` alone over their launch parameters (see `moe_gemm_config`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.triton.activation import check_activation, glu_f32
from kernels.triton.moe_blocks import ExpertBlocks, group_pairs_by_expert
from kernels.triton.tuning_ops import GemmConfig, MoeGemmConfig, moe_gemm_config, nvidia_capability, target

PAIR_BUFFER_BYTES = 1 << 30


@triton.jit
def _weight_tile(w, expert, row_stride_or_rows, expert_stride, row0, cols, col_mask, k_start, ks, k_mask,
                 DESC: tl.constexpr):
    """[BLOCK_K, BLOCK_N] of W^T for output columns `cols` of one expert: W is [E, N, K] behind a pointer, or
    [E * N, K] behind a descriptor (then row_stride_or_rows is N, and rows past the expert's are clipped by the
    caller's store)."""
    if DESC:
        tile = w.load([expert.to(tl.int32) * row_stride_or_rows + row0, k_start]).T
    else:
        rows = w + expert.to(tl.int64) * expert_stride + cols[None, :].to(tl.int64) * row_stride_or_rows
        tile = tl.load(rows + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
    return tile


@triton.jit
def _sub_blocks_used(sorted_pairs_ptr, block, num_pairs, BLOCK_M: tl.constexpr, SUB: tl.constexpr,
                     SUB_BLOCKS: tl.constexpr):
    """How many of the block's sub-blocks hold a pair (1 to SUB_BLOCKS): padding sits at the end of an expert's
    rows, so sub-block s is used iff its first row is a pair, and the used ones come first."""
    used = 1
    if SUB_BLOCKS >= 2:
        used += (tl.load(sorted_pairs_ptr + block * BLOCK_M + SUB) < num_pairs).to(tl.int32)
    if SUB_BLOCKS >= 3:
        used += (tl.load(sorted_pairs_ptr + block * BLOCK_M + 2 * SUB) < num_pairs).to(tl.int32)
    return used


@triton.jit
def _sub_block_rows(sorted_pairs_ptr, block, num_pairs, index: tl.constexpr, BLOCK_M: tl.constexpr,
                    SUB: tl.constexpr):
    """Sorted positions [SUB] of sub-block `index` and the pair in each (num_pairs past the block: padding)."""
    rows = block * BLOCK_M + index * SUB + tl.arange(0, SUB)
    pairs = tl.load(sorted_pairs_ptr + rows, mask=rows < (block + 1) * BLOCK_M, other=num_pairs)
    return rows, pairs


@triton.jit
def _store_rows(out_ptr, rows, row_stride, row_mask, cols, col_mask, values):
    """values [SUB, BLOCK_N] to the sorted rows `rows` (routed rows only), cast to the output's dtype."""
    tl.store(out_ptr + rows[:, None].to(tl.int64) * row_stride + cols[None, :], values.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _gate_up_accumulate(x_rows_a, mask_a, x_rows_b, mask_b, x_rows_c, mask_c, w13, expert, w13_row_stride,
                        w13_expert_stride, col0, cols, col_mask, hidden_dim, inter_dim, SUB: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USED: tl.constexpr, DESC: tl.constexpr):
    """The K loop of gate/up for the first USED sub-blocks (a; b when USED >= 2; c when 3), all sharing each weight
    tile."""
    acc_gate_a = tl.zeros((SUB, BLOCK_N), tl.float32)
    acc_up_a = tl.zeros((SUB, BLOCK_N), tl.float32)
    acc_gate_b = tl.zeros((SUB, BLOCK_N), tl.float32)
    acc_up_b = tl.zeros((SUB, BLOCK_N), tl.float32)
    acc_gate_c = tl.zeros((SUB, BLOCK_N), tl.float32)
    acc_up_c = tl.zeros((SUB, BLOCK_N), tl.float32)
    # a descriptor addresses W13 as [E * 2I, D] rows (stride argument = 2I); pointers as [E, 2I, D]
    rows_or_stride = 2 * inter_dim if DESC else w13_row_stride
    for k_start in range(0, hidden_dim, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_mask = ks < hidden_dim
        gate_tile = _weight_tile(w13, expert, rows_or_stride, w13_expert_stride, col0, cols, col_mask, k_start, ks,
                                 k_mask, DESC)                                    # [BLOCK_K, BLOCK_N]
        up_tile = _weight_tile(w13, expert, rows_or_stride, w13_expert_stride, col0 + inter_dim, cols + inter_dim,
                               col_mask, k_start, ks, k_mask, DESC)
        x_a = tl.load(x_rows_a + ks[None, :], mask=mask_a[:, None] & k_mask[None, :], other=0.0)   # [SUB, BLOCK_K]
        acc_gate_a = tl.dot(x_a, gate_tile, acc_gate_a, input_precision="ieee")
        acc_up_a = tl.dot(x_a, up_tile, acc_up_a, input_precision="ieee")
        if USED >= 2:
            x_b = tl.load(x_rows_b + ks[None, :], mask=mask_b[:, None] & k_mask[None, :], other=0.0)
            acc_gate_b = tl.dot(x_b, gate_tile, acc_gate_b, input_precision="ieee")
            acc_up_b = tl.dot(x_b, up_tile, acc_up_b, input_precision="ieee")
        if USED >= 3:
            x_c = tl.load(x_rows_c + ks[None, :], mask=mask_c[:, None] & k_mask[None, :], other=0.0)
            acc_gate_c = tl.dot(x_c, gate_tile, acc_gate_c, input_precision="ieee")
            acc_up_c = tl.dot(x_c, up_tile, acc_up_c, input_precision="ieee")
    return acc_gate_a, acc_up_a, acc_gate_b, acc_up_b, acc_gate_c, acc_up_c


@triton.jit
def _gate_up_weight_tile(w13, expert, w13_row_stride, w13_expert_stride, col0, inter_dim, k_start, ks, k_mask,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DESC: tl.constexpr):
    """[BLOCK_K, 2 * BLOCK_N] of W13^T for the fused form: gate rows col0.. then up rows I + col0.. of one expert.
    A descriptor addresses W13 as [E, 2, I, D], both halves in one [1, 2, BLOCK_N, BLOCK_K] block: columns past I
    are zero-filled at dim 2's bound. Pointer rows are masked to columns < I in each half: past I the up half would
    run into the next expert, or off the end of W13 for the last one."""
    if DESC:
        tile = w13.load([expert.to(tl.int32), 0, col0, k_start]).reshape(2 * BLOCK_N, BLOCK_K).T
    else:
        j = tl.arange(0, 2 * BLOCK_N)
        cols = col0 + j % BLOCK_N                                                # column of I in either half
        rows = tl.where(j < BLOCK_N, cols, inter_dim + cols)                     # [2 * BLOCK_N] rows of W13
        tile = _weight_tile(w13, expert, w13_row_stride, w13_expert_stride, col0, rows, cols < inter_dim, k_start,
                            ks, k_mask, False)
    return tile


@triton.jit
def _split_gate_up(acc, SUB: tl.constexpr, BLOCK_N: tl.constexpr):
    """[SUB, 2 * BLOCK_N] (gate columns, then up columns) -> gate, up [SUB, BLOCK_N]: tl.split takes the last dim
    of size 2, so the halves are moved there first. On sm_90 that stays in registers where a warp group holds whole
    accumulator rows (a thread holds columns c and c + BLOCK_N); with the warps split along the columns (block_n 128
    on 8 warps in two sub-blocks) it goes through shared memory, once per tile after the K loop."""
    return tl.split(tl.permute(tl.reshape(acc, (SUB, 2, BLOCK_N)), (0, 2, 1)))


@triton.jit
def _gate_up_accumulate_fused(x_rows_a, mask_a, x_rows_b, mask_b, x_rows_c, mask_c, w13, expert, w13_row_stride,
                              w13_expert_stride, col0, hidden_dim, inter_dim, SUB: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USED: tl.constexpr, DESC: tl.constexpr):
    """The K loop of gate/up as one dot per sub-block and K step over gate and up columns together
    (`GemmConfig.fused_gate_up`): the x tile feeds one MMA of 2 * BLOCK_N columns instead of two of BLOCK_N.
    Returns the same six [SUB, BLOCK_N] products as `_gate_up_accumulate`."""
    acc_a = tl.zeros((SUB, 2 * BLOCK_N), tl.float32)
    acc_b = tl.zeros((SUB, 2 * BLOCK_N), tl.float32)
    acc_c = tl.zeros((SUB, 2 * BLOCK_N), tl.float32)
    for k_start in range(0, hidden_dim, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_mask = ks < hidden_dim
        w_tile = _gate_up_weight_tile(w13, expert, w13_row_stride, w13_expert_stride, col0, inter_dim, k_start, ks,
                                      k_mask, BLOCK_N, BLOCK_K, DESC)             # [BLOCK_K, 2 * BLOCK_N]
        x_a = tl.load(x_rows_a + ks[None, :], mask=mask_a[:, None] & k_mask[None, :], other=0.0)   # [SUB, BLOCK_K]
        acc_a = tl.dot(x_a, w_tile, acc_a, input_precision="ieee")
        if USED >= 2:
            x_b = tl.load(x_rows_b + ks[None, :], mask=mask_b[:, None] & k_mask[None, :], other=0.0)
            acc_b = tl.dot(x_b, w_tile, acc_b, input_precision="ieee")
        if USED >= 3:
            x_c = tl.load(x_rows_c + ks[None, :], mask=mask_c[:, None] & k_mask[None, :], other=0.0)
            acc_c = tl.dot(x_c, w_tile, acc_c, input_precision="ieee")
    acc_gate_a, acc_up_a = _split_gate_up(acc_a, SUB, BLOCK_N)
    acc_gate_b, acc_up_b = _split_gate_up(acc_b, SUB, BLOCK_N)
    acc_gate_c, acc_up_c = _split_gate_up(acc_c, SUB, BLOCK_N)
    return acc_gate_a, acc_up_a, acc_gate_b, acc_up_b, acc_gate_c, acc_up_c


@triton.jit
def _gate_up_rows(x_ptr, w13, hidden_ptr, sorted_pairs_ptr, block, expert, num_pairs, x_row_stride,
                  w13_expert_stride, w13_row_stride, hidden_row_stride, hidden_dim, inter_dim, beta, linear_beta,
                  TOP_K: tl.constexpr, IS_SITU: tl.constexpr, HAS_LINEAR_CLIP: tl.constexpr,
                  BLOCK_M: tl.constexpr, SUB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  USED: tl.constexpr, DESC: tl.constexpr, FUSED: tl.constexpr):
    """gate/up of the first USED sub-blocks of one row block for one column block: the products (two dots per K
    step, or one fused dot: `GemmConfig.fused_gate_up`), the GLU in float32, the stores."""
    rows_a, pairs_a = _sub_block_rows(sorted_pairs_ptr, block, num_pairs, 0, BLOCK_M, SUB)
    rows_b, pairs_b = _sub_block_rows(sorted_pairs_ptr, block, num_pairs, 1, BLOCK_M, SUB)
    rows_c, pairs_c = _sub_block_rows(sorted_pairs_ptr, block, num_pairs, 2, BLOCK_M, SUB)
    mask_a, mask_b, mask_c = pairs_a < num_pairs, pairs_b < num_pairs, pairs_c < num_pairs
    x_rows_a = x_ptr + (pairs_a // TOP_K)[:, None] * x_row_stride
    x_rows_b = x_ptr + (pairs_b // TOP_K)[:, None] * x_row_stride
    x_rows_c = x_ptr + (pairs_c // TOP_K)[:, None] * x_row_stride
    col0 = tl.program_id(1) * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)                                          # [BLOCK_N] of I
    col_mask = cols < inter_dim
    if FUSED:
        acc_gate_a, acc_up_a, acc_gate_b, acc_up_b, acc_gate_c, acc_up_c = _gate_up_accumulate_fused(
            x_rows_a, mask_a, x_rows_b, mask_b, x_rows_c, mask_c, w13, expert, w13_row_stride, w13_expert_stride,
            col0, hidden_dim, inter_dim, SUB, BLOCK_N, BLOCK_K, USED, DESC)
    else:
        acc_gate_a, acc_up_a, acc_gate_b, acc_up_b, acc_gate_c, acc_up_c = _gate_up_accumulate(
            x_rows_a, mask_a, x_rows_b, mask_b, x_rows_c, mask_c, w13, expert, w13_row_stride, w13_expert_stride,
            col0, cols, col_mask, hidden_dim, inter_dim, SUB, BLOCK_N, BLOCK_K, USED, DESC)
    if USED >= 3:
        hidden_c = glu_f32(acc_gate_c, acc_up_c, IS_SITU, HAS_LINEAR_CLIP, beta, linear_beta)
        _store_rows(hidden_ptr, rows_c, hidden_row_stride, mask_c, cols, col_mask, hidden_c)
    if USED >= 2:
        hidden_b = glu_f32(acc_gate_b, acc_up_b, IS_SITU, HAS_LINEAR_CLIP, beta, linear_beta)
        _store_rows(hidden_ptr, rows_b, hidden_row_stride, mask_b, cols, col_mask, hidden_b)
    hidden_a = glu_f32(acc_gate_a, acc_up_a, IS_SITU, HAS_LINEAR_CLIP, beta, linear_beta)
    _store_rows(hidden_ptr, rows_a, hidden_row_stride, mask_a, cols, col_mask, hidden_a)


@triton.jit
def _gate_up_kernel(x_ptr, w13, hidden_ptr, sorted_pairs_ptr, block_experts_ptr,
                    x_row_stride, w13_expert_stride, w13_row_stride, hidden_row_stride,
                    num_pairs, num_experts, hidden_dim, inter_dim, beta, linear_beta,
                    TOP_K: tl.constexpr, IS_SITU: tl.constexpr, HAS_LINEAR_CLIP: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SUB_BLOCKS: tl.constexpr, DESC: tl.constexpr, FUSED: tl.constexpr):
    """One (row block, column block of I). With SUB_BLOCKS = 2 or 3 the row block is that many sub-blocks that
    share each weight tile, the trailing ones skipped when they hold only padding (see `GemmConfig.sub_blocks`).
    Each count of used sub-blocks is its own K loop, compiled only up to SUB_BLOCKS (a loop over three
    accumulators would set the registers of every program)."""
    SUB: tl.constexpr = BLOCK_M // SUB_BLOCKS
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert >= num_experts:
        return
    used = _sub_blocks_used(sorted_pairs_ptr, block, num_pairs, BLOCK_M, SUB, SUB_BLOCKS)
    # static ifs on SUB_BLOCKS around the runtime ones on `used`: no form is compiled beyond SUB_BLOCKS
    if SUB_BLOCKS == 3:
        if used == 3:
            _gate_up_rows(x_ptr, w13, hidden_ptr, sorted_pairs_ptr, block, expert, num_pairs, x_row_stride,
                          w13_expert_stride, w13_row_stride, hidden_row_stride, hidden_dim, inter_dim, beta,
                          linear_beta, TOP_K, IS_SITU, HAS_LINEAR_CLIP, BLOCK_M, SUB, BLOCK_N, BLOCK_K, 3, DESC,
                          FUSED)
            return
    if SUB_BLOCKS >= 2:
        if used == 2:
            _gate_up_rows(x_ptr, w13, hidden_ptr, sorted_pairs_ptr, block, expert, num_pairs, x_row_stride,
                          w13_expert_stride, w13_row_stride, hidden_row_stride, hidden_dim, inter_dim, beta,
                          linear_beta, TOP_K, IS_SITU, HAS_LINEAR_CLIP, BLOCK_M, SUB, BLOCK_N, BLOCK_K, 2, DESC,
                          FUSED)
            return
    _gate_up_rows(x_ptr, w13, hidden_ptr, sorted_pairs_ptr, block, expert, num_pairs, x_row_stride,
                  w13_expert_stride, w13_row_stride, hidden_row_stride, hidden_dim, inter_dim, beta, linear_beta,
                  TOP_K, IS_SITU, HAS_LINEAR_CLIP, BLOCK_M, SUB, BLOCK_N, BLOCK_K, 1, DESC, FUSED)


@triton.jit
def _down_accumulate(h_rows_a, mask_a, h_rows_b, mask_b, h_rows_c, mask_c, w2, expert, w2_row_stride,
                     w2_expert_stride, col0, cols, col_mask, hidden_dim, inter_dim, SUB: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USED: tl.constexpr, DESC: tl.constexpr):
    acc_a = tl.zeros((SUB, BLOCK_N), tl.float32)
    acc_b = tl.zeros((SUB, BLOCK_N), tl.float32)
    acc_c = tl.zeros((SUB, BLOCK_N), tl.float32)
    rows_or_stride = hidden_dim if DESC else w2_row_stride                      # descriptor: W2 as [E * D, I]
    for k_start in range(0, inter_dim, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_mask = ks < inter_dim
        w_tile = _weight_tile(w2, expert, rows_or_stride, w2_expert_stride, col0, cols, col_mask, k_start, ks,
                              k_mask, DESC)                                       # [BLOCK_K, BLOCK_N]
        h_a = tl.load(h_rows_a + ks[None, :], mask=mask_a[:, None] & k_mask[None, :], other=0.0)   # [SUB, BLOCK_K]
        acc_a = tl.dot(h_a, w_tile, acc_a, input_precision="ieee")
        if USED >= 2:
            h_b = tl.load(h_rows_b + ks[None, :], mask=mask_b[:, None] & k_mask[None, :], other=0.0)
            acc_b = tl.dot(h_b, w_tile, acc_b, input_precision="ieee")
        if USED >= 3:
            h_c = tl.load(h_rows_c + ks[None, :], mask=mask_c[:, None] & k_mask[None, :], other=0.0)
            acc_c = tl.dot(h_c, w_tile, acc_c, input_precision="ieee")
    return acc_a, acc_b, acc_c


@triton.jit
def _down_rows(hidden_ptr, w2, rows_out_ptr, sorted_pairs_ptr, block, expert, num_pairs, hidden_row_stride,
               w2_expert_stride, w2_row_stride, rows_out_row_stride, hidden_dim, inter_dim,
               BLOCK_M: tl.constexpr, SUB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               USED: tl.constexpr, DESC: tl.constexpr):
    """The W2 GEMM of the first USED sub-blocks of one row block for one column block of D, stored in float32."""
    rows_a, pairs_a = _sub_block_rows(sorted_pairs_ptr, block, num_pairs, 0, BLOCK_M, SUB)
    rows_b, pairs_b = _sub_block_rows(sorted_pairs_ptr, block, num_pairs, 1, BLOCK_M, SUB)
    rows_c, pairs_c = _sub_block_rows(sorted_pairs_ptr, block, num_pairs, 2, BLOCK_M, SUB)
    mask_a, mask_b, mask_c = pairs_a < num_pairs, pairs_b < num_pairs, pairs_c < num_pairs
    col0 = tl.program_id(1) * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)                                          # [BLOCK_N] of D
    col_mask = cols < hidden_dim
    h_rows_a = hidden_ptr + rows_a[:, None].to(tl.int64) * hidden_row_stride
    h_rows_b = hidden_ptr + rows_b[:, None].to(tl.int64) * hidden_row_stride
    h_rows_c = hidden_ptr + rows_c[:, None].to(tl.int64) * hidden_row_stride
    acc_a, acc_b, acc_c = _down_accumulate(h_rows_a, mask_a, h_rows_b, mask_b, h_rows_c, mask_c, w2, expert,
                                           w2_row_stride, w2_expert_stride, col0, cols, col_mask, hidden_dim,
                                           inter_dim, SUB, BLOCK_N, BLOCK_K, USED, DESC)
    if USED >= 3:
        _store_rows(rows_out_ptr, rows_c, rows_out_row_stride, mask_c, cols, col_mask, acc_c)
    if USED >= 2:
        _store_rows(rows_out_ptr, rows_b, rows_out_row_stride, mask_b, cols, col_mask, acc_b)
    _store_rows(rows_out_ptr, rows_a, rows_out_row_stride, mask_a, cols, col_mask, acc_a)


@triton.jit
def _down_kernel(hidden_ptr, w2, rows_out_ptr, sorted_pairs_ptr, block_experts_ptr,
                 hidden_row_stride, w2_expert_stride, w2_row_stride, rows_out_row_stride,
                 num_pairs, num_experts, hidden_dim, inter_dim,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SUB_BLOCKS: tl.constexpr, DESC: tl.constexpr):
    """One (row block, column block of D); sub-blocks as in `_gate_up_kernel`."""
    SUB: tl.constexpr = BLOCK_M // SUB_BLOCKS
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert >= num_experts:
        return
    used = _sub_blocks_used(sorted_pairs_ptr, block, num_pairs, BLOCK_M, SUB, SUB_BLOCKS)
    if SUB_BLOCKS == 3:
        if used == 3:
            _down_rows(hidden_ptr, w2, rows_out_ptr, sorted_pairs_ptr, block, expert, num_pairs, hidden_row_stride,
                       w2_expert_stride, w2_row_stride, rows_out_row_stride, hidden_dim, inter_dim, BLOCK_M, SUB,
                       BLOCK_N, BLOCK_K, 3, DESC)
            return
    if SUB_BLOCKS >= 2:
        if used == 2:
            _down_rows(hidden_ptr, w2, rows_out_ptr, sorted_pairs_ptr, block, expert, num_pairs, hidden_row_stride,
                       w2_expert_stride, w2_row_stride, rows_out_row_stride, hidden_dim, inter_dim, BLOCK_M, SUB,
                       BLOCK_N, BLOCK_K, 2, DESC)
            return
    _down_rows(hidden_ptr, w2, rows_out_ptr, sorted_pairs_ptr, block, expert, num_pairs, hidden_row_stride,
               w2_expert_stride, w2_row_stride, rows_out_row_stride, hidden_dim, inter_dim, BLOCK_M, SUB, BLOCK_N,
               BLOCK_K, 1, DESC)


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


def combine_operands(weights: torch.Tensor, expert_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing weights [T, k] as flat contiguous float32 [P] and the expert ids as contiguous int64 [T, k]: what
    the combine reads (here, and folded into `moe_mxfp4_stream`'s down kernel)."""
    return weights.reshape(-1).to(torch.float32).contiguous(), expert_ids.long().contiguous()


def combine_expert_rows(rows: torch.Tensor, row_of_pair: torch.Tensor, weights: torch.Tensor,
                        expert_ids: torch.Tensor, expert_offset: int, num_experts: int, out: torch.Tensor) -> None:
    """out[t] = sum_j weights[t, j] * rows[row_of_pair[t * k + j]] over the pairs whose expert is local, in float32
    in the order j = 0..k-1 (deterministic: no atomics). rows [R, D] any float dtype; weights, expert_ids [T, k]."""
    num_tokens, top_k = expert_ids.shape
    hidden_dim = out.shape[1]
    if num_tokens == 0:
        return
    weights, expert_ids = combine_operands(weights, expert_ids)                 # [P] float32, [T, k] int64
    block = min(1024, triton.next_power_of_2(hidden_dim))
    _combine_kernel[(num_tokens, triton.cdiv(hidden_dim, block))](
        rows, row_of_pair.contiguous(), weights, expert_ids, out, rows.stride(0), out.stride(0),
        expert_offset, num_experts, hidden_dim, TOP_K=top_k, BLOCK=block, num_warps=4 if block >= 512 else 1)


def weight_desc_unavailable(device: torch.device, *weights: torch.Tensor) -> str:
    """Why `GemmConfig.weight_desc` cannot run on `device` for these [E, N, K] expert weights ('' when it can): a
    descriptor needs NVIDIA sm90+ (the interpreter emulates it) and the experts stacked densely with 16-byte
    aligned base and rows, fewer than 2^31 rows in all (its coordinates are int32)."""
    kind = target(device)
    if kind == "amd":
        return "weight descriptors are used only on NVIDIA sm90+ here (no AMD path written or measured)"
    if kind == "nvidia" and nvidia_capability(device)[0] < 9:
        major, minor = nvidia_capability(device)
        return f"weight descriptors need sm90+ (TMA); this GPU is sm{major}{minor}"
    for w in weights:
        if w.stride(2) != 1 or w.stride(0) != w.shape[1] * w.stride(1):
            return f"a descriptor needs densely stacked experts with contiguous rows, got strides {w.stride()}"
        if w.data_ptr() % 16 or (w.stride(1) * w.element_size()) % 16:
            return (f"a descriptor needs 16-byte aligned rows: {tuple(w.shape)} {w.dtype} rows of "
                    f"{w.stride(1) * w.element_size()} bytes at address {w.data_ptr() % 16} mod 16")
        if w.shape[0] * w.shape[1] >= 2 ** 31:
            return f"descriptor coordinates are int32: {w.shape[0] * w.shape[1]} weight rows is too many"
    return ""


def _check_tile(tile: GemmConfig, block_m: int, what: str) -> None:
    sub = block_m // tile.sub_blocks
    if tile.sub_blocks not in (1, 2, 3) or block_m % tile.sub_blocks or sub < 16 or sub & (sub - 1):
        raise ValueError(f"moe_experts {what}: sub_blocks must be 1, 2 or 3 and split block_m into sub-blocks of a "
                         f"power of two >= 16 rows (the dot's smallest tile); got sub_blocks={tile.sub_blocks} with "
                         f"block_m={block_m}")
    if tile.fused_gate_up and what != "gate_up":
        raise ValueError(f"moe_experts {what}: fused_gate_up joins the gate and up weight operands of the gate/up "
                         f"GEMM; the {what} GEMM has one weight operand, so its tile must leave it False")


def _weights_arg(weights: torch.Tensor, tile: GemmConfig, what: str):
    """The kernel's weight argument: the [E, N, K] tensor, or a descriptor of it as [E * N, K] rows, or for the
    fused gate/up W13 as [E, 2, I, K] (one block holds a column tile of both halves)."""
    if not tile.weight_desc:
        return weights
    why = weight_desc_unavailable(weights.device, weights)
    if why:
        raise ValueError(f"moe_experts {what}: weight_desc tiles cannot run here: {why}")
    if tile.fused_gate_up:
        num_experts, two_inter, width = weights.shape
        return TensorDescriptor.from_tensor(weights.view(num_experts, 2, two_inter // 2, width),
                                            [1, 2, tile.block_n, tile.block_k])
    return TensorDescriptor.from_tensor(weights.view(-1, weights.shape[2]), [tile.block_n, tile.block_k])


def gate_up(x: torch.Tensor, w13: torch.Tensor, blocks: ExpertBlocks, top_k: int, activation: str,
            situ_beta: float | None, situ_linear_beta: float | None, block_m: int, tile: GemmConfig) -> torch.Tensor:
    """act(x W13^T) for every sorted row -> [num_blocks * block_m, I] in x.dtype (padding rows left unwritten)."""
    _check_tile(tile, block_m, "gate_up")
    num_pairs = blocks.row_of_pair.numel()
    num_experts, two_inter, hidden_dim = w13.shape
    inter_dim = two_inter // 2
    num_blocks = blocks.block_experts.numel()
    hidden = torch.empty(num_blocks * block_m, inter_dim, dtype=x.dtype, device=x.device)  # [P_pad, I]
    _gate_up_kernel[(num_blocks, triton.cdiv(inter_dim, tile.block_n))](
        x, _weights_arg(w13, tile, "gate_up"), hidden, blocks.sorted_pairs, blocks.block_experts,
        x.stride(0), w13.stride(0), w13.stride(1), hidden.stride(0),
        num_pairs, num_experts, hidden_dim, inter_dim, float(situ_beta if situ_beta is not None else 1.0),
        float(situ_linear_beta) if situ_linear_beta is not None else 1.0,
        TOP_K=top_k, IS_SITU=activation == "situ", HAS_LINEAR_CLIP=situ_linear_beta is not None,
        BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, SUB_BLOCKS=tile.sub_blocks,
        DESC=tile.weight_desc, FUSED=tile.fused_gate_up, num_warps=tile.num_warps,
        num_stages=tile.num_stages)
    return hidden


def down(hidden: torch.Tensor, w2: torch.Tensor, blocks: ExpertBlocks, block_m: int, tile: GemmConfig) -> torch.Tensor:
    """hidden W2^T for every sorted row -> [num_blocks * block_m, D] float32 (padding rows left unwritten)."""
    _check_tile(tile, block_m, "down")
    num_pairs = blocks.row_of_pair.numel()
    num_experts, hidden_dim, inter_dim = w2.shape
    num_blocks = blocks.block_experts.numel()
    rows_out = torch.empty(num_blocks * block_m, hidden_dim, dtype=torch.float32, device=hidden.device)  # [P_pad, D]
    _down_kernel[(num_blocks, triton.cdiv(hidden_dim, tile.block_n))](
        hidden, _weights_arg(w2, tile, "down"), rows_out, blocks.sorted_pairs, blocks.block_experts,
        hidden.stride(0), w2.stride(0), w2.stride(1), rows_out.stride(0),
        num_pairs, num_experts, hidden_dim, inter_dim,
        BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, SUB_BLOCKS=tile.sub_blocks,
        DESC=tile.weight_desc, num_warps=tile.num_warps, num_stages=tile.num_stages)
    return rows_out


def runnable_config(config: MoeGemmConfig, w13: torch.Tensor, w2: torch.Tensor) -> MoeGemmConfig:
    """`config` with weight_desc switched off for a GEMM whose weights a descriptor cannot address (a strided
    expert slice, odd widths, a non-sm90 GPU): the table picks the form for the shapes it was tuned on, and the
    pointer form serves the rest."""
    gate_up_tile, down_tile = config.gate_up, config.down
    if gate_up_tile.weight_desc and weight_desc_unavailable(w13.device, w13):
        gate_up_tile = gate_up_tile._replace(weight_desc=False)
    if down_tile.weight_desc and weight_desc_unavailable(w2.device, w2):
        down_tile = down_tile._replace(weight_desc=False)
    return config._replace(gate_up=gate_up_tile, down=down_tile)


def _experts_chunk(x, w13, w2, weights, expert_ids, activation, situ_beta, situ_linear_beta, expert_offset, out):
    num_experts = w13.shape[0]
    top_k = expert_ids.shape[1]
    config = runnable_config(moe_gemm_config(x.device, x.shape[0] * top_k, x.element_size()), w13, w2)
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

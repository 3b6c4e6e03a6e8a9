"""MXFP4 expert GEMMs with the weight as the dot's first operand ("swap AB"): out^T = W x^T per row block.

Why: at decode an expert has one to a few rows, so `kernels.triton.moe_mxfp4`'s x W^T dot is [16, K] x [K, BLOCK_N]
with at most a few useful rows, and its dequantised weight is the second operand, which on sm_90 wgmma reads from
shared memory: every decoded weight takes a register -> shared memory -> MMA trip. Here the weight tile
[BLOCK_N, HALF_K] is the first operand (wgmma's A may sit in registers, so the decode feeds the MMA directly), the
few token rows are the dot's narrow N (16 and up), and the weight bytes are read along their contiguous K, 16 bytes
per row and scale group. At prefill the same kernel takes tall row blocks (BLOCK_M 64-256 as the dot's N), each
decoded weight tile reused by all of them.

The operands (the in-register decode, x / hidden halves, `tl.dot_scaled`) are in `kernels.triton.moe_mxfp4_operands`.
With a tail (`Mxfp4Tile.tail_m`) a block is BLOCK_M + TAIL_M rows of one expert, and a program whose tail holds a
pair decodes each weight tile once for the dots of both parts (`_gate_up_two`, `_down_two`).
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton.activation import glu_f32
from kernels.triton.moe_mxfp4_operands import (  # noqa: F401  (FOLD_MAX_SCALE is part of this module's API)
    FOLD_MAX_SCALE, _rows_k, _rows_t, _scaled_dot, _weight_rows, _weight_tile)


@triton.jit
def _gate_up_step(acc_gate, acc_up, x_rows, row_mask, w_packed, w_scale, expert, packed_expert_stride,
                  packed_row_stride, scale_expert_stride, scale_row_stride, cols, col_mask, k_start, hidden_dim,
                  inter_dim, HALF_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr,
                  EVEN_K: tl.constexpr, SPLIT_X: tl.constexpr, HALF_MATH: tl.constexpr, ASM_DECODE: tl.constexpr,
                  SCALE_FOLD: tl.constexpr, NATURAL_K: tl.constexpr = False, PRESPLIT: tl.constexpr = False):
    """One K step of gate/up with the in-register decode: four half-K dots (even / odd columns, gate / up), or
    with NATURAL_K two whole-K dots on the decoded halves interleaved back into column order. PRESPLIT: x rows
    arrive [even | odd] per step (`_rows_t`)."""
    if NATURAL_K:
        x_t = _rows_k(x_rows, row_mask, k_start, hidden_dim, 2 * HALF_K, EVEN_K)        # [BLOCK_K, BLOCK_M]
        gate = _weight_tile(w_packed, w_scale, expert, packed_expert_stride, packed_row_stride, scale_expert_stride,
                            scale_row_stride, cols, col_mask, k_start, hidden_dim, HALF_K, BLOCK_N, DTYPE, EVEN_K,
                            HALF_MATH, ASM_DECODE, SCALE_FOLD)
        up = _weight_tile(w_packed, w_scale, expert, packed_expert_stride, packed_row_stride, scale_expert_stride,
                          scale_row_stride, cols + inter_dim, col_mask, k_start, hidden_dim, HALF_K, BLOCK_N, DTYPE,
                          EVEN_K, HALF_MATH, ASM_DECODE, SCALE_FOLD)
        acc_gate = tl.dot(gate, x_t, acc_gate, input_precision="ieee")
        acc_up = tl.dot(up, x_t, acc_up, input_precision="ieee")
        return acc_gate, acc_up
    x_even, x_odd = _rows_t(x_rows, row_mask, k_start, hidden_dim, HALF_K, BLOCK_M, EVEN_K, SPLIT_X, PRESPLIT)
    gate_low, gate_high = _weight_rows(w_packed, w_scale, expert, packed_expert_stride, packed_row_stride,
                                       scale_expert_stride, scale_row_stride, cols, col_mask, k_start, hidden_dim,
                                       HALF_K, BLOCK_N, DTYPE, EVEN_K, HALF_MATH, ASM_DECODE, SCALE_FOLD)
    up_low, up_high = _weight_rows(w_packed, w_scale, expert, packed_expert_stride, packed_row_stride,
                                   scale_expert_stride, scale_row_stride, cols + inter_dim, col_mask, k_start,
                                   hidden_dim, HALF_K, BLOCK_N, DTYPE, EVEN_K, HALF_MATH, ASM_DECODE, SCALE_FOLD)
    acc_gate = tl.dot(gate_low, x_even, acc_gate, input_precision="ieee")
    acc_gate = tl.dot(gate_high, x_odd, acc_gate, input_precision="ieee")
    acc_up = tl.dot(up_low, x_even, acc_up, input_precision="ieee")
    acc_up = tl.dot(up_high, x_odd, acc_up, input_precision="ieee")
    return acc_gate, acc_up


@triton.jit
def _gate_up_swap_kernel(x_ptr, w_packed, w_scale, hidden_ptr, sorted_pairs_ptr, block_experts_ptr,
                         x_row_stride, packed_expert_stride, packed_row_stride, scale_expert_stride, scale_row_stride,
                         hidden_row_stride, num_pairs, num_experts, hidden_dim, inter_dim, beta, linear_beta,
                         TOP_K: tl.constexpr, IS_SITU: tl.constexpr, HAS_LINEAR_CLIP: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN_K: tl.constexpr, SPLIT_X: tl.constexpr, SCALED: tl.constexpr,
                         HALF_MATH: tl.constexpr, ASM_DECODE: tl.constexpr = False,
                         SCALE_FOLD: tl.constexpr = False, NATURAL_K: tl.constexpr = False,
                         PRESPLIT: tl.constexpr = False, STACKED: tl.constexpr = False, TAIL_M: tl.constexpr = 0,
                         EVEN_N: tl.constexpr = False):
    """One (row block, column block of I): gate^T and up^T [BLOCK_N, rows] in one K loop, the GLU in float32,
    stored in x's dtype at the sorted rows. SCALED: the products through `tl.dot_scaled` (bf16 / fp16 x only).
    PRESPLIT: x arrives presplit (`_rows_t`) and hidden is stored presplit for the down kernel (column c of I at
    c's place in its BLOCK_K step's [even | odd] order). STACKED: the program covers BLOCK_N / 2 columns of I, its
    weight tile the BLOCK_N / 2 gate rows over the same columns' up rows: one dot per half-K step into one
    accumulator (half the decoded tiles of two BLOCK_N-row dots in registers at once), split after the loop.
    TAIL_M: blocks of BLOCK_M + TAIL_M rows, each decoded weight tile feeding both parts' dots (`_gate_up_two`)
    when the tail holds a pair, else one dot over the first BLOCK_M rows or, when at most TAIL_M are real, the
    first TAIL_M (padding sits at the end of an expert's last block). EVEN_N: I is a multiple of the program's
    columns, so the weight loads need no row mask (the launcher's `_even_n`)."""
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert >= num_experts:
        return
    if TAIL_M == 0:
        _gate_up_rows(x_ptr, w_packed, w_scale, hidden_ptr, sorted_pairs_ptr, expert, block * BLOCK_M,
                      x_row_stride, packed_expert_stride, packed_row_stride, scale_expert_stride, scale_row_stride,
                      hidden_row_stride, num_pairs, hidden_dim, inter_dim, beta, linear_beta, TOP_K, IS_SITU,
                      HAS_LINEAR_CLIP, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, SPLIT_X, SCALED, HALF_MATH, ASM_DECODE,
                      SCALE_FOLD, NATURAL_K, PRESPLIT, STACKED, EVEN_N)
    else:
        start = block * (BLOCK_M + TAIL_M)
        if tl.load(sorted_pairs_ptr + start + BLOCK_M) < num_pairs:
            _gate_up_two(x_ptr, w_packed, w_scale, hidden_ptr, sorted_pairs_ptr, expert, start, x_row_stride,
                         packed_expert_stride, packed_row_stride, scale_expert_stride, scale_row_stride,
                         hidden_row_stride, num_pairs, hidden_dim, inter_dim, beta, linear_beta, TOP_K, IS_SITU,
                         HAS_LINEAR_CLIP, BLOCK_M, TAIL_M, BLOCK_N, BLOCK_K, EVEN_K, SPLIT_X, HALF_MATH,
                         ASM_DECODE, SCALE_FOLD, PRESPLIT, STACKED, EVEN_N)
        elif tl.load(sorted_pairs_ptr + start + TAIL_M) >= num_pairs:
            _gate_up_rows(x_ptr, w_packed, w_scale, hidden_ptr, sorted_pairs_ptr, expert, start, x_row_stride,
                          packed_expert_stride, packed_row_stride, scale_expert_stride, scale_row_stride,
                          hidden_row_stride, num_pairs, hidden_dim, inter_dim, beta, linear_beta, TOP_K, IS_SITU,
                          HAS_LINEAR_CLIP, TAIL_M, BLOCK_N, BLOCK_K, EVEN_K, SPLIT_X, SCALED, HALF_MATH,
                          ASM_DECODE, SCALE_FOLD, NATURAL_K, PRESPLIT, STACKED, EVEN_N)
        else:
            _gate_up_rows(x_ptr, w_packed, w_scale, hidden_ptr, sorted_pairs_ptr, expert, start, x_row_stride,
                          packed_expert_stride, packed_row_stride, scale_expert_stride, scale_row_stride,
                          hidden_row_stride, num_pairs, hidden_dim, inter_dim, beta, linear_beta, TOP_K, IS_SITU,
                          HAS_LINEAR_CLIP, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, SPLIT_X, SCALED, HALF_MATH,
                          ASM_DECODE, SCALE_FOLD, NATURAL_K, PRESPLIT, STACKED, EVEN_N)


@triton.jit
def _gate_up_rows(x_ptr, w_packed, w_scale, hidden_ptr, sorted_pairs_ptr, expert, start, x_row_stride,
                  packed_expert_stride, packed_row_stride, scale_expert_stride, scale_row_stride, hidden_row_stride,
                  num_pairs, hidden_dim, inter_dim, beta, linear_beta, TOP_K: tl.constexpr, IS_SITU: tl.constexpr,
                  HAS_LINEAR_CLIP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_X: tl.constexpr, SCALED: tl.constexpr,
                  HALF_MATH: tl.constexpr, ASM_DECODE: tl.constexpr, SCALE_FOLD: tl.constexpr,
                  NATURAL_K: tl.constexpr, PRESPLIT: tl.constexpr, STACKED: tl.constexpr, EVEN_N: tl.constexpr):
    """`_gate_up_swap_kernel`'s work for the BLOCK_M sorted rows from `start`."""
    HALF_K: tl.constexpr = BLOCK_K // 2
    rows = start + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_mask = pairs < num_pairs                                        # padding rows hold num_pairs
    x_rows = x_ptr + (pairs // TOP_K).to(tl.int64) * x_row_stride                   # [BLOCK_M] row starts
    if STACKED:
        HALF_N: tl.constexpr = BLOCK_N // 2
        cols = tl.program_id(1) * HALF_N + tl.arange(0, HALF_N)        # [HALF_N] of I
        stack = tl.arange(0, BLOCK_N)
        stack_cols = tl.program_id(1) * HALF_N + stack % HALF_N
        w_rows = tl.where(stack < HALF_N, stack_cols, stack_cols + inter_dim)      # [gate rows | up rows]
        w_mask = (stack_cols < inter_dim) | EVEN_N                     # EVEN_N: a constant, no mask on the loads
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for k_start in range(0, hidden_dim, BLOCK_K):
            x_even, x_odd = _rows_t(x_rows, row_mask, k_start, hidden_dim, HALF_K, BLOCK_M, EVEN_K, SPLIT_X,
                                    PRESPLIT)
            w_low, w_high = _weight_rows(w_packed, w_scale, expert, packed_expert_stride, packed_row_stride,
                                         scale_expert_stride, scale_row_stride, w_rows, w_mask,
                                         k_start, hidden_dim, HALF_K, BLOCK_N, x_ptr.dtype.element_ty, EVEN_K,
                                         HALF_MATH, ASM_DECODE, SCALE_FOLD)
            acc = tl.dot(w_low, x_even, acc, input_precision="ieee")
            acc = tl.dot(w_high, x_odd, acc, input_precision="ieee")
        acc_gate, acc_up = tl.split(tl.permute(tl.reshape(acc, (2, HALF_N, BLOCK_M)), (1, 2, 0)))
        _store_hidden(acc_gate, acc_up, hidden_ptr, hidden_row_stride, rows, row_mask, cols, inter_dim, beta,
                      linear_beta, IS_SITU, HAS_LINEAR_CLIP, BLOCK_K, PRESPLIT)
    else:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)           # [BLOCK_N] of I
        col_mask = (cols < inter_dim) | EVEN_N                          # EVEN_N: a constant, no mask on the loads
        acc_gate = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        X_FORMAT: tl.constexpr = "fp16" if x_ptr.dtype.element_ty == tl.float16 else "bf16"
        for k_start in range(0, hidden_dim, BLOCK_K):
            if SCALED:
                x_t = _rows_k(x_rows, row_mask, k_start, hidden_dim, BLOCK_K, EVEN_K)         # [BLOCK_K, BLOCK_M]
                acc_gate = _scaled_dot(acc_gate, w_packed, w_scale, expert, packed_expert_stride, packed_row_stride,
                                       scale_expert_stride, scale_row_stride, cols, col_mask, k_start, hidden_dim, x_t,
                                       HALF_K, BLOCK_N, EVEN_K, X_FORMAT)
                acc_up = _scaled_dot(acc_up, w_packed, w_scale, expert, packed_expert_stride, packed_row_stride,
                                     scale_expert_stride, scale_row_stride, cols + inter_dim, col_mask, k_start,
                                     hidden_dim, x_t, HALF_K, BLOCK_N, EVEN_K, X_FORMAT)
            else:
                acc_gate, acc_up = _gate_up_step(acc_gate, acc_up, x_rows, row_mask, w_packed, w_scale, expert,
                                                 packed_expert_stride, packed_row_stride, scale_expert_stride,
                                                 scale_row_stride, cols, col_mask, k_start, hidden_dim, inter_dim,
                                                 HALF_K, BLOCK_M, BLOCK_N, x_ptr.dtype.element_ty, EVEN_K, SPLIT_X,
                                                 HALF_MATH, ASM_DECODE, SCALE_FOLD, NATURAL_K, PRESPLIT)
        _store_hidden(acc_gate, acc_up, hidden_ptr, hidden_row_stride, rows, row_mask, cols, inter_dim, beta,
                      linear_beta, IS_SITU, HAS_LINEAR_CLIP, BLOCK_K, PRESPLIT)


@triton.jit
def _gate_up_two(x_ptr, w_packed, w_scale, hidden_ptr, sorted_pairs_ptr, expert, start, x_row_stride,
                 packed_expert_stride, packed_row_stride, scale_expert_stride, scale_row_stride, hidden_row_stride,
                 num_pairs, hidden_dim, inter_dim, beta, linear_beta, TOP_K: tl.constexpr, IS_SITU: tl.constexpr,
                 HAS_LINEAR_CLIP: tl.constexpr, BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_X: tl.constexpr, HALF_MATH: tl.constexpr,
                 ASM_DECODE: tl.constexpr, SCALE_FOLD: tl.constexpr, PRESPLIT: tl.constexpr,
                 STACKED: tl.constexpr, EVEN_N: tl.constexpr):
    """`_gate_up_rows` over the BLOCK_M rows from `start` and the TAIL_M after them at once: one decode of each
    weight tile a K step, its dots against both parts' x (every row of the first part is real: a pair in the
    tail means the block is full up to it)."""
    HALF_K: tl.constexpr = BLOCK_K // 2
    rows = start + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_mask = pairs < num_pairs
    x_rows = x_ptr + (pairs // TOP_K).to(tl.int64) * x_row_stride
    tail_rows = start + BLOCK_M + tl.arange(0, TAIL_M)
    tail_pairs = tl.load(sorted_pairs_ptr + tail_rows)
    tail_mask = tail_pairs < num_pairs
    x_tail = x_ptr + (tail_pairs // TOP_K).to(tl.int64) * x_row_stride
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    if STACKED:
        HALF_N: tl.constexpr = BLOCK_N // 2
        cols = tl.program_id(1) * HALF_N + tl.arange(0, HALF_N)
        stack = tl.arange(0, BLOCK_N)
        stack_cols = tl.program_id(1) * HALF_N + stack % HALF_N
        w_rows = tl.where(stack < HALF_N, stack_cols, stack_cols + inter_dim)
        w_mask = (stack_cols < inter_dim) | EVEN_N
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        acc_tail = tl.zeros((BLOCK_N, TAIL_M), tl.float32)
        for k_start in range(0, hidden_dim, BLOCK_K):
            x_even, x_odd = _rows_t(x_rows, row_mask, k_start, hidden_dim, HALF_K, BLOCK_M, EVEN_K, SPLIT_X,
                                    PRESPLIT)
            t_even, t_odd = _rows_t(x_tail, tail_mask, k_start, hidden_dim, HALF_K, TAIL_M, EVEN_K, SPLIT_X,
                                    PRESPLIT)
            w_low, w_high = _weight_rows(w_packed, w_scale, expert, packed_expert_stride, packed_row_stride,
                                         scale_expert_stride, scale_row_stride, w_rows, w_mask,
                                         k_start, hidden_dim, HALF_K, BLOCK_N, DTYPE, EVEN_K, HALF_MATH, ASM_DECODE,
                                         SCALE_FOLD)
            acc = tl.dot(w_low, x_even, acc, input_precision="ieee")
            acc = tl.dot(w_high, x_odd, acc, input_precision="ieee")
            acc_tail = tl.dot(w_low, t_even, acc_tail, input_precision="ieee")
            acc_tail = tl.dot(w_high, t_odd, acc_tail, input_precision="ieee")
        acc_gate, acc_up = tl.split(tl.permute(tl.reshape(acc, (2, HALF_N, BLOCK_M)), (1, 2, 0)))
        _store_hidden(acc_gate, acc_up, hidden_ptr, hidden_row_stride, rows, row_mask, cols, inter_dim, beta,
                      linear_beta, IS_SITU, HAS_LINEAR_CLIP, BLOCK_K, PRESPLIT)
        tail_gate, tail_up = tl.split(tl.permute(tl.reshape(acc_tail, (2, HALF_N, TAIL_M)), (1, 2, 0)))
        _store_hidden(tail_gate, tail_up, hidden_ptr, hidden_row_stride, tail_rows, tail_mask, cols, inter_dim,
                      beta, linear_beta, IS_SITU, HAS_LINEAR_CLIP, BLOCK_K, PRESPLIT)
    else:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = (cols < inter_dim) | EVEN_N
        acc_gate = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        tail_gate = tl.zeros((BLOCK_N, TAIL_M), tl.float32)
        tail_up = tl.zeros((BLOCK_N, TAIL_M), tl.float32)
        for k_start in range(0, hidden_dim, BLOCK_K):
            x_even, x_odd = _rows_t(x_rows, row_mask, k_start, hidden_dim, HALF_K, BLOCK_M, EVEN_K, SPLIT_X, PRESPLIT)
            t_even, t_odd = _rows_t(x_tail, tail_mask, k_start, hidden_dim, HALF_K, TAIL_M, EVEN_K, SPLIT_X, PRESPLIT)
            gate_low, gate_high = _weight_rows(w_packed, w_scale, expert, packed_expert_stride, packed_row_stride,
                                               scale_expert_stride, scale_row_stride, cols, col_mask, k_start,
                                               hidden_dim, HALF_K, BLOCK_N, DTYPE, EVEN_K, HALF_MATH, ASM_DECODE,
                                               SCALE_FOLD)
            up_low, up_high = _weight_rows(w_packed, w_scale, expert, packed_expert_stride, packed_row_stride,
                                           scale_expert_stride, scale_row_stride, cols + inter_dim, col_mask,
                                           k_start, hidden_dim, HALF_K, BLOCK_N, DTYPE, EVEN_K, HALF_MATH,
                                           ASM_DECODE, SCALE_FOLD)
            acc_gate = tl.dot(gate_low, x_even, acc_gate, input_precision="ieee")
            acc_gate = tl.dot(gate_high, x_odd, acc_gate, input_precision="ieee")
            acc_up = tl.dot(up_low, x_even, acc_up, input_precision="ieee")
            acc_up = tl.dot(up_high, x_odd, acc_up, input_precision="ieee")
            tail_gate = tl.dot(gate_low, t_even, tail_gate, input_precision="ieee")
            tail_gate = tl.dot(gate_high, t_odd, tail_gate, input_precision="ieee")
            tail_up = tl.dot(up_low, t_even, tail_up, input_precision="ieee")
            tail_up = tl.dot(up_high, t_odd, tail_up, input_precision="ieee")
        _store_hidden(acc_gate, acc_up, hidden_ptr, hidden_row_stride, rows, row_mask, cols, inter_dim, beta,
                      linear_beta, IS_SITU, HAS_LINEAR_CLIP, BLOCK_K, PRESPLIT)
        _store_hidden(tail_gate, tail_up, hidden_ptr, hidden_row_stride, tail_rows, tail_mask, cols, inter_dim, beta,
                      linear_beta, IS_SITU, HAS_LINEAR_CLIP, BLOCK_K, PRESPLIT)


@triton.jit
def _store_hidden(acc_gate, acc_up, hidden_ptr, hidden_row_stride, rows, row_mask, cols, inter_dim, beta,
                  linear_beta, IS_SITU: tl.constexpr, HAS_LINEAR_CLIP: tl.constexpr, BLOCK_K: tl.constexpr,
                  PRESPLIT: tl.constexpr):
    """The GLU of gate^T / up^T [columns, rows] in float32, stored in hidden's dtype at the sorted rows (PRESPLIT:
    column c at its place in its BLOCK_K step's [even | odd] order)."""
    hidden = glu_f32(acc_gate, acc_up, IS_SITU, HAS_LINEAR_CLIP, beta, linear_beta)  # [columns, BLOCK_M]
    if PRESPLIT:
        places = cols // BLOCK_K * BLOCK_K + cols % BLOCK_K // 2 + cols % 2 * (BLOCK_K // 2)
    else:
        places = cols
    tl.store(hidden_ptr + rows[None, :].to(tl.int64) * hidden_row_stride + places[:, None],
             hidden.to(hidden_ptr.dtype.element_ty), mask=(cols < inter_dim)[:, None] & row_mask[None, :])


@triton.jit
def _down_swap_kernel(hidden_ptr, w_packed, w_scale, rows_out_ptr, sorted_pairs_ptr, block_experts_ptr,
                      hidden_row_stride, packed_expert_stride, packed_row_stride, scale_expert_stride,
                      scale_row_stride, rows_out_row_stride, num_pairs, num_experts, hidden_dim, inter_dim,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      EVEN_K: tl.constexpr, SPLIT_X: tl.constexpr, SCALED: tl.constexpr,
                      HALF_MATH: tl.constexpr, ASM_DECODE: tl.constexpr = False,
                      SCALE_FOLD: tl.constexpr = False, NATURAL_K: tl.constexpr = False,
                      PRESPLIT: tl.constexpr = False, TAIL_M: tl.constexpr = 0):
    """One (row block, column block of D): (W2 hidden^T) [BLOCK_N, rows] over I, stored in float32 at the
    sorted rows. SCALED: through `tl.dot_scaled`. PRESPLIT: hidden is in gate/up's presplit order. TAIL_M: as in
    `_gate_up_swap_kernel`. The grid is one axis, column blocks fastest: the programs of one row block run
    together and share its hidden rows in L2 (row blocks fastest, each block's hidden was read once per column
    block from DRAM at prefill: 82% of DRAM bandwidth in the down kernel at 1024 tokens,
    bench/results/ncu-moe_mxfp4-b0bd8ce.txt)."""
    col_blocks = tl.cdiv(hidden_dim, BLOCK_N)
    block = tl.program_id(0) // col_blocks
    col_block = tl.program_id(0) % col_blocks
    expert = tl.load(block_experts_ptr + block)
    if expert >= num_experts:
        return
    if TAIL_M == 0:
        _down_rows(hidden_ptr, w_packed, w_scale, rows_out_ptr, sorted_pairs_ptr, expert, block * BLOCK_M, col_block,
                   hidden_row_stride, packed_expert_stride, packed_row_stride, scale_expert_stride, scale_row_stride,
                   rows_out_row_stride, num_pairs, hidden_dim, inter_dim, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                   SPLIT_X, SCALED, HALF_MATH, ASM_DECODE, SCALE_FOLD, NATURAL_K, PRESPLIT)
    else:
        start = block * (BLOCK_M + TAIL_M)
        if tl.load(sorted_pairs_ptr + start + BLOCK_M) < num_pairs:
            _down_two(hidden_ptr, w_packed, w_scale, rows_out_ptr, sorted_pairs_ptr, expert, start, col_block,
                      hidden_row_stride, packed_expert_stride, packed_row_stride, scale_expert_stride,
                      scale_row_stride, rows_out_row_stride, num_pairs, hidden_dim, inter_dim, BLOCK_M, TAIL_M,
                      BLOCK_N, BLOCK_K, EVEN_K, SPLIT_X, HALF_MATH, ASM_DECODE, SCALE_FOLD, PRESPLIT)
        elif tl.load(sorted_pairs_ptr + start + TAIL_M) >= num_pairs:
            _down_rows(hidden_ptr, w_packed, w_scale, rows_out_ptr, sorted_pairs_ptr, expert, start, col_block,
                       hidden_row_stride, packed_expert_stride, packed_row_stride, scale_expert_stride,
                       scale_row_stride, rows_out_row_stride, num_pairs, hidden_dim, inter_dim, TAIL_M, BLOCK_N,
                       BLOCK_K, EVEN_K, SPLIT_X, SCALED, HALF_MATH, ASM_DECODE, SCALE_FOLD, NATURAL_K, PRESPLIT)
        else:
            _down_rows(hidden_ptr, w_packed, w_scale, rows_out_ptr, sorted_pairs_ptr, expert, start, col_block,
                       hidden_row_stride, packed_expert_stride, packed_row_stride, scale_expert_stride,
                       scale_row_stride, rows_out_row_stride, num_pairs, hidden_dim, inter_dim, BLOCK_M, BLOCK_N,
                       BLOCK_K, EVEN_K, SPLIT_X, SCALED, HALF_MATH, ASM_DECODE, SCALE_FOLD, NATURAL_K, PRESPLIT)


@triton.jit
def _down_rows(hidden_ptr, w_packed, w_scale, rows_out_ptr, sorted_pairs_ptr, expert, start, col_block,
               hidden_row_stride,
               packed_expert_stride, packed_row_stride, scale_expert_stride, scale_row_stride, rows_out_row_stride,
               num_pairs, hidden_dim, inter_dim, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_X: tl.constexpr, SCALED: tl.constexpr,
               HALF_MATH: tl.constexpr, ASM_DECODE: tl.constexpr, SCALE_FOLD: tl.constexpr,
               NATURAL_K: tl.constexpr, PRESPLIT: tl.constexpr):
    """`_down_swap_kernel`'s work for the BLOCK_M sorted rows from `start`."""
    HALF_K: tl.constexpr = BLOCK_K // 2
    rows = start + tl.arange(0, BLOCK_M)
    row_mask = tl.load(sorted_pairs_ptr + rows) < num_pairs
    h_rows = hidden_ptr + rows.to(tl.int64) * hidden_row_stride                     # [BLOCK_M] row starts
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)           # [BLOCK_N] of D
    col_mask = cols < hidden_dim
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    X_FORMAT: tl.constexpr = "fp16" if hidden_ptr.dtype.element_ty == tl.float16 else "bf16"
    for k_start in range(0, inter_dim, BLOCK_K):
        if SCALED:
            h_t = _rows_k(h_rows, row_mask, k_start, inter_dim, BLOCK_K, EVEN_K)             # [BLOCK_K, BLOCK_M]
            acc = _scaled_dot(acc, w_packed, w_scale, expert, packed_expert_stride, packed_row_stride,
                              scale_expert_stride, scale_row_stride, cols, col_mask, k_start, inter_dim, h_t, HALF_K,
                              BLOCK_N, EVEN_K, X_FORMAT)
        elif NATURAL_K:
            h_t = _rows_k(h_rows, row_mask, k_start, inter_dim, BLOCK_K, EVEN_K)             # [BLOCK_K, BLOCK_M]
            w = _weight_tile(w_packed, w_scale, expert, packed_expert_stride, packed_row_stride, scale_expert_stride,
                             scale_row_stride, cols, col_mask, k_start, inter_dim, HALF_K, BLOCK_N,
                             hidden_ptr.dtype.element_ty, EVEN_K, HALF_MATH, ASM_DECODE, SCALE_FOLD)
            acc = tl.dot(w, h_t, acc, input_precision="ieee")
        else:
            h_even, h_odd = _rows_t(h_rows, row_mask, k_start, inter_dim, HALF_K, BLOCK_M, EVEN_K, SPLIT_X,
                                    PRESPLIT)
            w_low, w_high = _weight_rows(w_packed, w_scale, expert, packed_expert_stride, packed_row_stride,
                                         scale_expert_stride, scale_row_stride, cols, col_mask, k_start, inter_dim,
                                         HALF_K, BLOCK_N, hidden_ptr.dtype.element_ty, EVEN_K, HALF_MATH,
                                         ASM_DECODE, SCALE_FOLD)
            acc = tl.dot(w_low, h_even, acc, input_precision="ieee")
            acc = tl.dot(w_high, h_odd, acc, input_precision="ieee")
    tl.store(rows_out_ptr + rows[None, :].to(tl.int64) * rows_out_row_stride + cols[:, None], acc,
             mask=col_mask[:, None] & row_mask[None, :])


@triton.jit
def _down_two(hidden_ptr, w_packed, w_scale, rows_out_ptr, sorted_pairs_ptr, expert, start, col_block,
              hidden_row_stride,
              packed_expert_stride, packed_row_stride, scale_expert_stride, scale_row_stride, rows_out_row_stride,
              num_pairs, hidden_dim, inter_dim, BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_X: tl.constexpr, HALF_MATH: tl.constexpr,
              ASM_DECODE: tl.constexpr, SCALE_FOLD: tl.constexpr, PRESPLIT: tl.constexpr):
    """`_down_rows` over the BLOCK_M rows from `start` and the TAIL_M after them, one decode a K step."""
    HALF_K: tl.constexpr = BLOCK_K // 2
    rows = start + tl.arange(0, BLOCK_M)
    row_mask = tl.load(sorted_pairs_ptr + rows) < num_pairs
    h_rows = hidden_ptr + rows.to(tl.int64) * hidden_row_stride
    tail_rows = start + BLOCK_M + tl.arange(0, TAIL_M)
    tail_mask = tl.load(sorted_pairs_ptr + tail_rows) < num_pairs
    h_tail = hidden_ptr + tail_rows.to(tl.int64) * hidden_row_stride
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < hidden_dim
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    acc_tail = tl.zeros((BLOCK_N, TAIL_M), tl.float32)
    for k_start in range(0, inter_dim, BLOCK_K):
        h_even, h_odd = _rows_t(h_rows, row_mask, k_start, inter_dim, HALF_K, BLOCK_M, EVEN_K, SPLIT_X, PRESPLIT)
        t_even, t_odd = _rows_t(h_tail, tail_mask, k_start, inter_dim, HALF_K, TAIL_M, EVEN_K, SPLIT_X, PRESPLIT)
        w_low, w_high = _weight_rows(w_packed, w_scale, expert, packed_expert_stride, packed_row_stride,
                                     scale_expert_stride, scale_row_stride, cols, col_mask, k_start, inter_dim,
                                     HALF_K, BLOCK_N, hidden_ptr.dtype.element_ty, EVEN_K, HALF_MATH, ASM_DECODE,
                                     SCALE_FOLD)
        acc = tl.dot(w_low, h_even, acc, input_precision="ieee")
        acc = tl.dot(w_high, h_odd, acc, input_precision="ieee")
        acc_tail = tl.dot(w_low, t_even, acc_tail, input_precision="ieee")
        acc_tail = tl.dot(w_high, t_odd, acc_tail, input_precision="ieee")
    tl.store(rows_out_ptr + rows[None, :].to(tl.int64) * rows_out_row_stride + cols[:, None], acc,
             mask=col_mask[:, None] & row_mask[None, :])
    tl.store(rows_out_ptr + tail_rows[None, :].to(tl.int64) * rows_out_row_stride + cols[:, None], acc_tail,
             mask=col_mask[:, None] & tail_mask[None, :])

"""The x W^T MXFP4 expert kernels (no tile flag: `Mxfp4Tile` with swap, gemv and gluon off): x as the dot's first
operand and each dequantised weight tile as its second, the first W4A16 kernels of `kernels.triton.moe_mxfp4` and
the prefill baseline the sweeps keep (no sm_90 table uses them since the swap kernels).

Dequantisation of a weight tile. Byte j of a row holds the codes of columns 2j (low nibble) and 2j + 1 (high
nibble), so a K step of BLOCK_K columns is two dots of BLOCK_K / 2: the even columns of x against the low nibbles
and the odd columns against the high ones. No nibble interleaving is needed, and the MMA work is that of one
BLOCK_K dot. A code becomes a float32 by building its bits (sign, exponent, one mantissa bit); the E8M0 scale byte
s becomes 2^(s - 127) the same way (byte 0 is the subnormal 2^-127, byte 255 reads as 254 as in
`k3core.model.mxfp4`); their product is cast to x's dtype (bf16 on the GPU) for `tl.dot` with float32
accumulation. A scale covers 32 columns, i.e. 16 bytes of a row: one scale load per 16 bytes, broadcast.
When K is a multiple of BLOCK_K (K3: 3584 and 3072) the loads carry no K mask (EVEN_K): a mask that varies along
the contiguous bytes makes each byte its own load and keeps Triton from pipelining the loop.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton.activation import glu_f32
from kernels.triton.moe_mxfp4_operands import _e8m0_f32


@triton.jit
def _e2m1_f32(codes):
    """int32 codes in [0, 16) -> float32: bit 3 the sign, bits 0-2 index {0, 0.5, 1, 1.5, 2, 3, 4, 6}."""
    index = codes & 7
    # index >= 2: exponent (index >> 1) - 1, one mantissa bit (index & 1); index 1 is 0.5 and index 0 is zero
    bits = tl.where(index < 2, index * 0x3F000000, (((index >> 1) + 126) << 23) | ((index & 1) << 22))
    sign = (codes >> 3) << 31
    return (bits | sign).to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_tile(packed_ptr, scale_ptr, expert, packed_expert_stride, packed_row_stride, scale_expert_stride,
                scale_row_stride, rows, row_mask, k_start, num_k, HALF_K: tl.constexpr, BLOCK_N: tl.constexpr,
                DTYPE: tl.constexpr, EVEN_K: tl.constexpr = False):
    """W^T of output columns `rows` for K columns [k_start, k_start + 2 * HALF_K) of one expert, as (even k, odd k)
    tiles [HALF_K, BLOCK_N] in DTYPE. Masked columns (past num_k or past the rows) are zero."""
    j = tl.arange(0, HALF_K)
    if EVEN_K:                       # no K mask (a broadcast one is constant along K: whole-vector loads)
        mask = row_mask[None, :]
    else:
        mask = (k_start + 2 * j < num_k)[:, None] & row_mask[None, :]   # num_k is a multiple of 32: both halves
    packed_rows = (packed_ptr + expert.to(tl.int64) * packed_expert_stride
                   + rows[None, :].to(tl.int64) * packed_row_stride)
    byte = tl.load(packed_rows + (k_start // 2 + j)[:, None], mask=mask, other=0).to(tl.int32)   # [HALF_K, BLOCK_N]
    GROUPS: tl.constexpr = HALF_K // 16                                 # 16 bytes = 32 columns share a scale
    g = tl.arange(0, GROUPS)
    if EVEN_K:
        scale_mask = row_mask[None, :]
    else:
        scale_mask = ((k_start + 32 * g) < num_k)[:, None] & row_mask[None, :]
    scale_rows = scale_ptr + expert.to(tl.int64) * scale_expert_stride + rows[None, :].to(tl.int64) * scale_row_stride
    scale = tl.load(scale_rows + (k_start // 32 + g)[:, None], mask=scale_mask, other=127).to(tl.int32)
    scale = _e8m0_f32(scale)                                                                      # [GROUPS, BLOCK_N]
    scale = tl.reshape(tl.broadcast_to(scale[:, None, :], (GROUPS, 16, BLOCK_N)), (HALF_K, BLOCK_N))
    low = (_e2m1_f32(byte & 15) * scale).to(DTYPE)
    high = (_e2m1_f32(byte >> 4) * scale).to(DTYPE)
    return low, high


@triton.jit
def _even_odd_columns(row_ptrs, row_mask, k_even, num_k, EVEN_K: tl.constexpr):
    """Columns `k_even` and k_even + 1 of the block's rows (`row_ptrs` [BLOCK_M, 1]): ([BLOCK_M, HALF_K]) x 2,
    zero in padding rows and past num_k."""
    mask = row_mask[:, None] if EVEN_K else row_mask[:, None] & (k_even < num_k)[None, :]
    even = tl.load(row_ptrs + k_even[None, :], mask=mask, other=0.0)
    odd = tl.load(row_ptrs + (k_even + 1)[None, :], mask=mask, other=0.0)
    return even, odd


@triton.jit
def _gate_up_kernel(x_ptr, w_packed, w_scale, hidden_ptr, sorted_pairs_ptr, block_experts_ptr,
                    x_row_stride, packed_expert_stride, packed_row_stride, scale_expert_stride, scale_row_stride,
                    hidden_row_stride, num_pairs, num_experts, hidden_dim, inter_dim, beta, linear_beta,
                    TOP_K: tl.constexpr, IS_SITU: tl.constexpr, HAS_LINEAR_CLIP: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr, SPLIT_X: tl.constexpr):
    """One (row block, column block of I): gate and up columns of W13 in one K loop, the GLU in float32, stored in
    x's dtype at the sorted rows."""
    HALF_K: tl.constexpr = BLOCK_K // 2
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert >= num_experts:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_mask = pairs < num_pairs                                        # padding rows hold num_pairs
    x_rows = x_ptr + (pairs // TOP_K)[:, None].to(tl.int64) * x_row_stride
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)           # [BLOCK_N] of I
    col_mask = cols < inter_dim
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    j = tl.arange(0, HALF_K)
    for k_start in range(0, hidden_dim, BLOCK_K):
        x_even, x_odd = _even_odd_columns(x_rows, row_mask, k_start + 2 * j, hidden_dim, EVEN_K)
        gate_low, gate_high = _mxfp4_tile(w_packed, w_scale, expert, packed_expert_stride, packed_row_stride,
                                          scale_expert_stride, scale_row_stride, cols, col_mask, k_start,
                                          hidden_dim, HALF_K, BLOCK_N, x_ptr.dtype.element_ty, EVEN_K)
        up_low, up_high = _mxfp4_tile(w_packed, w_scale, expert, packed_expert_stride, packed_row_stride,
                                      scale_expert_stride, scale_row_stride, cols + inter_dim, col_mask, k_start,
                                      hidden_dim, HALF_K, BLOCK_N, x_ptr.dtype.element_ty, EVEN_K)
        acc_gate = tl.dot(x_even, gate_low, acc_gate, input_precision="ieee")
        acc_gate = tl.dot(x_odd, gate_high, acc_gate, input_precision="ieee")
        acc_up = tl.dot(x_even, up_low, acc_up, input_precision="ieee")
        acc_up = tl.dot(x_odd, up_high, acc_up, input_precision="ieee")
    hidden = glu_f32(acc_gate, acc_up, IS_SITU, HAS_LINEAR_CLIP, beta, linear_beta)
    tl.store(hidden_ptr + rows[:, None].to(tl.int64) * hidden_row_stride + cols[None, :],
             hidden.to(hidden_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _down_kernel(hidden_ptr, w_packed, w_scale, rows_out_ptr, sorted_pairs_ptr, block_experts_ptr,
                 hidden_row_stride, packed_expert_stride, packed_row_stride, scale_expert_stride, scale_row_stride,
                 rows_out_row_stride, num_pairs, num_experts, hidden_dim, inter_dim,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, SPLIT_X: tl.constexpr):
    """One (row block, column block of D): the W2 GEMM over I, stored in float32 at the sorted rows."""
    HALF_K: tl.constexpr = BLOCK_K // 2
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert >= num_experts:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = tl.load(sorted_pairs_ptr + rows) < num_pairs
    h_rows = hidden_ptr + rows[:, None].to(tl.int64) * hidden_row_stride
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)           # [BLOCK_N] of D
    col_mask = cols < hidden_dim
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    j = tl.arange(0, HALF_K)
    for k_start in range(0, inter_dim, BLOCK_K):
        h_even, h_odd = _even_odd_columns(h_rows, row_mask, k_start + 2 * j, inter_dim, EVEN_K)
        w_low, w_high = _mxfp4_tile(w_packed, w_scale, expert, packed_expert_stride, packed_row_stride,
                                    scale_expert_stride, scale_row_stride, cols, col_mask, k_start, inter_dim,
                                    HALF_K, BLOCK_N, hidden_ptr.dtype.element_ty, EVEN_K)
        acc = tl.dot(h_even, w_low, acc, input_precision="ieee")
        acc = tl.dot(h_odd, w_high, acc, input_precision="ieee")
    tl.store(rows_out_ptr + rows[:, None].to(tl.int64) * rows_out_row_stride + cols[None, :], acc,
             mask=row_mask[:, None] & col_mask[None, :])

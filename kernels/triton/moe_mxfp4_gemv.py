"""MXFP4 expert GEMMs for decode without `tl.dot` ("gemv"): multiply-adds in float32 registers over a few rows.

Why: at decode an expert sees one to a few rows, so the dot kernels pad each expert to a 16-row MMA and spend the
issue on the padding, on moving the decoded weight to the MMA and on a multiply by the E8M0 scale per weight
element. Here a program takes BLOCK_N weight rows of one expert and that expert's BLOCK_M (1-16) rows of x, and per
K step:
- loads the packed codes as int32 words (8 codes per word; `packed.view(torch.int32)`, contiguous along K);
- decodes two codes per 32-bit operation: nibbles n and n + 4 of a word sit 16 bits apart, so one shift, two masks,
  two shifts and an or put both as float16 bit patterns of code * 2^-14 in the two halves of an int32 (the
  magnitude bits at 9-11 and 25-27, the signs at 15 and 31; index 1, 0.5, is the float16 subnormal 2^-15). Each
  half becomes the code exactly (x 2^14 in float16, then float32);
- multiplies them with the matching x columns (word j's nibble n is column 8j + n, so x is read as [words, 4]
  tiles at columns 8j + c and 8j + 4 + c), sums each word's eight products, and only then applies the word's scale
  (2^(byte - 127), byte 0 the subnormal 2^-127, 255 read as 254 as in `k3core.model.mxfp4`): one multiply per 8
  weights instead of one per weight;
- reuses the decoded weights for every row of the block (rows past the expert's are zero and never stored), and
  adds into a [BLOCK_N, BLOCK_M, words] accumulator, so each thread sums its own words across the whole K loop and
  the one cross-thread reduction comes after it.
Products and sums are float32 (x converted exactly from bf16 / fp16), so the result differs from the dot kernels'
only by the order of float32 additions. The layout is the swap kernels' (`kernels.triton.moe_mxfp4_swap`): the
accumulator is [BLOCK_N, BLOCK_M], stored at the sorted rows.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton.activation import glu_f32
from kernels.triton.moe_mxfp4_operands import _e8m0_f32


@triton.jit
def _pair_codes(words, SHIFT: tl.constexpr):
    """int32 words -> the codes of nibbles SHIFT / 4 and SHIFT / 4 + 4 of each word, as float32 (exact)."""
    t = words >> SHIFT
    pair = ((t & 0x00070007) << 9) | ((t & 0x00080008) << 12)          # two float16 patterns of code * 2^-14
    low = (pair.to(tl.int16).to(tl.float16, bitcast=True) * 16384.0).to(tl.float32)
    high = ((pair >> 16).to(tl.int16).to(tl.float16, bitcast=True) * 16384.0).to(tl.float32)
    return low, high


@triton.jit
def _weight_words(words_ptr, scale_ptr, expert, words_expert_stride, words_row_stride, scale_expert_stride,
                  scale_row_stride, rows, row_mask, k_start, num_k, WORDS: tl.constexpr, EVEN_K: tl.constexpr):
    """The packed words [BLOCK_N, WORDS] (int32) and their scales (float32) of W rows `rows` for K columns
    [k_start, k_start + 8 * WORDS); masked words (past num_k or the rows) are zero."""
    j = tl.arange(0, WORDS)
    word = k_start // 8 + j
    if EVEN_K:
        mask = row_mask[:, None]                                        # constant along K: whole-vector loads
    else:
        mask = row_mask[:, None] & (word < num_k // 8)[None, :]
    words_rows = words_ptr + expert.to(tl.int64) * words_expert_stride + rows[:, None].to(tl.int64) * words_row_stride
    words = tl.load(words_rows + word[None, :], mask=mask, other=0)                         # [BLOCK_N, WORDS]
    scale_rows = scale_ptr + expert.to(tl.int64) * scale_expert_stride + rows[:, None].to(tl.int64) * scale_row_stride
    scale = tl.load(scale_rows + (word // 4)[None, :], mask=mask, other=127).to(tl.int32)   # 4 words per group
    return words, _e8m0_f32(scale)


@triton.jit
def _x_words(row_ptrs, row_mask, k_start, num_k, WORDS: tl.constexpr, EVEN_K: tl.constexpr):
    """x columns [k_start, k_start + 8 * WORDS) of the rows behind `row_ptrs` [BLOCK_M] in float32, as the pairs
    of columns (8j + c, 8j + c + 4) that `_pair_codes` decodes together: four (low, high) [BLOCK_M, WORDS]."""
    cols = 8 * tl.arange(0, WORDS)[:, None] + tl.arange(0, 8)[None, :]                     # [WORDS, 8]
    if EVEN_K:
        mask = row_mask[:, None, None]
    else:
        mask = row_mask[:, None, None] & (k_start + cols < num_k)[None, :, :]
    x = tl.load(row_ptrs[:, None, None] + k_start + cols[None, :, :], mask=mask, other=0.0).to(tl.float32)
    BLOCK_M: tl.constexpr = x.shape[0]
    even, odd = tl.split(tl.reshape(x, (BLOCK_M, WORDS, 4, 2)))         # columns 0 2 4 6 | 1 3 5 7
    c0, c2 = tl.split(tl.reshape(even, (BLOCK_M, WORDS, 2, 2)))         # 0 4 | 2 6
    c1, c3 = tl.split(tl.reshape(odd, (BLOCK_M, WORDS, 2, 2)))          # 1 5 | 3 7
    x0, x4 = tl.split(c0)
    x2, x6 = tl.split(c2)
    x1, x5 = tl.split(c1)
    x3, x7 = tl.split(c3)
    return x0, x4, x1, x5, x2, x6, x3, x7


@triton.jit
def _rows_dot(acc, words, scale, row_ptrs, row_mask, k_start, num_k, WORDS: tl.constexpr, EVEN_K: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M, WORDS] + each word's scaled sum of W[n, k] x[m, k] over its eight K columns, for the
    rows of x behind `row_ptrs` [BLOCK_M]. The words stay separate (each thread keeps its own partial sums) until
    the caller's one reduction after the K loop."""
    x0, x4, x1, x5, x2, x6, x3, x7 = _x_words(row_ptrs, row_mask, k_start, num_k, WORDS, EVEN_K)
    # one product, then a chain of multiply-adds (part + w * x fuses; a sum of two products would not)
    w0, w4 = _pair_codes(words, 0)
    part = w0[:, None, :] * x0[None, :, :]
    part = part + w4[:, None, :] * x4[None, :, :]
    w1, w5 = _pair_codes(words, 4)
    part = part + w1[:, None, :] * x1[None, :, :]
    part = part + w5[:, None, :] * x5[None, :, :]
    w2, w6 = _pair_codes(words, 8)
    part = part + w2[:, None, :] * x2[None, :, :]
    part = part + w6[:, None, :] * x6[None, :, :]
    w3, w7 = _pair_codes(words, 12)
    part = part + w3[:, None, :] * x3[None, :, :]
    part = part + w7[:, None, :] * x7[None, :, :]
    return acc + part * scale[:, None, :]


@triton.jit
def _gate_up_gemv_kernel(x_ptr, w_words, w_scale, hidden_ptr, sorted_pairs_ptr, block_experts_ptr,
                         x_row_stride, words_expert_stride, words_row_stride, scale_expert_stride, scale_row_stride,
                         hidden_row_stride, num_pairs, num_experts, hidden_dim, inter_dim, beta, linear_beta,
                         TOP_K: tl.constexpr, IS_SITU: tl.constexpr, HAS_LINEAR_CLIP: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN_K: tl.constexpr, PREFETCH: tl.constexpr):
    """One (row block, column block of I): gate and up [BLOCK_N, BLOCK_M] in one K loop, the GLU in float32,
    stored in x's dtype at the sorted rows. PREFETCH: the next K step's words are loaded before this step's math
    (twice the weight bytes in flight per thread; the last step's prefetch is masked off)."""
    WORDS: tl.constexpr = BLOCK_K // 8
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert >= num_experts:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_mask = pairs < num_pairs                                        # padding rows hold num_pairs
    x_rows = x_ptr + (pairs // TOP_K).to(tl.int64) * x_row_stride                   # [BLOCK_M] row starts
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)           # [BLOCK_N] of I
    col_mask = cols < inter_dim
    acc_gate = tl.zeros((BLOCK_N, BLOCK_M, WORDS), tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M, WORDS), tl.float32)
    if PREFETCH:
        gate_words, gate_scale = _weight_words(w_words, w_scale, expert, words_expert_stride, words_row_stride,
                                               scale_expert_stride, scale_row_stride, cols, col_mask, 0,
                                               hidden_dim, WORDS, EVEN_K)
        up_words, up_scale = _weight_words(w_words, w_scale, expert, words_expert_stride, words_row_stride,
                                           scale_expert_stride, scale_row_stride, cols + inter_dim, col_mask, 0,
                                           hidden_dim, WORDS, EVEN_K)
        for k_start in range(0, hidden_dim, BLOCK_K):
            live = col_mask & (k_start + BLOCK_K < hidden_dim)          # constant along K: still whole vectors
            next_gate, next_gate_scale = _weight_words(w_words, w_scale, expert, words_expert_stride,
                                                       words_row_stride, scale_expert_stride, scale_row_stride, cols,
                                                       live, k_start + BLOCK_K, hidden_dim, WORDS, EVEN_K)
            next_up, next_up_scale = _weight_words(w_words, w_scale, expert, words_expert_stride, words_row_stride,
                                                   scale_expert_stride, scale_row_stride, cols + inter_dim, live,
                                                   k_start + BLOCK_K, hidden_dim, WORDS, EVEN_K)
            acc_gate = _rows_dot(acc_gate, gate_words, gate_scale, x_rows, row_mask, k_start, hidden_dim, WORDS,
                                 EVEN_K)
            acc_up = _rows_dot(acc_up, up_words, up_scale, x_rows, row_mask, k_start, hidden_dim, WORDS, EVEN_K)
            gate_words, gate_scale, up_words, up_scale = next_gate, next_gate_scale, next_up, next_up_scale
    else:
        for k_start in range(0, hidden_dim, BLOCK_K):
            gate_words, gate_scale = _weight_words(w_words, w_scale, expert, words_expert_stride, words_row_stride,
                                                   scale_expert_stride, scale_row_stride, cols, col_mask, k_start,
                                                   hidden_dim, WORDS, EVEN_K)
            up_words, up_scale = _weight_words(w_words, w_scale, expert, words_expert_stride, words_row_stride,
                                               scale_expert_stride, scale_row_stride, cols + inter_dim, col_mask,
                                               k_start, hidden_dim, WORDS, EVEN_K)
            acc_gate = _rows_dot(acc_gate, gate_words, gate_scale, x_rows, row_mask, k_start, hidden_dim, WORDS,
                                 EVEN_K)
            acc_up = _rows_dot(acc_up, up_words, up_scale, x_rows, row_mask, k_start, hidden_dim, WORDS, EVEN_K)
    hidden = glu_f32(tl.sum(acc_gate, axis=2), tl.sum(acc_up, axis=2), IS_SITU, HAS_LINEAR_CLIP, beta,
                     linear_beta)                                                          # [BLOCK_N, BLOCK_M]
    tl.store(hidden_ptr + rows[None, :].to(tl.int64) * hidden_row_stride + cols[:, None],
             hidden.to(hidden_ptr.dtype.element_ty), mask=col_mask[:, None] & row_mask[None, :])


@triton.jit
def _down_gemv_kernel(hidden_ptr, w_words, w_scale, rows_out_ptr, sorted_pairs_ptr, block_experts_ptr,
                      hidden_row_stride, words_expert_stride, words_row_stride, scale_expert_stride,
                      scale_row_stride, rows_out_row_stride, num_pairs, num_experts, hidden_dim, inter_dim,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      EVEN_K: tl.constexpr, PREFETCH: tl.constexpr):
    """One (row block, column block of D): (W2 hidden^T) [BLOCK_N, BLOCK_M] over I, stored in float32 at the
    sorted rows. PREFETCH as in the gate/up kernel."""
    WORDS: tl.constexpr = BLOCK_K // 8
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert >= num_experts:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = tl.load(sorted_pairs_ptr + rows) < num_pairs
    h_rows = hidden_ptr + rows.to(tl.int64) * hidden_row_stride                     # [BLOCK_M] row starts
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)           # [BLOCK_N] of D
    col_mask = cols < hidden_dim
    acc = tl.zeros((BLOCK_N, BLOCK_M, WORDS), tl.float32)
    if PREFETCH:
        words, scale = _weight_words(w_words, w_scale, expert, words_expert_stride, words_row_stride,
                                     scale_expert_stride, scale_row_stride, cols, col_mask, 0, inter_dim, WORDS,
                                     EVEN_K)
        for k_start in range(0, inter_dim, BLOCK_K):
            live = col_mask & (k_start + BLOCK_K < inter_dim)
            next_words, next_scale = _weight_words(w_words, w_scale, expert, words_expert_stride, words_row_stride,
                                                   scale_expert_stride, scale_row_stride, cols, live,
                                                   k_start + BLOCK_K, inter_dim, WORDS, EVEN_K)
            acc = _rows_dot(acc, words, scale, h_rows, row_mask, k_start, inter_dim, WORDS, EVEN_K)
            words, scale = next_words, next_scale
    else:
        for k_start in range(0, inter_dim, BLOCK_K):
            words, scale = _weight_words(w_words, w_scale, expert, words_expert_stride, words_row_stride,
                                         scale_expert_stride, scale_row_stride, cols, col_mask, k_start, inter_dim,
                                         WORDS, EVEN_K)
            acc = _rows_dot(acc, words, scale, h_rows, row_mask, k_start, inter_dim, WORDS, EVEN_K)
    tl.store(rows_out_ptr + rows[None, :].to(tl.int64) * rows_out_row_stride + cols[:, None], tl.sum(acc, axis=2),
             mask=col_mask[:, None] & row_mask[None, :])

"""KDA chunked prefill, pass 1 of 2: everything inside one chunk, in parallel over (chunk, head).

For a chunk of n <= BT tokens with cumulative log-decay G_t = sum_{s<=t} g_s (per key channel, inside the chunk),
the state S0 at the chunk start and the L2-normalised q, k:

    Akk[t, s] = beta_t sum_c k_t[c] k_s[c] exp(G_t[c] - G_s[c])   (s < t)     T = (I + Akk)^-1
    Aqk[t, s] =        sum_c q_t[c] k_s[c] exp(G_t[c] - G_s[c])   (s <= t)
    W  = T (beta * k * exp(G))      U0 = T (beta * v)      =>  U = U0 - W S0^T  (the delta-rule "new values")
    O  = scale (Qg S0^T + Aqk U)    with Qg = q * exp(G)
    S_end = S0 diag(exp G_last) + U^T Kd                     with Kd = k * exp(G_last - G)

This kernel writes W, U0, Qg, Kd, Aqk and exp(G_last); `kda_chunk_state` runs the sequential part (U, O, S).
Every exponent stored or multiplied here is <= 0 except inside the dense sub-block products below.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton.kda_gate import gate_log_decay


@triton.jit
def _row(x, rows, index):
    """Row `index` of the register tile x [BT, N] as a vector [N] (tiles cannot be sliced in Triton)."""
    return tl.sum(tl.where(rows[:, None] == index, x, 0.0), 0)


@triton.jit
def _pair_matrices_dense(q, k, G, rows, DOT_DTYPE: tl.constexpr, BT: tl.constexpr, SUB: tl.constexpr,
                         PRECISION: tl.constexpr):
    """Aqk and the un-masked k k^T decay product with dense tl.dot, one row sub-block of SUB tokens at a time.

    Row block i uses the reference r = its first token and splits exp(G_t - G_s) = exp(G_t - G_r) exp(G_r - G_s).
    Row factor: t in block i, so G_t - G_r in [-(SUB-1) * 5, 0]. Column factor, kept only for s < (i+1) * SUB:
    for s before block i, G_r - G_s <= 0; for s inside block i, G_r - G_s = sum of at most SUB - 1 = 15 gates each
    > lower_bound = -5, so G_r - G_s < 75 and exp(.) < exp(75) ~ 3.7e32, finite in float32 and bfloat16
    (max ~3.4e38) even after summing 128 channels of |q k| <= 1. The wrapper only takes this path when
    (SUB - 1) * |lower_bound| <= 80 (MAX_DENSE_EXPONENT). This bound is what the lower-bounded gate buys:
    with the softplus gate a single token can decay by far more than 88 (exp overflow), so that path uses
    `_pair_matrices_exact`. The column factor is masked BEFORE exp, so pairs s > t of later blocks never see
    an overflowing exponent.
    """
    aqk = tl.zeros([BT, BT], dtype=tl.float32)
    akk = tl.zeros([BT, BT], dtype=tl.float32)
    for i in tl.static_range(BT // SUB):
        g_ref = _row(G, rows, i * SUB)                                          # [BK]
        in_block = (rows >= i * SUB) & (rows < (i + 1) * SUB)                   # rows of this block
        up_to_block = rows < (i + 1) * SUB                                      # columns it can see
        col_decay = tl.exp(tl.where(up_to_block[:, None], g_ref[None, :] - G, 0.0))  # [BT, BK] < exp(75)
        k_cols = tl.where(up_to_block[:, None], k * col_decay, 0.0).to(DOT_DTYPE)
        row_decay = tl.exp(tl.where(in_block[:, None], G - g_ref[None, :], 0.0))   # [BT, BK] <= 1
        q_rows = tl.where(in_block[:, None], q * row_decay, 0.0).to(DOT_DTYPE)
        k_rows = tl.where(in_block[:, None], k * row_decay, 0.0).to(DOT_DTYPE)
        aqk += tl.dot(q_rows, tl.trans(k_cols), input_precision=PRECISION)   # [BT, BT]
        akk += tl.dot(k_rows, tl.trans(k_cols), input_precision=PRECISION)
    return aqk, akk


@triton.jit
def _pair_matrices_exact(q, k, G, rows, BT: tl.constexpr):
    """The same two matrices one column at a time with exp(G_t - G_s) formed per element (always <= 1).

    Needed for the softplus gate, whose per-token decay is unbounded; O(BT^2 K) element-wise work instead of
    tensor-core products, which is acceptable because K3 uses the lower-bounded gate.
    """
    aqk = tl.zeros([BT, BT], dtype=tl.float32)
    akk = tl.zeros([BT, BT], dtype=tl.float32)
    for s in range(BT):
        k_s = _row(k, rows, s)                                                  # [BK]
        g_s = _row(G, rows, s)                                                  # [BK]
        at_or_after = rows >= s
        decay = tl.exp(tl.where(at_or_after[:, None], G - g_s[None, :], 0.0))  # [BT, BK] <= 1 where kept
        qk_col = tl.sum(q * k_s[None, :] * decay, 1)                           # [BT]
        kk_col = tl.sum(k * k_s[None, :] * decay, 1)                           # [BT]
        is_col = (rows == s)[None, :]
        aqk += tl.where(is_col & at_or_after[:, None], qk_col[:, None], 0.0)
        akk += tl.where(is_col & at_or_after[:, None], kk_col[:, None], 0.0)
    return aqk, akk


@triton.jit
def _merge_blocks(inv, a, rows, SMALL: tl.constexpr, BIG: tl.constexpr, PRECISION: tl.constexpr):
    """From inv = (I + a)^-1 on SMALL x SMALL diagonal blocks to the same on BIG x BIG diagonal blocks.

    Inside a big block, I + a = D + L with D its small diagonal blocks (inverse known) and L strictly
    block-lower; (D + L)^-1 = (I + N)^-1 D^-1 with N = D^-1 L nilpotent of order BIG / SMALL, so
    (I + N)^-1 = sum_p (-N)^p: the same terms block forward substitution would form, in BIG / SMALL products.
    """
    in_big = (rows[:, None] // BIG) == (rows[None, :] // BIG)
    in_small = (rows[:, None] // SMALL) == (rows[None, :] // SMALL)
    n = tl.dot(inv, tl.where(in_big & (~in_small), a, 0.0), input_precision=PRECISION)
    term = inv
    result = inv
    for _ in tl.static_range(1, BIG // SMALL):
        term = -tl.dot(n, term, input_precision=PRECISION)
        result += term
    return result


@triton.jit
def _unit_lower_inverse(a, rows, BT: tl.constexpr, PRECISION: tl.constexpr):
    """(I + a)^-1 for a strictly lower-triangular a [BT, BT] (float32 throughout), in 11 products for BT = 64.

    4 x 4 diagonal blocks by forward substitution, all blocks at once (step r finalises row r of every block
    from its rows < r: 3 products), then two merges 4 -> 16 -> BT (`_merge_blocks`). Substituting row by row
    over 16 x 16 blocks would take 15 dependent products instead of 3 + 4.
    """
    eye = (rows[:, None] == rows[None, :]).to(tl.float32)
    a_diag = tl.where((rows[:, None] // 4) == (rows[None, :] // 4), a, 0.0)
    inv = eye
    for r in tl.static_range(1, 4):
        step = eye - tl.dot(a_diag, inv, input_precision=PRECISION)
        inv = tl.where(((rows % 4) == r)[:, None], step, inv)
    inv = _merge_blocks(inv, a, rows, 4, 16, PRECISION)
    if BT > 16:
        inv = _merge_blocks(inv, a, rows, 16, BT, PRECISION)
    return inv


@triton.jit
def _chunk_rows(chunk_start_ptr, chunk_len_ptr, i_chunk, i_h, H: tl.constexpr, K: tl.constexpr,
                BT: tl.constexpr, BK: tl.constexpr):
    """Where the rows of one (chunk, head) program live in [T, H, K]: (length, rows, cols_k, row_ok, head_row,
    mask_k, offs_k). Shared by the per-chunk KDA kernels."""
    start = tl.load(chunk_start_ptr + i_chunk).to(tl.int64)
    length = tl.load(chunk_len_ptr + i_chunk)
    rows = tl.arange(0, BT)
    cols_k = tl.arange(0, BK)
    row_ok = rows < length
    head_row = (start + rows) * H + i_h                                         # [BT] row of [T * H]
    mask_k = row_ok[:, None] & (cols_k < K)[None, :]
    offs_k = head_row[:, None] * K + cols_k[None, :]                            # [BT, BK]
    return length, rows, cols_k, row_ok, head_row, mask_k, offs_k


@triton.jit
def kda_chunk_intra_kernel(
        q_ptr, k_ptr, v_ptr, f_ptr, beta_ptr, a_log_ptr, dt_bias_ptr,   # inputs [T, H, *]
        chunk_start_ptr, chunk_len_ptr,                                  # int32 [num_chunks]
        w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, decay_ptr,                # workspace (see module doc)
        lower_bound,
        H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
        BT: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, SUB: tl.constexpr,
        FORM: tl.constexpr, DENSE: tl.constexpr, PRECISION: tl.constexpr):
    i_chunk = tl.program_id(0)
    i_h = tl.program_id(1)
    length, rows, cols_k, row_ok, head_row, mask_k, offs_k = _chunk_rows(chunk_start_ptr, chunk_len_ptr, i_chunk,
                                                                         i_h, H, K, BT, BK)
    DOT_DTYPE = w_ptr.dtype.element_ty
    # Ordered for register pressure (a [BT, BK] float32 tile is BT * BK / (32 num_warps) registers per thread):
    # each output is stored as soon as it is known, and v stays in its 16-bit input form until the last product
    # (its load is still issued first, so its latency overlaps the rest), so that fewer float32 tiles are live
    # across the pair products and the solve.
    cols_v = tl.arange(0, BVF)
    mask_v = row_ok[:, None] & (cols_v < V)[None, :]
    offs_v = head_row[:, None] * V + cols_v[None, :]                            # [BT, BVF]
    v_in = tl.load(v_ptr + offs_v, mask=mask_v, other=0.0)                     # [BT, BVF] input dtype
    q = tl.load(q_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)        # [BT, BK]
    k = tl.load(k_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, 1) + 1e-6)[:, None]
    k = k / tl.sqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
    f = tl.load(f_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    a_log = tl.load(a_log_ptr + i_h)
    dt_bias = tl.load(dt_bias_ptr + i_h * K + cols_k, mask=cols_k < K, other=0.0)
    g = gate_log_decay(f, a_log, dt_bias[None, :], lower_bound, FORM)
    g = tl.where(mask_k, g, 0.0)                                                # tail rows do not decay
    G = tl.cumsum(g, 0)                                                         # [BT, BK]
    tl.store(qg_ptr + offs_k, (q * tl.exp(G)).to(DOT_DTYPE), mask=mask_k)      # exp(G) <= 1

    if DENSE:
        aqk, akk = _pair_matrices_dense(q, k, G, rows, DOT_DTYPE, BT, SUB, PRECISION)
    else:
        aqk, akk = _pair_matrices_exact(q, k, G, rows, BT)
    aqk = tl.where(rows[:, None] >= rows[None, :], aqk, 0.0)
    tl.store(aqk_ptr + head_row[:, None] * BT + rows[None, :], aqk.to(DOT_DTYPE), mask=row_ok[:, None])
    beta = tl.sigmoid(tl.load(beta_ptr + head_row, mask=row_ok, other=0.0).to(tl.float32))
    beta = tl.where(row_ok, beta, 0.0)                                          # [BT]
    akk = tl.where(rows[:, None] > rows[None, :], akk * beta[:, None], 0.0)
    t_inv = _unit_lower_inverse(akk, rows, BT, PRECISION)                  # [BT, BT]

    w = tl.dot(t_inv, k * tl.exp(G) * beta[:, None], input_precision=PRECISION)   # [BT, BK]
    tl.store(w_ptr + offs_k, w.to(DOT_DTYPE), mask=mask_k)
    g_last = _row(G, rows, length - 1)                                          # [BK]
    k_to_end = k * tl.exp(tl.where(mask_k, g_last[None, :] - G, 0.0))           # [BT, BK] <= |k|
    tl.store(kd_ptr + offs_k, k_to_end.to(DOT_DTYPE), mask=mask_k)

    u0 = tl.dot(t_inv, v_in.to(tl.float32) * beta[:, None], input_precision=PRECISION)            # [BT, BVF]
    tl.store(u_ptr + offs_v, u0.to(DOT_DTYPE), mask=mask_v)
    tl.store(decay_ptr + (i_chunk * H + i_h) * K + cols_k, tl.exp(g_last), mask=cols_k < K)

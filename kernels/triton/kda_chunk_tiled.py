"""KDA chunked prefill, pass 1 tiled over the channels: `kda_chunk_intra`'s outputs from [BT, BKT] register tiles.

The one-kernel pass holds q, k, G and v as whole [BT, K] float32 tiles, and their decay products, at once: on an
H200 it takes 255 registers plus a spill stack at 32- and 64-token chunks (bench.kernel_resources), so only two
programs share an SM and nothing hides the latency of its chain of small products. Everything in the pass is per
key channel except three things, which this kernel gets by looping over channel tiles of BKT:

    the L2 norms of q and k            a first loop sums the squares
    Aqk and Akk, sums over channels    accumulated tile by tile (`_pair_matrices_*` are sums over their columns)
    W = T (beta k exp G)               needs T = (I + Akk)^-1, so a last loop reloads k and f and redoes the tile's G

and U0 = T (beta v) goes tile by tile over the value columns. The price is loads: k three times, q and f twice,
from L2 (a chunk's rows are a few KB). Module doc of `kda_chunk_intra` for the formulas and exponent bounds.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton.kda_chunk_intra import (
    _chunk_rows,
    _pair_matrices_dense,
    _pair_matrices_exact,
    _row,
    _unit_lower_inverse,
)
from kernels.triton.kda_gate import gate_log_decay


@triton.jit
def _tile(head_row, row_ok, cols, start, D: tl.constexpr):
    """Offsets and mask of the channel tile [start, start + BKT) of a [T * H, D] tensor."""
    channels = start + cols
    return head_row[:, None] * D + channels[None, :], row_ok[:, None] & (channels < D)[None, :], channels


@triton.jit
def _gate_tile(f_ptr, dt_bias_ptr, offs, mask, channels, i_h, a_log, lower_bound, K: tl.constexpr,
               FORM: tl.constexpr):
    """G, the in-chunk cumulative log-decay of one channel tile [BT, BKT] (tail rows and channels do not decay)."""
    f = tl.load(f_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + i_h * K + channels, mask=channels < K, other=0.0)
    g = gate_log_decay(f, a_log, dt_bias[None, :], lower_bound, FORM)
    return tl.cumsum(tl.where(mask, g, 0.0), 0)


@triton.jit
def kda_chunk_intra_tiled_kernel(
        q_ptr, k_ptr, v_ptr, f_ptr, beta_ptr, a_log_ptr, dt_bias_ptr,   # inputs [T, H, *]
        chunk_start_ptr, chunk_len_ptr,                                  # int32 [num_chunks]
        w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, decay_ptr,                # workspace (kda_chunk_intra's)
        lower_bound,
        H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
        BT: tl.constexpr, BKT: tl.constexpr, SUB: tl.constexpr,
        FORM: tl.constexpr, DENSE: tl.constexpr, PRECISION: tl.constexpr):
    i_chunk = tl.program_id(0)
    i_h = tl.program_id(1)
    length, rows, cols, row_ok, head_row, _mask, _offs = _chunk_rows(chunk_start_ptr, chunk_len_ptr, i_chunk, i_h,
                                                                      H, K, BT, BKT)
    DOT_DTYPE = w_ptr.dtype.element_ty
    a_log = tl.load(a_log_ptr + i_h)
    beta = tl.sigmoid(tl.load(beta_ptr + head_row, mask=row_ok, other=0.0).to(tl.float32))
    beta = tl.where(row_ok, beta, 0.0)                                          # [BT]

    q_squares = tl.zeros([BT], dtype=tl.float32)
    k_squares = tl.zeros([BT], dtype=tl.float32)
    for start in range(0, K, BKT):
        offs, mask, channels = _tile(head_row, row_ok, cols, start, K)
        q = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        q_squares += tl.sum(q * q, 1)
        k_squares += tl.sum(k * k, 1)
    q_scale = 1.0 / tl.sqrt(q_squares + 1e-6)
    k_scale = 1.0 / tl.sqrt(k_squares + 1e-6)

    aqk = tl.zeros([BT, BT], dtype=tl.float32)
    akk = tl.zeros([BT, BT], dtype=tl.float32)
    for start in range(0, K, BKT):
        offs, mask, channels = _tile(head_row, row_ok, cols, start, K)
        q = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32) * q_scale[:, None]
        k = tl.load(k_ptr + offs, mask=mask, other=0.0).to(tl.float32) * k_scale[:, None]
        G = _gate_tile(f_ptr, dt_bias_ptr, offs, mask, channels, i_h, a_log, lower_bound, K, FORM)
        if DENSE:
            part_qk, part_kk = _pair_matrices_dense(q, k, G, rows, DOT_DTYPE, BT, SUB, PRECISION)
        else:
            part_qk, part_kk = _pair_matrices_exact(q, k, G, rows, BT)
        aqk += part_qk
        akk += part_kk
        g_last = _row(G, rows, length - 1)                                      # [BKT]
        tl.store(qg_ptr + offs, (q * tl.exp(G)).to(DOT_DTYPE), mask=mask)
        tl.store(kd_ptr + offs, (k * tl.exp(tl.where(mask, g_last[None, :] - G, 0.0))).to(DOT_DTYPE), mask=mask)
        tl.store(decay_ptr + (i_chunk * H + i_h) * K + channels, tl.exp(g_last), mask=channels < K)

    aqk = tl.where(rows[:, None] >= rows[None, :], aqk, 0.0)
    akk = tl.where(rows[:, None] > rows[None, :], akk * beta[:, None], 0.0)
    tl.store(aqk_ptr + head_row[:, None] * BT + rows[None, :], aqk.to(DOT_DTYPE), mask=row_ok[:, None])
    t_inv = _unit_lower_inverse(akk, rows, BT, PRECISION)                  # [BT, BT]

    for start in range(0, K, BKT):
        offs, mask, channels = _tile(head_row, row_ok, cols, start, K)
        k = tl.load(k_ptr + offs, mask=mask, other=0.0).to(tl.float32) * k_scale[:, None]
        G = _gate_tile(f_ptr, dt_bias_ptr, offs, mask, channels, i_h, a_log, lower_bound, K, FORM)
        w = tl.dot(t_inv, k * tl.exp(G) * beta[:, None], input_precision=PRECISION)   # [BT, BKT]
        tl.store(w_ptr + offs, w.to(DOT_DTYPE), mask=mask)
    for start in range(0, V, BKT):
        offs, mask, channels = _tile(head_row, row_ok, cols, start, V)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u0 = tl.dot(t_inv, v * beta[:, None], input_precision=PRECISION)      # [BT, BKT]
        tl.store(u_ptr + offs, u0.to(DOT_DTYPE), mask=mask)

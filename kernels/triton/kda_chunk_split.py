"""KDA chunked prefill, pass 1 split in two (`KernelConfig.split`): the same workspace as `kda_chunk_intra`, from
two lighter kernels, each parallel over (chunk, head).

`kda_chunk_intra` keeps q, k, v, the gates, their cumulative sums and every 64 x 64 product of a chunk alive in one
program; compiled for sm_90 that spills 1.8 KB per thread (`python -m bench.kernel_resources`). Here:

* `kda_chunk_prep_kernel` reads q, k, f and beta, and writes what only needs them: Qg, Kd, exp(G_last) (final
  workspace), plus three scratch tensors for the second kernel: the L2-normalised q and k (workspace dtype) and
  G (float32), and k exp(G) beta (workspace dtype, the right operand of W).
* `kda_chunk_solve_kernel` reads those, forms Aqk and Akk (`_pair_matrices_*`), inverts I + Akk, and writes Aqk,
  W and U0 (it reads v only here).

The price is the scratch traffic (about 10 bytes per token, head and key channel, written once and read once);
what it buys is two programs that fit their registers. Whether that is faster is for `bench.tune_prefill` to say
on the GPU: the table keeps `split=False` until it has.
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
def kda_chunk_prep_kernel(
        q_ptr, k_ptr, f_ptr, beta_ptr, a_log_ptr, dt_bias_ptr,          # inputs [T, H, *]
        chunk_start_ptr, chunk_len_ptr,                                  # int32 [num_chunks]
        qg_ptr, kd_ptr, decay_ptr,                                       # final workspace (see kda_chunk_intra)
        qn_ptr, kn_ptr, g_cum_ptr, kgb_ptr,                              # scratch [T, H, K]
        lower_bound,
        H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, FORM: tl.constexpr):
    i_chunk = tl.program_id(0)
    i_h = tl.program_id(1)
    length, rows, cols_k, row_ok, head_row, mask_k, offs_k = _chunk_rows(chunk_start_ptr, chunk_len_ptr, i_chunk,
                                                                         i_h, H, K, BT, BK)
    DOT_DTYPE = qg_ptr.dtype.element_ty

    f = tl.load(f_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    a_log = tl.load(a_log_ptr + i_h)
    dt_bias = tl.load(dt_bias_ptr + i_h * K + cols_k, mask=cols_k < K, other=0.0)
    g = gate_log_decay(f, a_log, dt_bias[None, :], lower_bound, FORM)
    g = tl.where(mask_k, g, 0.0)                                                # tail rows do not decay
    G = tl.cumsum(g, 0)                                                         # [BT, BK]
    g_last = _row(G, rows, length - 1)                                          # [BK]
    tl.store(g_cum_ptr + offs_k, G, mask=mask_k)
    tl.store(decay_ptr + (i_chunk * H + i_h) * K + cols_k, tl.exp(g_last), mask=cols_k < K)
    decay_g = tl.exp(G)                                                         # [BT, BK] <= 1

    q = tl.load(q_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, 1) + 1e-6)[:, None]
    tl.store(qn_ptr + offs_k, q.to(DOT_DTYPE), mask=mask_k)
    tl.store(qg_ptr + offs_k, (q * decay_g).to(DOT_DTYPE), mask=mask_k)

    k = tl.load(k_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    k = k / tl.sqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
    beta = tl.sigmoid(tl.load(beta_ptr + head_row, mask=row_ok, other=0.0).to(tl.float32))
    beta = tl.where(row_ok, beta, 0.0)                                          # [BT]
    tl.store(kn_ptr + offs_k, k.to(DOT_DTYPE), mask=mask_k)
    tl.store(kgb_ptr + offs_k, (k * decay_g * beta[:, None]).to(DOT_DTYPE), mask=mask_k)
    tl.store(kd_ptr + offs_k, (k * tl.exp(tl.where(mask_k, g_last[None, :] - G, 0.0))).to(DOT_DTYPE),
             mask=mask_k)


@triton.jit
def kda_chunk_solve_kernel(
        v_ptr, beta_ptr, chunk_start_ptr, chunk_len_ptr,
        qn_ptr, kn_ptr, g_cum_ptr, kgb_ptr,                              # scratch from kda_chunk_prep_kernel
        w_ptr, u_ptr, aqk_ptr,                                           # final workspace
        H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
        BT: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, SUB: tl.constexpr,
        DENSE: tl.constexpr, PRECISION: tl.constexpr):
    i_chunk = tl.program_id(0)
    i_h = tl.program_id(1)
    length, rows, cols_k, row_ok, head_row, mask_k, offs_k = _chunk_rows(chunk_start_ptr, chunk_len_ptr, i_chunk,
                                                                         i_h, H, K, BT, BK)
    cols_v = tl.arange(0, BVF)
    mask_v = row_ok[:, None] & (cols_v < V)[None, :]
    offs_v = head_row[:, None] * V + cols_v[None, :]                            # [BT, BVF]
    DOT_DTYPE = w_ptr.dtype.element_ty

    q = tl.load(qn_ptr + offs_k, mask=mask_k, other=0.0)                      # workspace dtype
    k = tl.load(kn_ptr + offs_k, mask=mask_k, other=0.0)
    G = tl.load(g_cum_ptr + offs_k, mask=mask_k, other=0.0)                   # float32 [BT, BK]
    # rows past the chunk's end hold G_last, as in kda_chunk_intra (their gates are 0): that keeps every
    # in-block exponent of the dense path bounded; 0 there would overflow exp for long chunks
    G = tl.where(row_ok[:, None], G, _row(G, rows, length - 1)[None, :])
    if DENSE:
        aqk, akk = _pair_matrices_dense(q, k, G, rows, DOT_DTYPE, BT, SUB, PRECISION)
    else:
        aqk, akk = _pair_matrices_exact(q.to(tl.float32), k.to(tl.float32), G, rows, BT)
    aqk = tl.where(rows[:, None] >= rows[None, :], aqk, 0.0)
    tl.store(aqk_ptr + head_row[:, None] * BT + rows[None, :], aqk.to(DOT_DTYPE), mask=row_ok[:, None])
    beta = tl.sigmoid(tl.load(beta_ptr + head_row, mask=row_ok, other=0.0).to(tl.float32))
    beta = tl.where(row_ok, beta, 0.0)                                          # [BT]
    akk = tl.where(rows[:, None] > rows[None, :], akk * beta[:, None], 0.0)
    t_inv = _unit_lower_inverse(akk, rows, BT, PRECISION)                      # [BT, BT] float32

    kgb = tl.load(kgb_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    w = tl.dot(t_inv, kgb, input_precision=PRECISION)                          # [BT, BK]
    tl.store(w_ptr + offs_k, w.to(DOT_DTYPE), mask=mask_k)
    v = tl.load(v_ptr + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    u0 = tl.dot(t_inv, v * beta[:, None], input_precision=PRECISION)           # [BT, BVF]
    tl.store(u_ptr + offs_v, u0.to(DOT_DTYPE), mask=mask_v)

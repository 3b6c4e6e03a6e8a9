"""KDA chunked prefill, between the two passes: the workspace of BT-token chunks turned into that of 2 BT-token
chunks, each made of two consecutive chunks of one sequence, so that the sequential state pass takes half the steps.

The state pass (`kda_chunk_state`) steps a chunk with inputs W, Qg, Kd [n, K], U0 [n, V], Aqk [n, n] and
decay = exp(G_last) [K] (D = diag(decay)) on the state h [K, V]:

    u = U0 - W h        o = scale (Qg h + Aqk u)        h <- D h + Kd^T u

Two steps, chunk a (exactly BT rows) then chunk b (n_b <= BT rows), are one step on the stacked rows. Substituting
u_a = U0_a - W_a h and the state between them, D_a h + Kd_a^T u_a, into b's step, with M = W_b Kd_a^T and
N = Qg_b Kd_a^T (both [n_b, BT]):

    u_b = (U0_b - M U0_a) - (W_b D_a - M W_a) h
    o_b = scale (Qg_b D_a h + N u_a + Aqk_b u_b)
    h  <- D_a D_b h + (Kd_a D_b)^T u_a + Kd_b^T u_b

so the merged chunk's inputs are

    W'  = [W_a ; W_b D_a - M W_a]       U0' = [U0_a ; U0_b - M U0_a]       Qg' = [Qg_a ; Qg_b D_a]
    Kd' = [Kd_a D_b ; Kd_b]             Aqk' = [[Aqk_a, 0], [N, Aqk_b]]    decay' = decay_a decay_b

W, U0, Qg and Kd are stored per token row, so the merge rewrites in place the rows that change (b's rows of W, U0,
Qg and a's rows of Kd); Aqk (2 BT columns) and decay (one row per merged chunk) go to new buffers. A chunk that is
not paired (a sequence's last, a partial one, one that ends at a checkpoint: see kda_prefill's `pair_chunks`) is a
merged chunk of its own: its Aqk is copied with zero columns past BT, the state pass multiplying all 2 BT of them.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _merge_pair(w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, merged_aqk_ptr, start, len_b, i_h, rows, cols_k, decay_a,
                decay_b, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                PRECISION: tl.constexpr):
    """The rows of a paired chunk that change. Every tile is loaded once, before the rows it came from are
    rewritten; the tiles follow the order of use so that few are live at once."""
    DOT_DTYPE = w_ptr.dtype.element_ty
    cols_v = tl.arange(0, BV)
    k_ok = (cols_k < K)[None, :]
    v_ok = (cols_v < V)[None, :]
    row_a = (start + rows) * H + i_h                                            # [BT] a is full: every row is real
    row_b = (start + BT + rows) * H + i_h
    b_ok = (rows < len_b)[:, None]
    offs_ka = row_a[:, None] * K + cols_k[None, :]                              # [BT, BK]
    offs_kb = row_b[:, None] * K + cols_k[None, :]

    kd_a = tl.load(kd_ptr + offs_ka, mask=k_ok, other=0.0)                      # [BT, BK]
    tl.store(kd_ptr + offs_ka, (kd_a * decay_b[None, :]).to(DOT_DTYPE), mask=k_ok)
    qg_b = tl.load(qg_ptr + offs_kb, mask=b_ok & k_ok, other=0.0)
    n = tl.dot(qg_b, tl.trans(kd_a), input_precision=PRECISION)                # [BT, BT]
    tl.store(merged_aqk_ptr + row_b[:, None] * (2 * BT) + rows[None, :], n.to(DOT_DTYPE), mask=b_ok)
    tl.store(qg_ptr + offs_kb, (qg_b * decay_a[None, :]).to(DOT_DTYPE), mask=b_ok & k_ok)
    aqk_b = tl.load(aqk_ptr + row_b[:, None] * BT + rows[None, :], mask=b_ok, other=0.0)
    tl.store(merged_aqk_ptr + row_b[:, None] * (2 * BT) + BT + rows[None, :], aqk_b, mask=b_ok)

    w_b = tl.load(w_ptr + offs_kb, mask=b_ok & k_ok, other=0.0)
    m = tl.dot(w_b, tl.trans(kd_a), input_precision=PRECISION)                 # [BT, BT] float32
    w_a = tl.load(w_ptr + offs_ka, mask=k_ok, other=0.0).to(tl.float32)
    w_b = w_b * decay_a[None, :] - tl.dot(m, w_a, input_precision=PRECISION)
    tl.store(w_ptr + offs_kb, w_b.to(DOT_DTYPE), mask=b_ok & k_ok)
    u0_a = tl.load(u_ptr + row_a[:, None] * V + cols_v[None, :], mask=v_ok, other=0.0).to(tl.float32)
    offs_vb = row_b[:, None] * V + cols_v[None, :]                              # [BT, BV]
    u0_b = tl.load(u_ptr + offs_vb, mask=b_ok & v_ok, other=0.0).to(tl.float32)
    u0_b -= tl.dot(m, u0_a, input_precision=PRECISION)
    tl.store(u_ptr + offs_vb, u0_b.to(DOT_DTYPE), mask=b_ok & v_ok)


@triton.jit
def kda_chunk_merge_kernel(
        w_ptr, u_ptr, qg_ptr, kd_ptr,                                    # [T, H, K], U0 [T, H, V]: rewritten in place
        aqk_ptr, decay_ptr,                                              # [T, H, BT], [chunks, H, K] f32: BT-chunks
        merged_aqk_ptr, merged_decay_ptr,                                # [T, H, 2 BT], [merged, H, K] f32: written
        merged_start_ptr, merged_len_ptr, first_chunk_ptr, chunk_len_ptr,  # int32 tables
        H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
        PRECISION: tl.constexpr):
    """One program per (merged chunk, head); BT is the finer chunk size, BV covers all of V."""
    i_m = tl.program_id(0)
    i_h = tl.program_id(1)
    start = tl.load(merged_start_ptr + i_m).to(tl.int64)
    first = tl.load(first_chunk_ptr + i_m)                               # chunk a, the first of the pair
    len_a = tl.load(chunk_len_ptr + first)
    len_b = tl.load(merged_len_ptr + i_m) - len_a                        # 0: a is not paired
    rows = tl.arange(0, BT)
    cols_k = tl.arange(0, BK)
    k_ok = cols_k < K
    decay_a = tl.load(decay_ptr + (first * H + i_h) * K + cols_k, mask=k_ok, other=0.0)           # [BK]
    decay_b = tl.load(decay_ptr + ((first + 1) * H + i_h) * K + cols_k, mask=k_ok & (len_b > 0), other=1.0)
    tl.store(merged_decay_ptr + (i_m * H + i_h) * K + cols_k, decay_a * decay_b, mask=k_ok)

    row_a = (start + rows) * H + i_h                                            # [BT]
    a_ok = (rows < len_a)[:, None]
    aqk_a = tl.load(aqk_ptr + row_a[:, None] * BT + rows[None, :], mask=a_ok, other=0.0)    # [BT, BT]
    tl.store(merged_aqk_ptr + row_a[:, None] * (2 * BT) + rows[None, :], aqk_a, mask=a_ok)
    tl.store(merged_aqk_ptr + row_a[:, None] * (2 * BT) + BT + rows[None, :], tl.zeros_like(aqk_a), mask=a_ok)
    if len_b > 0:
        _merge_pair(w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, merged_aqk_ptr, start, len_b, i_h, rows, cols_k,
                    decay_a, decay_b, H, K, V, BT, BV, PRECISION)

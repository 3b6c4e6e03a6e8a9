"""KDA chunked prefill, pass 2 of 2: the sequential state recurrence across the chunks of each sequence.

One program per (value block, head, sequence) keeps its slice of the state, h = S^T [K, BV] float32, in
registers for the whole sequence, and per chunk (inputs from `kda_chunk_intra`):

    U = U0 - W h            (the delta-rule new values of this value block)  [BT, BV]
    O = scale (Qg h + Aqk U)                                                  [BT, BV]
    h = exp(G_last) * h + Kd^T U                                              [K, BV]

Every product splits by value columns, so value blocks and heads run in parallel with no communication; the
state is read once from state[slot] and written once, plus once per checkpoint the radix cache asked for: the
host cuts chunks at every checkpoint and names, per chunk, the checkpoint row its end fills (-1 for none).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _chunk_load(i_chunk, end_chunk, i_h, rows, cols_k, cols_v, w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, decay_ptr,
                chunk_start_ptr, chunk_len_ptr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BT: tl.constexpr, AHEAD: tl.constexpr):
    """Every input of one chunk's step: (start, length, W, Qg, Kd, U0, Aqk, exp(G_last)). AHEAD (the prefetching
    loop, which asks for the chunk after the last): a chunk at or past end_chunk loads nothing (length 0)."""
    if AHEAD:
        valid = i_chunk < end_chunk
        start = tl.load(chunk_start_ptr + i_chunk, mask=valid, other=0).to(tl.int64)
        length = tl.load(chunk_len_ptr + i_chunk, mask=valid, other=0)
    else:
        start = tl.load(chunk_start_ptr + i_chunk).to(tl.int64)
        length = tl.load(chunk_len_ptr + i_chunk)
    k_ok = cols_k < K
    row_ok = rows < length
    head_row = (start + rows) * H + i_h                                     # [BT]
    mask_k = row_ok[:, None] & k_ok[None, :]
    mask_v = row_ok[:, None] & (cols_v < V)[None, :]
    offs_k = head_row[:, None] * K + cols_k[None, :]                        # [BT, BK]
    w = tl.load(w_ptr + offs_k, mask=mask_k, other=0.0)                     # [BT, BK]
    qg = tl.load(qg_ptr + offs_k, mask=mask_k, other=0.0)
    kd = tl.load(kd_ptr + offs_k, mask=mask_k, other=0.0)
    u0 = tl.load(u_ptr + head_row[:, None] * V + cols_v[None, :], mask=mask_v, other=0.0).to(tl.float32)
    aqk = tl.load(aqk_ptr + head_row[:, None] * BT + rows[None, :], mask=row_ok[:, None], other=0.0)
    if AHEAD:
        decay = tl.load(decay_ptr + (i_chunk * H + i_h) * K + cols_k, mask=k_ok & valid, other=0.0)  # [BK]
    else:
        decay = tl.load(decay_ptr + (i_chunk * H + i_h) * K + cols_k, mask=k_ok, other=0.0)
    return start, length, w, qg, kd, u0, aqk, decay


@triton.jit
def _chunk_step(h, i_chunk, i_h, rows, cols_k, cols_v, h_offs,
                start, length, w, qg, kd, u0, aqk, decay,
                o_ptr, ckpt_ptr, chunk_ckpt_ptr, scale,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, CHECKPOINTS: tl.constexpr,
                PRECISION: tl.constexpr):
    """One chunk of one sequence from its loaded inputs (`_chunk_load`): writes O for this value block, returns
    the state after the chunk."""
    k_ok = cols_k < K
    v_ok = cols_v < V
    mask_h = k_ok[:, None] & v_ok[None, :]
    DOT_DTYPE = w.dtype
    row_ok = rows < length
    head_row = (start + rows) * H + i_h                                     # [BT]
    mask_v = row_ok[:, None] & v_ok[None, :]
    offs_v = head_row[:, None] * V + cols_v[None, :]                        # [BT, BV]

    h_in = h.to(DOT_DTYPE)
    u = u0 - tl.dot(w, h_in, input_precision=PRECISION)                   # [BT, BV]
    o = tl.dot(qg, h_in, input_precision=PRECISION)                       # [BT, BV]
    o += tl.dot(aqk, u.to(DOT_DTYPE), input_precision=PRECISION)
    tl.store(o_ptr + offs_v, (scale * o).to(o_ptr.dtype.element_ty), mask=mask_v)
    h = decay[:, None] * h + tl.dot(tl.trans(kd), u.to(DOT_DTYPE), input_precision=PRECISION)  # [BK, BV]

    if CHECKPOINTS:
        row = tl.load(chunk_ckpt_ptr + i_chunk)                             # -1: this chunk end is no checkpoint
        tl.store(ckpt_ptr + row.to(tl.int64) * (H * V * K) + h_offs, h, mask=mask_h & (row >= 0))
    return h


@triton.jit
def kda_chunk_state_kernel(
        w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, decay_ptr,               # workspace from kda_chunk_intra
        o_ptr,                                                           # [T, H, V] dtype of v
        state_ptr, state_stride, slot_ptr, has_init_ptr,                 # [slots, H, V, K] f32 (dim 0 strided)
        seq_chunk_ptr, chunk_start_ptr, chunk_len_ptr,                   # int32 tables
        ckpt_ptr, chunk_ckpt_ptr,                                        # [N, H, V, K] f32, int32 [num_chunks]
        scale,
        H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
        BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, CHECKPOINTS: tl.constexpr,
        INTERPRETED: tl.constexpr, PRECISION: tl.constexpr, PREFETCH: tl.constexpr):
    """PREFETCH: each step first issues the loads of the next chunk (into registers, carried by the loop), so
    their latency overlaps this chunk's products; the chunk table lookup makes every load address depend on a
    load, which the software pipeliner (num_stages) cannot run ahead on its own."""
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2)
    first_chunk = tl.load(seq_chunk_ptr + i_b)
    end_chunk = tl.load(seq_chunk_ptr + i_b + 1)
    slot = tl.load(slot_ptr + i_b).to(tl.int64)
    has_init = tl.load(has_init_ptr + i_b) != 0

    rows = tl.arange(0, BT)
    cols_k = tl.arange(0, BK)
    cols_v = i_v * BV + tl.arange(0, BV)
    k_ok = cols_k < K
    v_ok = cols_v < V
    mask_h = k_ok[:, None] & v_ok[None, :]
    # h[k, v] = S[v, k]: the state tile transposed so that every product below is a plain tl.dot.
    h_offs = i_h * V * K + cols_v[None, :] * K + cols_k[:, None]                # [BK, BV]
    h = tl.load(state_ptr + slot * state_stride + h_offs, mask=mask_h & has_init, other=0.0)

    if PREFETCH:
        start, length, w, qg, kd, u0, aqk, decay = _chunk_load(
            first_chunk, end_chunk, i_h, rows, cols_k, cols_v, w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, decay_ptr,
            chunk_start_ptr, chunk_len_ptr, H, K, V, BT, True)
    else:                       # placeholders of the loop-carried inputs: every iteration loads its own chunk
        DOT_DTYPE = w_ptr.dtype.element_ty
        start = first_chunk.to(tl.int64) * 0
        length = first_chunk * 0
        w = tl.zeros([BT, BK], dtype=DOT_DTYPE)
        qg = tl.zeros([BT, BK], dtype=DOT_DTYPE)
        kd = tl.zeros([BT, BK], dtype=DOT_DTYPE)
        u0 = tl.zeros([BT, BV], dtype=tl.float32)
        aqk = tl.zeros([BT, BT], dtype=DOT_DTYPE)
        decay = tl.zeros([BK], dtype=tl.float32)
    # The CPU interpreter cannot take a loaded scalar as a range() bound (numpy >= 2), so it loops with while;
    # compiled code keeps the for loop, which the pipeliner can software-pipeline.
    if INTERPRETED:
        i_chunk = first_chunk
        while i_chunk < end_chunk:
            h, start, length, w, qg, kd, u0, aqk, decay = _next_chunk(
                h, i_chunk, end_chunk, i_h, rows, cols_k, cols_v, h_offs, start, length, w, qg, kd, u0,
                aqk, decay, w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, decay_ptr, o_ptr, chunk_start_ptr,
                chunk_len_ptr, ckpt_ptr, chunk_ckpt_ptr, scale,
                H, K, V, BT, CHECKPOINTS, PRECISION, PREFETCH)
            i_chunk += 1
    else:
        for i_chunk in range(first_chunk, end_chunk):
            h, start, length, w, qg, kd, u0, aqk, decay = _next_chunk(
                h, i_chunk, end_chunk, i_h, rows, cols_k, cols_v, h_offs, start, length, w, qg, kd, u0,
                aqk, decay, w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, decay_ptr, o_ptr, chunk_start_ptr,
                chunk_len_ptr, ckpt_ptr, chunk_ckpt_ptr, scale,
                H, K, V, BT, CHECKPOINTS, PRECISION, PREFETCH)

    tl.store(state_ptr + slot * state_stride + h_offs, h, mask=mask_h)


@triton.jit
def _next_chunk(h, i_chunk, end_chunk, i_h, rows, cols_k, cols_v, h_offs, start, length, w, qg, kd, u0,
                aqk, decay, w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, decay_ptr, o_ptr, chunk_start_ptr,
                chunk_len_ptr, ckpt_ptr, chunk_ckpt_ptr, scale,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, CHECKPOINTS: tl.constexpr,
                PRECISION: tl.constexpr, PREFETCH: tl.constexpr):
    """One loop iteration: step chunk i_chunk with its inputs (loaded one iteration earlier with PREFETCH, else
    here) and return the new state with the inputs of chunk i_chunk + 1."""
    if PREFETCH:
        nxt = _chunk_load(i_chunk + 1, end_chunk, i_h, rows, cols_k, cols_v, w_ptr, u_ptr, qg_ptr, kd_ptr,
                          aqk_ptr, decay_ptr, chunk_start_ptr, chunk_len_ptr, H, K, V, BT, True)
    else:
        start, length, w, qg, kd, u0, aqk, decay = _chunk_load(
            i_chunk, end_chunk, i_h, rows, cols_k, cols_v, w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, decay_ptr,
            chunk_start_ptr, chunk_len_ptr, H, K, V, BT, False)
    h = _chunk_step(h, i_chunk, i_h, rows, cols_k, cols_v, h_offs,
                    start, length, w, qg, kd, u0, aqk, decay, o_ptr, ckpt_ptr, chunk_ckpt_ptr, scale,
                    H, K, V, BT, CHECKPOINTS, PRECISION)
    if PREFETCH:
        start, length, w, qg, kd, u0, aqk, decay = nxt
    return h, start, length, w, qg, kd, u0, aqk, decay

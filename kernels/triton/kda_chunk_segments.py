"""KDA chunked prefill, pass 2 over segments: the state recurrence of a few long sequences, in parallel.

The state pass (`kda_chunk_state`) walks each sequence's chunks one after another on H x V / block_v programs:
96 for one sequence of 12 heads at block_v 16, on a GPU of 132 SMs, at about 1.4 us per chunk. Per chunk the
state moves by an affine map, h <- (D - Kd^T W) h + Kd^T U0 (D = diag exp(G_last)), so a segment of chunks is
one affine map too, h_out = T h_in + b, with T [K, K] and b [K, V]. Three steps:

    A  `kda_segment_map_kernel`   every segment at once: T and b, by running the recurrence on the columns of
                                  [I | 0] (T: U0 taken as 0; b: the segment's own U0); 2x the state pass's work
    B  `kda_segment_scan_kernel`  per sequence, segment after segment: the state entering each segment, from the
                                  sequence's initial state (one [K, K] x [K, V] product per segment)
    C  the state pass itself, with every segment as a sequence of its own that starts from the state B stored:
       outputs, checkpoints and each segment's final state, in parallel over segments

C writes checkpoints from the chunk plan's per-chunk row table, which is indexed by the batch's chunk, not by
segment, so a segment may end at any chunk end and a checkpoint anywhere inside or at the end of one is written
exactly as by the unsegmented pass.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _segment_map_step(x, i_chunk, i_h, rows, cols_k, cols, w_ptr, u_ptr, kd_ptr, decay_ptr, chunk_start_ptr,
                      chunk_len_ptr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, PRECISION: tl.constexpr):
    """One chunk of the affine map on the columns `cols` of [T | b] (columns < K belong to T, whose U0 is 0)."""
    start = tl.load(chunk_start_ptr + i_chunk).to(tl.int64)
    length = tl.load(chunk_len_ptr + i_chunk)
    row_ok = rows < length
    head_row = (start + rows) * H + i_h                                         # [BT]
    mask_k = row_ok[:, None] & (cols_k < K)[None, :]
    offs_k = head_row[:, None] * K + cols_k[None, :]
    w = tl.load(w_ptr + offs_k, mask=mask_k, other=0.0)                         # [BT, BK]
    kd = tl.load(kd_ptr + offs_k, mask=mask_k, other=0.0)
    value_cols = cols - K
    u0 = tl.load(u_ptr + head_row[:, None] * V + value_cols[None, :],
                 mask=row_ok[:, None] & ((value_cols >= 0) & (value_cols < V))[None, :], other=0.0).to(tl.float32)
    decay = tl.load(decay_ptr + (i_chunk * H + i_h) * K + cols_k, mask=cols_k < K, other=0.0)
    u = u0 - tl.dot(w, x.to(w.dtype), input_precision=PRECISION)               # [BT, BC]
    return decay[:, None] * x + tl.dot(tl.trans(kd), u.to(w.dtype), input_precision=PRECISION)


@triton.jit
def kda_segment_map_kernel(
        w_ptr, u_ptr, kd_ptr, decay_ptr,                                 # workspace from kda_chunk_intra
        chunk_start_ptr, chunk_len_ptr, seg_chunk_ptr,                   # int32 tables
        map_ptr,                                                         # [segments, H, K, K + V] float32
        H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr,
        INTERPRETED: tl.constexpr, PRECISION: tl.constexpr):
    i_c = tl.program_id(0)                                               # column block of [T | b]
    i_h = tl.program_id(1)
    i_s = tl.program_id(2)
    first_chunk = tl.load(seg_chunk_ptr + i_s)
    end_chunk = tl.load(seg_chunk_ptr + i_s + 1)
    rows = tl.arange(0, BT)
    cols_k = tl.arange(0, BK)
    cols = i_c * BC + tl.arange(0, BC)
    # [I | 0]: a T column starts as the unit vector of its index, a b column as zero (its index is >= K)
    x = (cols_k[:, None] == cols[None, :]).to(tl.float32)                       # [BK, BC]
    if INTERPRETED:
        i_chunk = first_chunk
        while i_chunk < end_chunk:
            x = _segment_map_step(x, i_chunk, i_h, rows, cols_k, cols, w_ptr, u_ptr, kd_ptr, decay_ptr,
                                  chunk_start_ptr, chunk_len_ptr, H, K, V, PRECISION)
            i_chunk += 1
    else:
        for i_chunk in range(first_chunk, end_chunk):
            x = _segment_map_step(x, i_chunk, i_h, rows, cols_k, cols, w_ptr, u_ptr, kd_ptr, decay_ptr,
                                  chunk_start_ptr, chunk_len_ptr, H, K, V, PRECISION)
    offs = (i_s * H + i_h).to(tl.int64) * K * (K + V) + cols_k[:, None] * (K + V) + cols[None, :]
    tl.store(map_ptr + offs, x, mask=(cols_k < K)[:, None] & (cols < K + V)[None, :])


@triton.jit
def _segment_scan_step(h, i_s, i_h, cols_k, cols_v, map_ptr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       PRECISION: tl.constexpr):
    """The state after segment i_s from the state entering it: T h + b, in float32 with the pass's product
    precision (tf32 for 16-bit inputs, as the state pass's own products round h to the input dtype)."""
    base = (i_s * H + i_h).to(tl.int64) * K * (K + V)
    k_ok = cols_k < K
    t = tl.load(map_ptr + base + cols_k[:, None] * (K + V) + cols_k[None, :], mask=k_ok[:, None] & k_ok[None, :],
                other=0.0)                                                      # [BK, BK]
    b = tl.load(map_ptr + base + cols_k[:, None] * (K + V) + K + cols_v[None, :],
                mask=k_ok[:, None] & (cols_v < V)[None, :], other=0.0)         # [BK, BV]
    return tl.dot(t, h, input_precision=PRECISION) + b


@triton.jit
def kda_segment_scan_kernel(
        map_ptr,                                                         # [segments, H, K, K + V] float32
        state_ptr, state_stride, slot_ptr, has_init_ptr,                 # the pool, as kda_chunk_state reads it
        seq_seg_ptr,                                                     # int32 [B + 1]: segments of each sequence
        seg_state_ptr,                                                   # [segments, H, V, K] float32, written
        H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
        INTERPRETED: tl.constexpr, PRECISION: tl.constexpr):
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2)
    first_seg = tl.load(seq_seg_ptr + i_b)
    end_seg = tl.load(seq_seg_ptr + i_b + 1)
    slot = tl.load(slot_ptr + i_b).to(tl.int64)
    has_init = tl.load(has_init_ptr + i_b) != 0
    cols_k = tl.arange(0, BK)
    cols_v = i_v * BV + tl.arange(0, BV)
    mask_h = (cols_k < K)[:, None] & (cols_v < V)[None, :]
    h_offs = i_h * V * K + cols_v[None, :] * K + cols_k[:, None]                # [BK, BV], h[k, v] = S[v, k]
    h = tl.load(state_ptr + slot * state_stride + h_offs, mask=mask_h & has_init, other=0.0)
    if INTERPRETED:
        i_s = first_seg
        while i_s < end_seg:
            tl.store(seg_state_ptr + i_s.to(tl.int64) * (H * V * K) + h_offs, h, mask=mask_h)
            h = _segment_scan_step(h, i_s, i_h, cols_k, cols_v, map_ptr, H, K, V, PRECISION)
            i_s += 1
    else:
        for i_s in range(first_seg, end_seg):
            tl.store(seg_state_ptr + i_s.to(tl.int64) * (H * V * K) + h_offs, h, mask=mask_h)
            h = _segment_scan_step(h, i_s, i_h, cols_k, cols_v, map_ptr, H, K, V, PRECISION)

"""MLA prefill: flash attention over a variable-length batch, causal with the queries aligned to the end of the keys.

A sequence may bring a cached prefix: with Lq queries and Lk keys, query i sees keys j <= Lk - Lq + i. One program
owns BLOCK_M queries of one head of one sequence and streams the keys in BLOCK_N tiles with an online softmax
(base 2, the scale folded into log2(e)). The q/k head dim need not be a power of two (MLA: 192 = 128 nope + 64 rope):
it is split into a power-of-two head part and a masked tail, two tl.dot calls summed into the same scores. Key tiles
wholly below the diagonal skip the causal mask; only the tiles that cross it pay for it.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.triton.host_index import index_tables
from kernels.triton.tuning_ops import mla_prefill_config


@triton.jit
def _attend_tile(q_head, q_tail, k_ptr, v_ptr, k_token_stride, v_token_stride, key_start, key_limit, n_start,
                 rows, row_limit_offset, cols_head, cols_tail, tail_mask, cols_v, v_mask, scale_log2,
                 running_max, denominator, acc, HAS_TAIL: tl.constexpr, MASKED: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    keys = n_start + tl.arange(0, BLOCK_N)                                      # [BLOCK_N]
    key_mask = keys < key_limit
    key_rows = (key_start + keys).to(tl.int64)
    k_head = tl.load(k_ptr + key_rows[None, :] * k_token_stride + cols_head[:, None],
                     mask=key_mask[None, :], other=0.0)                         # [HEAD_A, BLOCK_N]
    scores = tl.dot(q_head, k_head, input_precision="ieee")                     # [BLOCK_M, BLOCK_N]
    if HAS_TAIL:
        k_tail = tl.load(k_ptr + key_rows[None, :] * k_token_stride + cols_tail[:, None],
                         mask=key_mask[None, :] & tail_mask[:, None], other=0.0)  # [BLOCK_TAIL, BLOCK_N]
        scores += tl.dot(q_tail, k_tail, input_precision="ieee")
    scores = scores * scale_log2
    if MASKED:
        visible = (keys[None, :] <= rows[:, None] + row_limit_offset) & key_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))                   # [BLOCK_M]
    rescale = tl.exp2(running_max - new_max)
    probs = tl.exp2(scores - new_max[:, None])                                  # [BLOCK_M, BLOCK_N]
    denominator = denominator * rescale + tl.sum(probs, axis=1)
    values = tl.load(v_ptr + key_rows[:, None] * v_token_stride + cols_v[None, :],
                     mask=key_mask[:, None] & v_mask[None, :], other=0.0)       # [BLOCK_N, BLOCK_V]
    acc = acc * rescale[:, None] + tl.dot(probs.to(values.dtype), values, input_precision="ieee")
    return new_max, denominator, acc


@triton.jit
def _mla_prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr,
                        q_token_stride, q_head_stride, k_token_stride, k_head_stride, v_token_stride, v_head_stride,
                        out_token_stride, out_head_stride, head_dim_qk, head_dim_v, scale_log2,
                        HEAD_A: tl.constexpr, BLOCK_TAIL: tl.constexpr, HAS_TAIL: tl.constexpr,
                        BLOCK_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # the last query blocks see the most keys: launch them first so the tail of the grid is short work
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2).to(tl.int64)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    key_start = tl.load(cu_seqlens_k_ptr + seq)
    key_len = tl.load(cu_seqlens_k_ptr + seq + 1) - key_start
    row_limit_offset = key_len - q_len                     # query row r sees keys <= r + row_limit_offset

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)       # [BLOCK_M]
    row_mask = rows < q_len
    q_rows = (q_start + rows).to(tl.int64)
    cols_head = tl.arange(0, HEAD_A)
    cols_tail = HEAD_A + tl.arange(0, BLOCK_TAIL)
    tail_mask = cols_tail < head_dim_qk
    cols_v = tl.arange(0, BLOCK_V)
    v_mask = cols_v < head_dim_v
    q_base = q_ptr + q_rows[:, None] * q_token_stride + head * q_head_stride
    q_head = tl.load(q_base + cols_head[None, :], mask=row_mask[:, None], other=0.0)           # [BLOCK_M, HEAD_A]
    q_tail = tl.load(q_base + cols_tail[None, :], mask=row_mask[:, None] & tail_mask[None, :],
                     other=0.0)                                                                  # [BLOCK_M, BLOCK_TAIL]
    k_head_ptr = k_ptr + head * k_head_stride
    v_head_ptr = v_ptr + head * v_head_stride

    running_max = tl.full((BLOCK_M,), -3.0e38, tl.float32)
    denominator = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_V), tl.float32)
    # tiles every row of the block sees completely: no mask needed
    first_row_limit = tl.minimum(tl.maximum(m_block * BLOCK_M + row_limit_offset + 1, 0), key_len)
    unmasked_end = (first_row_limit // BLOCK_N) * BLOCK_N
    for n_start in range(0, unmasked_end, BLOCK_N):
        running_max, denominator, acc = _attend_tile(
            q_head, q_tail, k_head_ptr, v_head_ptr, k_token_stride, v_token_stride, key_start, key_len, n_start,
            rows, row_limit_offset, cols_head, cols_tail, tail_mask, cols_v, v_mask, scale_log2,
            running_max, denominator, acc, HAS_TAIL=HAS_TAIL, MASKED=False, BLOCK_N=BLOCK_N)
    key_end = tl.minimum(key_len, (m_block + 1) * BLOCK_M + row_limit_offset)
    for n_start in range(unmasked_end, key_end, BLOCK_N):
        running_max, denominator, acc = _attend_tile(
            q_head, q_tail, k_head_ptr, v_head_ptr, k_token_stride, v_token_stride, key_start, key_len, n_start,
            rows, row_limit_offset, cols_head, cols_tail, tail_mask, cols_v, v_mask, scale_log2,
            running_max, denominator, acc, HAS_TAIL=HAS_TAIL, MASKED=True, BLOCK_N=BLOCK_N)
    # a query that sees no key (only when Lq > Lk) gets zeros rather than 0/0
    out = acc / tl.where(denominator > 0, denominator, 1.0)[:, None]
    out_ptrs = out_ptr + q_rows[:, None] * out_token_stride + head * out_head_stride + cols_v[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & v_mask[None, :])


def split_head_dim(head_dim: int) -> tuple[int, int]:
    """(power-of-two head part, padded tail block): 192 -> (128, 64), 24 -> (16, 16); tail 0 when a power of two."""
    head = 1 << (head_dim.bit_length() - 1)
    tail = head_dim - head
    return head, (max(16, triton.next_power_of_2(tail)) if tail else 0)


def mla_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_k: torch.Tensor, scale: float) -> torch.Tensor:
    num_q_tokens, num_heads, head_dim_qk = q.shape
    head_dim_v = v.shape[2]
    if k.shape[1:] != (num_heads, head_dim_qk) or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"mla_prefill needs k [Tk, {num_heads}, {head_dim_qk}] and v [Tk, {num_heads}, Dv], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if head_dim_qk < 16:
        raise ValueError(f"mla_prefill needs a q/k head dim of at least 16 (tl.dot), got {head_dim_qk}")
    q, k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty(num_q_tokens, num_heads, head_dim_v, dtype=q.dtype, device=q.device)   # [Tq, H, Dv]
    num_seqs = cu_seqlens_q.numel() - 1
    if num_q_tokens == 0 or num_seqs == 0:
        return out
    # the grid needs the longest query run: free when the caller passes cu_seqlens on the host (the model does;
    # both then reach the device in one non-blocking copy), else one device->host copy that waits for the GPU
    if cu_seqlens_q.device.type == "cpu" and q.device.type != "cpu":
        bounds_q = cu_seqlens_q.tolist()
        max_q_len = max(b - a for a, b in zip(bounds_q[:-1], bounds_q[1:]))
        cu_seqlens_q, cu_seqlens_k = index_tables([bounds_q, cu_seqlens_k.tolist()], q.device)
    else:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        cu_seqlens_k = cu_seqlens_k.to(q.device)
    config = mla_prefill_config(q.device, head_dim_qk, q.element_size())
    head_part, tail_block = split_head_dim(head_dim_qk)
    grid = (triton.cdiv(max_q_len, config.block_m), num_seqs, num_heads)
    _mla_prefill_kernel[grid](
        q, k, v, out, cu_seqlens_q, cu_seqlens_k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        head_dim_qk, head_dim_v, scale * math.log2(math.e),
        HEAD_A=head_part, BLOCK_TAIL=max(tail_block, 16), HAS_TAIL=tail_block > 0,
        BLOCK_V=max(16, triton.next_power_of_2(head_dim_v)), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out

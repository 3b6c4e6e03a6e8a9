"""Absorbed MLA decode over the paged latent cache, split across programs (split-KV) and merged by LSE.

Stage 1: program (request b, head block, split s) reads the cache entries of its split of request b once for BLOCK_H
heads (all heads share the latent KV), keeps an online softmax, and writes a float32 partial output and its
natural-log LSE. Each latent entry is split at v_dim: its first v_dim columns serve both as the key's head part and as
the value (one load, two tl.dot), the remaining D_latent - v_dim (the rope part) only enter the scores. The value
columns come in two halves with their own score products and accumulators (two independent MMA chains where one
576-deep chain was), and q is read inside the tile step so that it lives in shared memory rather than in registers.
Stage 2: programs (request, head, value block) merge the active splits of the request by their LSE, MERGE_S
splits per step so that a long context's hundreds of splits are not read one dependent load at a time.

Two ways to address a tile of BLOCK_N entries (`MlaDecodeConfig.tiles`):
- "page" (BLOCK_N divides page_size): a tile lies inside one page, so one page id is loaded per tile (prefetched a
  tile ahead) and the tile is BLOCK_N consecutive rows from one base; whole tiles load without a row mask and only
  the split's last partial tile is masked.
- "gather" (any page size): one page id per entry, every row addressed on its own.

The split length is chosen from the page table's capacity (max_pages * page_size), not from seq_lens, so there is
no device->host sync and the launch can be captured in a graph; splits past a request's length exit at once. Size
the page table to the batch (max pages of its longest request) so that short batches still spread over the GPU.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from k3core.ops import MlaDecodeOut
from kernels.triton.tuning_ops import (
    MLA_DECODE_SPLIT_POLICIES,
    MLA_DECODE_TILES,
    MlaDecodeConfig,
    compute_units,
    mla_decode_config,
)

LN2 = math.log(2.0)


@triton.jit
def _attend_tile(q_rows, head_mask, rows, row_mask, cols_lo, lo_mask, cols_hi, hi_mask, cols_rope, rope_mask,
                 running_max, denominator, acc_lo, acc_hi, scale_log2, HAS_ROPE: tl.constexpr,
                 MASK_ROWS: tl.constexpr):
    """One online-softmax step over the entries whose row pointers are `rows` [BLOCK_N]; the value columns come in
    two halves (lo, hi), each with its own score product and accumulator."""
    if MASK_ROWS:
        lo_tile_mask = row_mask[:, None] & lo_mask[None, :]
        hi_tile_mask = row_mask[:, None] & hi_mask[None, :]
        rope_tile_mask = row_mask[:, None] & rope_mask[None, :]
    else:
        lo_tile_mask = lo_mask[None, :]
        hi_tile_mask = hi_mask[None, :]
        rope_tile_mask = rope_mask[None, :]
    kv_lo = tl.load(rows[:, None] + cols_lo[None, :], mask=lo_tile_mask, other=0.0)          # [BLOCK_N, HALF_V]
    kv_hi = tl.load(rows[:, None] + cols_hi[None, :], mask=hi_tile_mask, other=0.0)
    q_lo = tl.load(q_rows + cols_lo[None, :], mask=head_mask[:, None] & lo_mask[None, :], other=0.0)
    q_hi = tl.load(q_rows + cols_hi[None, :], mask=head_mask[:, None] & hi_mask[None, :], other=0.0)
    scores_lo = tl.dot(q_lo, tl.trans(kv_lo), input_precision="ieee")                        # [BLOCK_H, BLOCK_N]
    scores_hi = tl.dot(q_hi, tl.trans(kv_hi), input_precision="ieee")
    if HAS_ROPE:
        kv_rope = tl.load(rows[:, None] + cols_rope[None, :], mask=rope_tile_mask, other=0.0)   # [BLOCK_N, R]
        q_rope = tl.load(q_rows + cols_rope[None, :], mask=head_mask[:, None] & rope_mask[None, :], other=0.0)
        scores_hi = tl.dot(q_rope, tl.trans(kv_rope), scores_hi, input_precision="ieee")
    scores = scores_lo + scores_hi
    if MASK_ROWS:
        scores = tl.where(row_mask[None, :], scores * scale_log2, float("-inf"))
    else:
        scores = scores * scale_log2
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    rescale = tl.exp2(running_max - new_max)
    probs = tl.exp2(scores - new_max[:, None])                                               # [BLOCK_H, BLOCK_N]
    denominator = denominator * rescale + tl.sum(probs, axis=1)
    weights = probs.to(kv_lo.dtype)
    acc_lo = acc_lo * rescale[:, None] + tl.dot(weights, kv_lo, input_precision="ieee")
    acc_hi = acc_hi * rescale[:, None] + tl.dot(weights, kv_hi, input_precision="ieee")
    return new_max, denominator, acc_lo, acc_hi


@triton.jit
def _mla_decode_split_kernel(q_ptr, kv_ptr, page_table_ptr, seq_lens_ptr, mid_out_ptr, mid_lse_ptr,
                             q_batch_stride, q_head_stride, kv_page_stride, kv_slot_stride, page_table_stride,
                             mid_out_batch_stride, mid_out_head_stride, mid_out_split_stride,
                             mid_lse_batch_stride, mid_lse_head_stride,
                             num_heads, v_dim, latent_dim, split_len, scale_log2, ln2,
                             PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, HAS_ROPE: tl.constexpr,
                             PAGE_TILES: tl.constexpr):
    batch = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + batch)
    split_start = split * split_len
    if split_start >= seq_len:
        return
    split_end = tl.minimum(split_start + split_len, seq_len)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)                        # [BLOCK_H]
    head_mask = heads < num_heads
    HALF_V: tl.constexpr = BLOCK_V // 2
    cols_lo = tl.arange(0, HALF_V)
    lo_mask = cols_lo < v_dim
    cols_hi = HALF_V + tl.arange(0, HALF_V)
    hi_mask = cols_hi < v_dim
    cols_rope = v_dim + tl.arange(0, BLOCK_R)
    rope_mask = cols_rope < latent_dim
    # q is read inside the tile step, not held across the loop: Triton then keeps it in shared memory and reads it
    # per MMA step, where a register copy took 144 registers a thread (sm_90, 64-entry tiles on 8 warps: 255 with a
    # spill before, 196 and none since)
    q_rows = q_ptr + batch * q_batch_stride + heads[:, None] * q_head_stride               # [BLOCK_H, 1]

    running_max = tl.full((BLOCK_H,), -3.0e38, tl.float32)
    denominator = tl.zeros((BLOCK_H,), tl.float32)
    acc_lo = tl.zeros((BLOCK_H, HALF_V), tl.float32)
    acc_hi = tl.zeros((BLOCK_H, HALF_V), tl.float32)
    row_pages = page_table_ptr + batch * page_table_stride
    tile_rows = tl.arange(0, BLOCK_N)                                           # [BLOCK_N]
    if PAGE_TILES:
        # split_start is a multiple of BLOCK_N (split_len is), so every tile starts inside one page
        whole_end = split_start + (split_end - split_start) // BLOCK_N * BLOCK_N
        page = tl.load(row_pages + split_start // PAGE_SIZE).to(tl.int64)
        for n_start in range(split_start, whole_end, BLOCK_N):
            next_start = n_start + BLOCK_N
            # the next tile's page id is read before this tile is used, so its latency overlaps this tile's loads
            next_page = tl.load(row_pages + next_start // PAGE_SIZE, mask=next_start < split_end, other=0).to(tl.int64)
            rows = kv_ptr + page * kv_page_stride + (n_start % PAGE_SIZE + tile_rows) * kv_slot_stride
            running_max, denominator, acc_lo, acc_hi = _attend_tile(
                q_rows, head_mask, rows, tile_rows < BLOCK_N, cols_lo, lo_mask, cols_hi, hi_mask, cols_rope,
                rope_mask, running_max, denominator, acc_lo, acc_hi, scale_log2, HAS_ROPE, False)
            page = next_page
        if whole_end < split_end:                                               # `page` is whole_end's page here
            rows = kv_ptr + page * kv_page_stride + (whole_end % PAGE_SIZE + tile_rows) * kv_slot_stride
            running_max, denominator, acc_lo, acc_hi = _attend_tile(
                q_rows, head_mask, rows, whole_end + tile_rows < split_end, cols_lo, lo_mask, cols_hi, hi_mask,
                cols_rope, rope_mask, running_max, denominator, acc_lo, acc_hi, scale_log2, HAS_ROPE, True)
    else:
        for n_start in range(split_start, split_end, BLOCK_N):
            positions = n_start + tile_rows                                     # [BLOCK_N]
            position_mask = positions < split_end
            pages = tl.load(row_pages + positions // PAGE_SIZE, mask=position_mask, other=0).to(tl.int64)
            rows = kv_ptr + pages * kv_page_stride + (positions % PAGE_SIZE).to(tl.int64) * kv_slot_stride
            running_max, denominator, acc_lo, acc_hi = _attend_tile(
                q_rows, head_mask, rows, position_mask, cols_lo, lo_mask, cols_hi, hi_mask, cols_rope, rope_mask,
                running_max, denominator, acc_lo, acc_hi, scale_log2, HAS_ROPE, True)

    out_row = (mid_out_ptr + batch * mid_out_batch_stride + heads[:, None] * mid_out_head_stride
               + split * mid_out_split_stride)
    tl.store(out_row + cols_lo[None, :], acc_lo / denominator[:, None], mask=head_mask[:, None] & lo_mask[None, :])
    tl.store(out_row + cols_hi[None, :], acc_hi / denominator[:, None], mask=head_mask[:, None] & hi_mask[None, :])
    lse = (running_max + tl.log2(denominator)) * ln2                            # natural log
    tl.store(mid_lse_ptr + batch * mid_lse_batch_stride + heads * mid_lse_head_stride + split, lse, mask=head_mask)


@triton.jit
def _mla_decode_merge_kernel(mid_out_ptr, mid_lse_ptr, seq_lens_ptr, out_ptr, lse_ptr,
                             mid_out_batch_stride, mid_out_head_stride, mid_out_split_stride,
                             mid_lse_batch_stride, mid_lse_head_stride, out_batch_stride, out_head_stride,
                             lse_batch_stride, v_dim, split_len,
                             BLOCK_S: tl.constexpr, MERGE_S: tl.constexpr, BLOCK_V: tl.constexpr):
    batch = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)                   # [BLOCK_V]
    num_active = tl.cdiv(tl.load(seq_lens_ptr + batch), split_len)
    splits = tl.arange(0, BLOCK_S)
    lse_row = mid_lse_ptr + batch * mid_lse_batch_stride + head * mid_lse_head_stride
    split_lse = tl.load(lse_row + splits, mask=splits < num_active, other=float("-inf"))   # [BLOCK_S]
    max_lse = tl.max(split_lse, axis=0)
    total = tl.sum(tl.exp(split_lse - max_lse), axis=0)
    mask = cols < v_dim
    acc = tl.zeros((BLOCK_V,), tl.float32)
    partial_row = mid_out_ptr + batch * mid_out_batch_stride + head * mid_out_head_stride
    chunk = tl.arange(0, MERGE_S)
    for first in range(0, num_active, MERGE_S):
        step_splits = first + chunk                                             # [MERGE_S]
        active = step_splits < num_active
        weights = tl.exp(tl.load(lse_row + step_splits, mask=active, other=float("-inf")) - max_lse)
        partials = tl.load(partial_row + step_splits[:, None] * mid_out_split_stride + cols[None, :],
                           mask=active[:, None] & mask[None, :], other=0.0)     # [MERGE_S, BLOCK_V]
        acc += tl.sum(weights[:, None] * partials, axis=0)
    tl.store(out_ptr + batch * out_batch_stride + head * out_head_stride + cols,
             (acc / total).to(out_ptr.dtype.element_ty), mask=mask)
    if tl.program_id(2) == 0:
        tl.store(lse_ptr + batch * lse_batch_stride + head, max_lse + tl.log(total))


def choose_num_splits(device: torch.device, batch: int, num_head_blocks: int, capacity: int, block_n: int,
                      programs_per_unit: int = 2, split_policy: str = "cover") -> int:
    """How many splits of the context, never one shorter than 4 key tiles. "cover": enough splits for at least
    `programs_per_unit` programs per SM/CU. "waves": the count whose programs finish soonest when they run in waves
    of `programs_per_unit` per SM/CU (the fewest such splits on a tie): "cover" rounds up, which can leave a last
    wave mostly idle (64 requests on 132 SMs: 3 splits make 192 programs, 1.45 waves; 2 make one full wave)."""
    if split_policy not in MLA_DECODE_SPLIT_POLICIES:
        raise ValueError(f"mla_decode: unknown split_policy {split_policy!r}; choose one of: "
                         f"{', '.join(MLA_DECODE_SPLIT_POLICIES)}")
    return _num_splits(max(1, batch * num_head_blocks), max(1, triton.cdiv(capacity, 4 * block_n)),
                       programs_per_unit * compute_units(device), split_policy)


@functools.lru_cache(maxsize=1024)
def _num_splits(requests: int, longest: int, slots: int, split_policy: str) -> int:
    """choose_num_splits on plain integers, cached: an eager decode step asks it once per MLA layer."""
    cover = max(1, min(triton.cdiv(slots, requests), longest))
    if split_policy == "cover":
        return cover
    # time ~ waves x split length ~ ceil(requests * s / slots) / s, searched up to "cover"'s count (more splits
    # only add merge work and shorter splits)
    return min(range(1, cover + 1), key=lambda s: (triton.cdiv(requests * s, slots) / s, s))


def _check_config(config: MlaDecodeConfig, page_size: int) -> None:
    if config.tiles not in MLA_DECODE_TILES:
        raise ValueError(f"mla_decode: unknown tiles {config.tiles!r}; choose one of: {', '.join(MLA_DECODE_TILES)}")
    if config.tiles == "page" and page_size % config.block_n != 0:
        raise ValueError(f"mla_decode: 'page' tiles need block_n ({config.block_n}) to divide the page size "
                         f"({page_size}); use 'gather' tiles or a smaller block_n")
    if config.split_policy not in MLA_DECODE_SPLIT_POLICIES:
        raise ValueError(f"mla_decode: unknown split_policy {config.split_policy!r}; choose one of: "
                         f"{', '.join(MLA_DECODE_SPLIT_POLICIES)}")
    if config.merge_splits < 1 or config.merge_splits & (config.merge_splits - 1):
        raise ValueError(f"mla_decode: merge_splits must be a power of two, got {config.merge_splits}")


def mla_decode_with_splits(q: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, v_dim: int, num_splits: int,
                           config: MlaDecodeConfig | None = None) -> MlaDecodeOut:
    """`mla_decode` with the number of context splits (and optionally the tiles) given: tests and tuning pin them."""
    batch, num_heads, latent_dim = q.shape
    page_size = kv_cache.shape[1]
    if kv_cache.shape[2] != latent_dim or not 16 <= v_dim <= latent_dim:
        raise ValueError(f"mla_decode: q is {latent_dim} wide, kv_cache {tuple(kv_cache.shape)}, v_dim {v_dim}; the "
                         f"latent widths must match and 16 <= v_dim <= D_latent")
    if q.stride(2) != 1:
        q = q.contiguous()
    if kv_cache.stride(2) != 1:
        raise ValueError("mla_decode needs the kv_cache's last dim contiguous (entries stored as rows)")
    out = torch.empty(batch, num_heads, v_dim, dtype=q.dtype, device=q.device)      # [B, H, V]
    lse = torch.empty(batch, num_heads, dtype=torch.float32, device=q.device)       # [B, H]
    if batch == 0:
        return MlaDecodeOut(out, lse)
    config = config or mla_decode_config(q.device, num_heads, batch, page_size, kv_cache.element_size())
    _check_config(config, page_size)
    capacity = page_table.shape[1] * page_size
    split_len = triton.cdiv(triton.cdiv(capacity, num_splits), config.block_n) * config.block_n
    num_splits = triton.cdiv(capacity, split_len)
    block_v = max(32, triton.next_power_of_2(v_dim))     # two halves of >= 16 columns (the dot's smallest K)
    rope_dim = latent_dim - v_dim
    mid_out = torch.empty(batch, num_heads, num_splits, v_dim, dtype=torch.float32, device=q.device)  # [B, H, S, V]
    mid_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)        # [B, H, S]
    grid = (batch, triton.cdiv(num_heads, config.block_h), num_splits)
    _mla_decode_split_kernel[grid](
        q, kv_cache, page_table, seq_lens, mid_out, mid_lse,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), page_table.stride(0),
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        num_heads, v_dim, latent_dim, split_len, scale / LN2, LN2,
        PAGE_SIZE=page_size, BLOCK_H=config.block_h, BLOCK_N=config.block_n, BLOCK_V=block_v,
        BLOCK_R=max(16, triton.next_power_of_2(max(rope_dim, 1))), HAS_ROPE=rope_dim > 0,
        PAGE_TILES=config.tiles == "page", num_warps=config.num_warps, num_stages=config.num_stages)
    merge_block_v = min(block_v, config.merge_block_v or block_v)
    _mla_decode_merge_kernel[(batch, num_heads, triton.cdiv(v_dim, merge_block_v))](
        mid_out, mid_lse, seq_lens, out, lse,
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), v_dim, split_len,
        BLOCK_S=triton.next_power_of_2(num_splits), MERGE_S=config.merge_splits, BLOCK_V=merge_block_v,
        num_warps=4 if merge_block_v * config.merge_splits >= 512 else 1)
    return MlaDecodeOut(out, lse)


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
               scale: float, v_dim: int, config: MlaDecodeConfig | None = None) -> MlaDecodeOut:
    """The op (see `k3core.ops`); `config` defaults to the tuning table's entry for this target and batch."""
    config = config or mla_decode_config(q.device, q.shape[1], q.shape[0], kv_cache.shape[1], kv_cache.element_size())
    capacity = page_table.shape[1] * kv_cache.shape[1]
    num_splits = choose_num_splits(q.device, q.shape[0], triton.cdiv(q.shape[1], config.block_h), capacity,
                                   config.block_n, config.programs_per_unit, config.split_policy)
    return mla_decode_with_splits(q, kv_cache, page_table, seq_lens, scale, v_dim, num_splits, config)

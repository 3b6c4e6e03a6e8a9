"""The MoE bookkeeping: (token, choice) pairs grouped by local expert into BLOCK_M-row blocks of one expert each.

Two ways to the same `ExpertBlocks`, bit for bit:
- `_group_pairs_kernel`, one Triton program holding every pair, for decode-sized batches (up to SMALL_BATCH_PAIRS
  pairs). At BS=1 the torch form below is about fifteen small kernels per MoE layer (a radix sort, two searchsorted,
  a scan, two scatters, fills and index arithmetic); in a k3-mini decode step under a CUDA graph those cost more
  than the MoE routing itself (bench/results/model-k3-mini-nvidia-h200.md lists them).
- the torch form (sort, searchsorted, cumsum, scatter on the device, no host sync) for everything larger.
Pairs routed to experts of other ranks (expert parallelism) are dropped in both. `split_tail_pairs` cuts each
expert's pairs past its whole blocks off for blocks of another height (the MXFP4 prefill's two block heights).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

# One program holds every pair (a sort of up to 1024 keys). The form before it walked the pairs in chunks of <= 64,
# twice, with cross-warp scans a chunk: on the H200 (2d1109e, bench/results/moe-mxfp4-nvidia-h200.md) 11 us per
# call at 16 pairs and 125 us at 1024 (K3 at 64 tokens: 14% of the MXFP4 experts' step); at 4c3ddb0 it was 5 us at
# 8 pairs against ~45 us of torch kernels. Not timed between 1024 and 4096 pairs (a 512-token prefill chunk at
# top-8 is 4096), so prefill-sized batches keep the torch form.
SMALL_BATCH_PAIRS = 1024
MAX_KERNEL_EXPERTS = 1024


def grouping_warps(p_block: int) -> int:
    """The one-program grouping's warps for P_BLOCK pairs: its sort's and histogram's work spread over more threads
    where there is enough of it. An H100 scratch timing at acf523b (every output equal to the torch form) gave 18.5 /
    15.6 / 14.1 us at 4 / 8 / 16 warps for 1024 pairs (K3 at 64 tokens), 6.0 / 5.3 / 5.4 for 512, and 4 warps best
    or tied at 16-256; in `bench.moe_mxfp4_bench`'s profile at 64 tokens, 21.6 -> 13.2 us a call in three H100 calls
    (bench/results/moe-mxfp4-even-n-nvidia-h100-80gb-hbm3.md)."""
    return 16 if p_block >= 1024 else 8 if p_block >= 512 else 4


class ExpertBlocks(NamedTuple):
    sorted_pairs: torch.Tensor     # int64 [num_blocks * BLOCK_M]: pair index t * k + j, num_pairs in padding rows
    block_experts: torch.Tensor    # int64 [num_blocks]: local expert of each block, num_experts for an idle block
    row_of_pair: torch.Tensor      # int64 [num_pairs]: the sorted row of each local pair, num_blocks * BLOCK_M
    #                                for another rank's pair


def sort_pairs_by_expert(expert_ids: torch.Tensor, expert_offset: int,
                         num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, choice) pairs ordered by local expert, on the device: (sorted key [P], order [P], end [E]).
    Pair order[i] has local expert sorted_key[i] (num_experts for another rank's expert: those sort last), and
    expert e's pairs end at row end[e]. Shared by the Triton path and the torch._grouped_mm provider."""
    local = expert_ids.reshape(-1).long() - expert_offset                       # [P]
    mine = (local >= 0) & (local < num_experts)
    key = torch.where(mine, local, torch.full_like(local, num_experts))
    sorted_key, order = torch.sort(key, stable=True)                            # [P]
    experts = torch.arange(num_experts, device=local.device)
    return sorted_key, order, torch.searchsorted(sorted_key, experts, right=True)


class PairRanks(NamedTuple):
    """The pairs in expert order with each one's place in its expert (`pair_ranks`)."""
    sorted_key: torch.Tensor       # int64 [P]: local expert of sorted pair i (num_experts: another rank's)
    order: torch.Tensor            # int64 [P]: the pair index of sorted pair i
    counts: torch.Tensor           # int64 [E]: local pairs per expert
    rank: torch.Tensor             # int64 [P]: sorted pair i's rank among its expert's pairs (by pair index)
    safe_key: torch.Tensor         # sorted_key clamped to a real expert, for gathers over [E]


def pair_ranks(expert_ids: torch.Tensor, expert_offset: int, num_experts: int) -> PairRanks:
    """`sort_pairs_by_expert` plus the per-expert counts and each pair's rank within its expert, on the device."""
    sorted_key, order, count_end = sort_pairs_by_expert(expert_ids, expert_offset, num_experts)
    counts = torch.diff(count_end, prepend=count_end.new_zeros(1))              # [E]
    safe_key = sorted_key.clamp(max=num_experts - 1)
    rank = torch.arange(order.numel(), device=order.device) - (count_end - counts)[safe_key]
    return PairRanks(sorted_key, order, counts, rank, safe_key)


def split_tail_pairs(expert_ids: torch.Tensor, expert_offset: int, num_experts: int,
                     block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(whole, tail) expert ids [T, k] for two block heights: a pair is in `tail` when its expert has more than
    `block_m` local pairs and it is past the expert's last whole block (by pair index, as the stable sort orders
    them); the other side holds `expert_offset + num_experts` there (another rank's expert: dropped by the
    grouping). Experts with at most one block keep every pair whole, so nothing is cut into shorter blocks below
    one full one. On the device, no sync."""
    ranks = pair_ranks(expert_ids, expert_offset, num_experts)
    counts = ranks.counts
    whole = torch.where(counts > block_m, counts // block_m * block_m, counts)      # [E] pairs in whole blocks
    tail_sorted = (ranks.sorted_key < num_experts) & (ranks.rank >= whole[ranks.safe_key])
    tail = torch.empty_like(tail_sorted).scatter_(0, ranks.order, tail_sorted).view(expert_ids.shape)
    elsewhere = torch.full_like(expert_ids, expert_offset + num_experts)
    return torch.where(tail, elsewhere, expert_ids), torch.where(tail, expert_ids, elsewhere)


def num_expert_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The static bound on blocks, so nothing waits for the device; blocks past the last expert's are idle (their
    programs exit at once, but each still takes a launch slot: at K3's decode shapes the looser bound
    cdiv(P, BLOCK_M) + E launched 113 row blocks for 16 pairs, 97 of them idle, in every column block).

    The bound is tight. With n experts holding pairs (n <= m = min(P, E)), expert e's cdiv(c_e, BLOCK_M) blocks are
    1 + floor((c_e - 1) / BLOCK_M), so all of them are at most n + floor((P - n) / BLOCK_M), which grows with n
    (one more expert adds a block and takes at most one away): m + floor((P - m) / BLOCK_M), reached by m - 1
    experts with one pair each and the rest on one expert."""
    busy = min(num_pairs, num_experts)
    return busy + (num_pairs - busy) // block_m


def one_program(num_pairs: int, num_experts: int) -> bool:
    """Whether `group_pairs_by_expert` groups this many pairs with the one-program kernel."""
    return num_pairs <= SMALL_BATCH_PAIRS and num_experts <= MAX_KERNEL_EXPERTS


def group_pairs_by_expert(expert_ids: torch.Tensor, expert_offset: int, num_experts: int,
                          block_m: int) -> ExpertBlocks:
    """Sort the (token, choice) pairs by local expert (stable: by pair index within an expert) into BLOCK_M-row
    blocks of one expert each; one Triton program for decode-sized batches, torch otherwise (same result)."""
    if one_program(expert_ids.numel(), num_experts):
        return group_pairs_small(expert_ids, expert_offset, num_experts, block_m)
    return group_pairs_torch(expert_ids, expert_offset, num_experts, block_m)


def group_pairs_torch(expert_ids: torch.Tensor, expert_offset: int, num_experts: int,
                      block_m: int) -> ExpertBlocks:
    sorted_key, order, counts, rank_in_expert, safe_key = pair_ranks(expert_ids, expert_offset, num_experts)
    num_pairs = order.numel()
    device = order.device
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded                                          # [E]
    num_blocks = num_expert_blocks(num_pairs, num_experts, block_m)
    capacity = num_blocks * block_m
    # pairs of other ranks go to one extra dump row that is cut off below
    destination = torch.where(sorted_key < num_experts, padded_start[safe_key] + rank_in_expert,
                              torch.full_like(sorted_key, capacity))           # [P] sorted row of order[i]
    sorted_pairs = torch.full((capacity + 1,), num_pairs, dtype=torch.long, device=device)
    sorted_pairs.scatter_(0, destination, order)
    row_of_pair = torch.empty_like(order).scatter_(0, order, destination)       # [P]
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_experts = torch.searchsorted(padded_end, block_starts, right=True)    # [num_blocks], E when idle
    return ExpertBlocks(sorted_pairs[:capacity], block_experts, row_of_pair)


@triton.jit
def group_pairs_program(expert_ids_ptr, sorted_pairs_ptr, block_experts_ptr, row_of_pair_ptr,
                        num_pairs, expert_offset, num_experts, num_blocks,
                        BLOCK_M: tl.constexpr, E_BLOCK: tl.constexpr, P_BLOCK: tl.constexpr,
                        FILL: tl.constexpr):
    """The grouping as one program's work (`_group_pairs_kernel`, and program 0 of
    `moe_mxfp4_prologue`'s launch). Every pair held at once (P_BLOCK >= num_pairs): one load of the expert ids,
    a histogram for the counts, one sort of (expert, pair) keys for each pair's rank within its expert (stable:
    by pair index), gathers of its expert's first rows."""
    pairs = tl.arange(0, P_BLOCK)
    real = pairs < num_pairs
    local = tl.load(expert_ids_ptr + pairs, mask=real, other=-1).to(tl.int32) - expert_offset
    mine = real & (local >= 0) & (local < num_experts)
    # 1. pairs per expert, each expert's first pair in sorted order and first row in the padded layout
    counts = tl.histogram(tl.where(mine, local, 0), E_BLOCK, mask=mine)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)                                           # [E]
    padded_start = padded_end - padded
    first_sorted = tl.cumsum(counts, 0) - counts
    capacity = num_blocks * BLOCK_M

    # 2. every row starts as padding; the barrier orders these stores before the pairs' stores below
    for row in range(0, capacity, FILL):
        rows = row + tl.arange(0, FILL)
        tl.store(sorted_pairs_ptr + rows, tl.full([FILL], 0, tl.int64) + num_pairs, mask=rows < capacity)
    tl.debug_barrier()

    # 3. each pair's row: its expert's first row + its place among the expert's pairs (other ranks' pairs and the
    # block's tail sort last, past every expert)
    keys = tl.sort(tl.where(mine, local, E_BLOCK) * P_BLOCK + pairs)            # [P] by (expert, pair)
    expert = keys // P_BLOCK
    pair = keys % P_BLOCK
    placed = expert < E_BLOCK
    index = tl.where(placed, expert, 0)
    rank = pairs - tl.gather(first_sorted, index, 0)                            # position in sorted order - first
    destination = tl.where(placed, tl.gather(padded_start, index, 0) + rank, capacity).to(tl.int64)
    tl.store(row_of_pair_ptr + pair, destination, mask=pair < num_pairs)
    tl.store(sorted_pairs_ptr + destination, pair.to(tl.int64), mask=placed)

    # 4. each block's expert: how many experts' padded rows end at or before the block's first row (searchsorted)
    experts = tl.arange(0, E_BLOCK)
    live = experts < num_experts
    for block in range(0, num_blocks, FILL):
        blocks = block + tl.arange(0, FILL)
        ended = (padded_end[None, :] <= (blocks * BLOCK_M)[:, None]) & live[None, :]
        tl.store(block_experts_ptr + blocks, tl.sum(ended.to(tl.int64), 1), mask=blocks < num_blocks)


@triton.jit
def _group_pairs_kernel(expert_ids_ptr, sorted_pairs_ptr, block_experts_ptr, row_of_pair_ptr,
                        num_pairs, expert_offset, num_experts, num_blocks,
                        BLOCK_M: tl.constexpr, E_BLOCK: tl.constexpr, P_BLOCK: tl.constexpr,
                        FILL: tl.constexpr):
    group_pairs_program(expert_ids_ptr, sorted_pairs_ptr, block_experts_ptr, row_of_pair_ptr, num_pairs,
                        expert_offset, num_experts, num_blocks, BLOCK_M, E_BLOCK, P_BLOCK, FILL)


class SmallGrouping(NamedTuple):
    """A one-program grouping's launch (`small_grouping`): its arguments and constexprs, the blocks it fills."""
    args: tuple                    # group_pairs_program's runtime arguments, in order
    constexprs: dict               # BLOCK_M, E_BLOCK, P_BLOCK, FILL
    blocks: ExpertBlocks           # the outputs, written by the launch


def small_grouping(expert_ids: torch.Tensor, expert_offset: int, num_experts: int, block_m: int) -> SmallGrouping:
    """The output buffers and launch parameters of `group_pairs_program` for these pairs (at most
    SMALL_BATCH_PAIRS pairs and MAX_KERNEL_EXPERTS experts: all held at once)."""
    flat = expert_ids.reshape(-1).contiguous()
    num_pairs = flat.numel()
    if num_pairs > SMALL_BATCH_PAIRS or num_experts > MAX_KERNEL_EXPERTS:
        raise ValueError(f"group_pairs_small: at most {SMALL_BATCH_PAIRS} pairs and {MAX_KERNEL_EXPERTS} experts, "
                         f"got {num_pairs} and {num_experts}; use group_pairs_by_expert")
    num_blocks = num_expert_blocks(num_pairs, num_experts, block_m)
    device = flat.device
    blocks = ExpertBlocks(torch.empty(num_blocks * block_m, dtype=torch.long, device=device),
                          torch.empty(num_blocks, dtype=torch.long, device=device),
                          torch.empty(num_pairs, dtype=torch.long, device=device))
    e_block = triton.next_power_of_2(max(num_experts, 16))
    constexprs = {"BLOCK_M": block_m, "E_BLOCK": e_block, "P_BLOCK": triton.next_power_of_2(max(num_pairs, 16)),
                  "FILL": max(16, min(256, 8192 // e_block))}
    return SmallGrouping((flat, *blocks, num_pairs, expert_offset, num_experts, num_blocks), constexprs, blocks)


def group_pairs_small(expert_ids: torch.Tensor, expert_offset: int, num_experts: int,
                      block_m: int) -> ExpertBlocks:
    """`group_pairs_torch`'s result from one Triton program (at most SMALL_BATCH_PAIRS pairs: all held at once)."""
    grouping = small_grouping(expert_ids, expert_offset, num_experts, block_m)
    _group_pairs_kernel[(1,)](*grouping.args, **grouping.constexprs,
                              num_warps=grouping_warps(grouping.constexprs["P_BLOCK"]))
    return grouping.blocks

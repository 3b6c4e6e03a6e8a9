"""The MoE bookkeeping (`kernels.triton.moe_blocks`): the one-program Triton grouping of decode-sized batches
against the torch form, bit for bit, and the tight bound on row blocks that both size their outputs by.

On a CPU box the kernel runs under TRITON_INTERPRET=1 (set below before triton is imported). Integer allocations
are poisoned (-123456), so a sorted row, block expert or pair row the kernel forgets to write fails the comparison.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kernels.triton import moe_blocks  # noqa: E402
from poison_helpers import nan_poisoned_allocations  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")


@pytest.fixture(autouse=True)
def poisoned_index_allocations():
    with nan_poisoned_allocations():
        yield


@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m,offset", [
    (1, 8, 32, 16, 0),            # k3-mini at BS=1
    (1, 16, 112, 16, 0),          # K3 at TP8, BS=1
    (37, 8, 32, 16, 0),           # 296 pairs (not a power of two), experts with several blocks
    (64, 4, 20, 64, 10),          # expert parallelism: ids outside [10, 30) belong to other ranks
    (9, 3, 1000, 16, 0),          # 1024-wide expert tiles
    (5, 2, 3, 4, 0),              # more pairs per expert than a block
    (64, 16, 112, 16, 0),         # K3 at 64 tokens: 1024 pairs, SMALL_BATCH_PAIRS, all held at once
    (3, 16, 112, 8, 40),          # the Gluon decode's 8-row blocks under expert parallelism
])
def test_group_pairs_one_program_matches_the_torch_form(num_tokens, top_k, num_experts, block_m, offset):
    """The decode-sized Triton bookkeeping gives the torch form's blocks bit for bit, including idle blocks,
    padding rows and the dump row of other ranks' pairs."""
    low, high = (offset - 8, offset + num_experts + 8) if offset else (0, num_experts)
    expert_ids = torch.randint(low, high, (num_tokens, top_k), device=DEVICE)
    expert_ids[0, 0] = offset + num_experts - 1                   # the last expert is never left out
    small = moe_blocks.group_pairs_small(expert_ids, offset, num_experts, block_m)
    reference = moe_blocks.group_pairs_torch(expert_ids, offset, num_experts, block_m)
    for name, got, want in zip(reference._fields, small, reference):
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert moe_blocks.group_pairs_by_expert(expert_ids, offset, num_experts, block_m).sorted_pairs.equal(
        reference.sorted_pairs)


@pytest.mark.parametrize("routing", ["one expert", "worst case"])
def test_group_pairs_one_program_matches_the_torch_form_on_skewed_routing(routing):
    """The routings that fill the most blocks at K3's 64 tokens (1024 pairs, 112 experts): every pair on one
    expert (64 full blocks), and one pair on each of 111 experts with the rest on the last (the bound
    `num_expert_blocks` is tight for: 169 blocks, three of the kernel's FILL-wide passes over block experts)."""
    pairs, experts, block_m = 1024, 112, 16
    expert_ids = torch.full((pairs,), experts - 1, dtype=torch.long, device=DEVICE)
    if routing == "worst case":
        expert_ids[: experts - 1] = torch.arange(experts - 1, device=DEVICE)
    expert_ids = expert_ids[torch.randperm(pairs, device=DEVICE)].view(64, 16)
    small = moe_blocks.group_pairs_small(expert_ids, 0, experts, block_m)
    reference = moe_blocks.group_pairs_torch(expert_ids, 0, experts, block_m)
    busy = int((reference.block_experts < experts).sum())
    assert busy == (64 if routing == "one expert" else moe_blocks.num_expert_blocks(pairs, experts, block_m))
    for name, got, want in zip(reference._fields, small, reference):
        assert got.dtype == want.dtype and torch.equal(got, want), name


def test_group_pairs_one_program_refuses_more_pairs_than_it_holds():
    too_many = torch.zeros(moe_blocks.SMALL_BATCH_PAIRS + 1, 1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="at most 1024 pairs"):
        moe_blocks.group_pairs_small(too_many, 0, 4, 16)


@pytest.mark.parametrize("num_pairs,num_experts,block_m", [
    (16, 112, 16),                # K3 at BS=1: 16 blocks, not the 113 of cdiv(P, BLOCK_M) + E
    (64, 112, 16), (256, 112, 16), (1024, 112, 16), (8192, 112, 96), (5, 3, 4), (7, 7, 4), (1, 1, 16), (0, 4, 16)])
def test_num_expert_blocks_is_the_tight_bound(num_pairs, num_experts, block_m):
    """The grid's row blocks: never fewer than any routing can fill (a routing that overflowed them would write
    past the sorted rows), and exactly as many as the worst routing fills (one pair on each of min(P, E) - 1
    experts, the rest on one), checked by brute force over every count split on small cases."""
    bound = moe_blocks.num_expert_blocks(num_pairs, num_experts, block_m)

    def blocks_of(counts):
        return sum(-(-c // block_m) for c in counts)

    busy = min(num_pairs, num_experts)
    worst = [1] * max(0, busy - 1) + [num_pairs - max(0, busy - 1)] if busy else []
    assert blocks_of(worst) == bound
    gen = torch.Generator().manual_seed(num_pairs)
    for _ in range(200):
        ids = torch.randint(0, num_experts, (num_pairs,), generator=gen)
        assert blocks_of(torch.bincount(ids, minlength=num_experts).tolist()) <= bound
    if num_pairs <= 8 and num_experts <= 8:                       # every way to split the pairs over the experts
        import itertools
        for ids in itertools.product(range(num_experts), repeat=num_pairs):
            assert blocks_of([ids.count(e) for e in range(num_experts)]) <= bound


def test_group_pairs_fill_the_worst_routing_exactly():
    """The worst routing for the bound (one pair on each expert but the last, the rest on the last) fills every
    block: both forms place every pair, and no block is idle."""
    num_experts, block_m = 6, 4
    ids = torch.tensor([0, 1, 2, 3, 4] + [5] * 9, device=DEVICE).view(7, 2)
    for group in (moe_blocks.group_pairs_small, moe_blocks.group_pairs_torch):
        blocks = group(ids, 0, num_experts, block_m)
        assert blocks.block_experts.numel() == moe_blocks.num_expert_blocks(14, num_experts, block_m) == 8
        assert blocks.block_experts.cpu().tolist() == [0, 1, 2, 3, 4, 5, 5, 5]
        assert sorted(blocks.sorted_pairs[blocks.sorted_pairs < 14].cpu().tolist()) == list(range(14))
        assert (blocks.row_of_pair < 8 * block_m).all()


def test_group_pairs_by_expert_blocks_hold_one_expert_each():
    num_experts, block_m = 5, 4
    expert_ids = torch.randint(-2, num_experts + 2, (13, 3), device=DEVICE)
    blocks = moe_blocks.group_pairs_by_expert(expert_ids, 0, num_experts, block_m)
    flat = expert_ids.reshape(-1).cpu()
    pairs = blocks.sorted_pairs.cpu().view(-1, block_m)
    placed = []
    for block, expert in enumerate(blocks.block_experts.cpu().tolist()):
        real = [p for p in pairs[block].tolist() if p < flat.numel()]
        if expert >= num_experts:
            assert not real, "an idle block holds pairs"
        assert all(flat[p] == expert for p in real), "a block mixes experts"
        placed += real
    mine = [i for i, e in enumerate(flat.tolist()) if 0 <= e < num_experts]
    assert sorted(placed) == mine, "every local pair is placed exactly once and foreign pairs are dropped"


def test_group_pairs_put_each_blocks_padding_rows_last():
    """Within a block the real rows come first: the tail parts of the swap and wgmma kernels (block_m + tail_m rows)
    decide from the first tail row alone whether the tail holds any row, and skip its MMA when it does not."""
    gen = torch.Generator().manual_seed(3)
    for num_tokens, top_k, num_experts, block_m in ((13, 3, 5, 4), (37, 8, 16, 6), (64, 4, 7, 24)):
        expert_ids = torch.randint(-1, num_experts + 1, (num_tokens, top_k), generator=gen).to(DEVICE)
        for group in (moe_blocks.group_pairs_small, moe_blocks.group_pairs_torch):
            blocks = group(expert_ids, 0, num_experts, block_m)
            padding = (blocks.sorted_pairs.cpu() >= expert_ids.numel()).view(-1, block_m).int()    # [blocks, rows]
            assert torch.equal(padding, padding.cummax(dim=1).values), (group.__name__, padding)

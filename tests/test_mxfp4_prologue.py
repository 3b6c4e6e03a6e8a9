"""The Gluon MXFP4 decode's one-launch prologue (`kernels.triton.moe_mxfp4_prologue`): the pairs' grouping and x's
copy into the Gluon kernels' column order, against the two launches it replaces (`moe_blocks.group_pairs_torch`,
`moe_mxfp4_gluon_operands.gluon_columns`), bit for bit.

The kernel is plain Triton, so it runs here under TRITON_INTERPRET=1 (set below before triton is imported).
Allocations are poisoned (NaN floats, -123456 integers), so a place the copy or the grouping forgets to write fails
the comparison. The op's use of it (one launch, no torch copy of x) is checked offline for sm_90.
"""
from __future__ import annotations

import os
import textwrap

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kernels.triton import moe_blocks, moe_mxfp4, moe_mxfp4_prologue, moe_mxfp4_tiles  # noqa: E402
from poison_helpers import nan_poisoned_allocations  # noqa: E402
from tests.test_offline_compile import K3_PACKED_EXPERTS, _python  # noqa: E402

gluon = pytest.importorskip("kernels.triton.moe_mxfp4_gluon_operands")
DEVICE = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")
LAYOUTS = [(False, False), (True, False), (True, True)]        # (coalesced_x, coalesced_w): cw only with cx
# a presplit swap tile at block_k 256 (the interpreter's own decode, no PTX), 16-row blocks, 32 weight rows a program
SWAP_TILE = moe_mxfp4.Mxfp4Tile(block_m=16, block_n=32, block_k=256, num_warps=1, num_stages=1, swap=True,
                                presplit=True)


@pytest.mark.parametrize("coalesced_x,coalesced_w", LAYOUTS, ids=["plain", "coalesced_x", "coalesced_xw"])
@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m,offset,num_k,dtype", [
    (1, 16, 112, 8, 0, 3584, torch.bfloat16),     # K3 at one token: seven 512-column copy tiles
    (5, 16, 112, 16, 0, 768, torch.bfloat16),     # rows past the last whole 4-row tile, columns past 512
    (64, 16, 112, 16, 0, 512, torch.float32),     # K3's 64 tokens: 1024 pairs, the most the grouping holds
    (3, 8, 20, 8, 10, 256, torch.bfloat16),       # expert parallelism: other ranks' pairs dropped
])
def test_one_launch_gives_the_grouping_and_the_ordered_x_bit_for_bit(num_tokens, top_k, num_experts, block_m, offset,
                                                                     num_k, dtype, coalesced_x, coalesced_w):
    gen = torch.Generator().manual_seed(num_tokens * 1000 + num_k)
    low, high = (offset - 8, offset + num_experts + 8) if offset else (0, num_experts)
    expert_ids = torch.randint(low, high, (num_tokens, top_k), generator=gen).to(DEVICE)
    wide = torch.randn(num_tokens, num_k + 256, generator=gen).to(DEVICE, dtype)
    x = wide[:, 128:128 + num_k]                    # rows apart by more than K, the first not at the allocation's start
    with nan_poisoned_allocations():
        blocks, ordered = moe_mxfp4_prologue.group_pairs_and_columns(expert_ids, offset, num_experts, block_m, x,
                                                                     coalesced_x, coalesced_w)
    reference = moe_blocks.group_pairs_torch(expert_ids, offset, num_experts, block_m)
    for name, got, want in zip(reference._fields, blocks, reference):
        assert got.dtype == want.dtype and torch.equal(got, want), name
    want = gluon.gluon_columns(x, coalesced_x, coalesced_w)
    assert ordered.dtype == dtype and ordered.shape == want.shape and torch.equal(ordered, want)


def test_stored_column_is_where_gluon_columns_puts_each_column():
    """The kernels' one formula for the column order (the prologue's copy and gate/up's hidden store) agrees with
    the torch form the down kernel's reads and the sweep's references are built from."""
    rows, num_k = 2, 768
    x = torch.arange(rows * num_k, dtype=torch.float32).view(rows, num_k)
    columns = torch.arange(num_k)
    for layout in LAYOUTS:
        places = moe_mxfp4_prologue.stored_column.fn(columns, *layout)
        assert torch.equal(torch.sort(places).values, columns), layout                   # a permutation of K
        assert torch.equal(gluon.gluon_columns(x, *layout)[:, places], x), layout


def test_prologue_refusals_name_what_is_wrong():
    ids, x = torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 512)
    with pytest.raises(ValueError, match="K must be a multiple of 256"):
        moe_mxfp4_prologue.group_pairs_and_columns(ids, 0, 4, 8, x[:, :384], False, False)
    with pytest.raises(ValueError, match="coalesced_w comes only with coalesced_x"):
        moe_mxfp4_prologue.group_pairs_and_columns(ids, 0, 4, 8, x, False, True)
    with pytest.raises(ValueError, match="columns must be contiguous"):
        moe_mxfp4_prologue.group_pairs_and_columns(ids, 0, 4, 8, torch.zeros(512, 2).t(), False, False)
    with pytest.raises(ValueError, match="at most 1024 pairs"):
        moe_mxfp4_prologue.group_pairs_and_columns(torch.zeros(65, 16, dtype=torch.long), 0, 4, 8, x, False, False)
    swap = moe_mxfp4_tiles.SWAP_DECODE_TILE_NVIDIA                     # presplit, block_k 256
    for other in (swap._replace(block_k=128), swap._replace(presplit=False), SWAP_TILE._replace(swap=False)):
        with pytest.raises(ValueError, match="prologue copies x into the Gluon"):
            moe_mxfp4.check_tile(other._replace(prologue=True))
    moe_mxfp4.check_tile(moe_mxfp4_tiles.GLUON_DECODE_TILE_NVIDIA._replace(prologue=True))
    moe_mxfp4.check_tile(swap._replace(prologue=True))
    with pytest.raises(ValueError, match="column order is for a prologue tile"):
        moe_mxfp4.gate_up(x, None, None, None, 1, "silu", None, None, swap, ordered=True)


@pytest.mark.parametrize("num_tokens,num_k,offset", [(5, 512, 0), (9, 256, 3), (4, 384, 0)])
def test_a_swap_prologue_tile_gives_the_result_of_the_tile_without_it_bit_for_bit(num_tokens, num_k, offset,
                                                                                   monkeypatch):
    """The op with a presplit swap tile at block_k 256 and `prologue` (the grouping and x's presplit copy in one
    launch) against the same tile without it: the same output bit for bit, with and without other ranks' experts.
    At K = 384 (not whole 256-column steps) the prologue tile falls back to gate/up's own padded copy."""
    calls = []
    for name in ("presplit_columns", "group_pairs_and_columns"):
        real = getattr(moe_mxfp4, name)
        monkeypatch.setattr(moe_mxfp4, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    gen = torch.Generator().manual_seed(num_tokens + num_k)
    experts, top_k, inter = 6, 2, 64
    w13 = (torch.randint(0, 256, (experts, 2 * inter, num_k // 2), generator=gen, dtype=torch.uint8),
           torch.randint(118, 122, (experts, 2 * inter, num_k // 32), generator=gen, dtype=torch.uint8))
    w2 = (torch.randint(0, 256, (experts, num_k, inter // 2), generator=gen, dtype=torch.uint8),
          torch.randint(118, 122, (experts, num_k, inter // 32), generator=gen, dtype=torch.uint8))
    x = torch.randn(num_tokens, num_k, generator=gen)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    ids = torch.randint(0, experts + offset, (num_tokens, top_k), generator=gen)
    w13, w2, x, weights, ids = ([t.to(DEVICE) for t in w13], [t.to(DEVICE) for t in w2], x.to(DEVICE),
                                weights.to(DEVICE), ids.to(DEVICE))
    outs = []
    for tile in (SWAP_TILE, SWAP_TILE._replace(prologue=True)):
        calls.clear()
        outs.append(moe_mxfp4.moe_experts_mxfp4(x, *w13, *w2, weights, ids, "silu", None, None, offset, tile=tile))
    prologue_used = num_k % 256 == 0
    assert calls == (["group_pairs_and_columns"] if prologue_used else ["presplit_columns"]), calls
    assert torch.isfinite(outs[0]).all() and outs[0].abs().max() > 0
    assert torch.equal(outs[0], outs[1])


def test_the_op_with_a_prologue_tile_makes_one_launch_before_gate_up_and_no_torch_copy():
    """Offline sm_90, K3's per-GPU shapes: at 1 and 64 tokens a prologue tile's launches are the prologue, the two
    Gluon GEMMs and the combine (the grouping kernel gone, `gluon_columns` never called), the prologue compiling
    with no stack or spill; past the one-program grouping's 1024 pairs (96 tokens) the op keeps the torch grouping
    and gate/up's own copy of x."""
    result = _python(K3_PACKED_EXPERTS + textwrap.dedent("""
        from backends.offline import capture, compile_launch, offline_target
        from kernels.triton import moe_mxfp4_gluon_operands as moe_mxfp4_gluon
        from kernels.triton.moe_mxfp4 import MXFP4_TILES_NVIDIA, moe_experts_mxfp4
        target = offline_target("sm_90")
        copies = []
        torch_copy = moe_mxfp4_gluon.gluon_columns
        moe_mxfp4_gluon.gluon_columns = lambda *a: copies.append(1) or torch_copy(*a)
        for tokens, layout in ((1, {}), (64, dict(coalesced_x=True, coalesced_w=True)), (96, {})):
            tile = MXFP4_TILES_NVIDIA["decode"]._replace(block_m=16, prologue=True, **layout)
            copies.clear()
            with capture(target) as recorder:
                ids = torch.arange(tokens * K).view(tokens, K) % E
                moe_experts_mxfp4(torch.empty(tokens, D, dtype=torch.bfloat16), *w13, *w2,
                                  torch.full((tokens, K), 1 / K), ids, "situ", 4.0, 25.0, max_scale=120, tile=tile)
            names = [launch.kernel for _, launch in recorder.launches]
            print(tokens, "launches", ",".join(names), "copies", len(copies))
            for _, launch in recorder.launches:
                if launch.kernel == "_group_pairs_and_columns_kernel":
                    c = compile_launch(launch, target)
                    print(tokens, "compile", c.error or "ok", c.resources.scratch_bytes, c.resources.spills or 0)
    """), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    gemms = "gate_up_gluon_kernel,down_gluon_kernel,_combine_kernel"
    assert lines == [f"1 launches _group_pairs_and_columns_kernel,{gemms} copies 0", "1 compile ok 0 0",
                     f"64 launches _group_pairs_and_columns_kernel,{gemms} copies 0", "64 compile ok 0 0",
                     f"96 launches {gemms} copies 1"], lines


def test_k3_at_64_tokens_groups_and_orders_x_in_one_launch_before_the_swap_kernels():
    """Offline sm_90 with the default tiles: K3 at 64 tokens (1024 pairs, decode_batch's presplit swap tile with
    `prologue`) launches the prologue, the two swap GEMMs and the combine, and never calls the torch presplit copy;
    at 96 tokens (past the one-program grouping) the grouping kernel is the torch form and x's copy is torch's."""
    result = _python(K3_PACKED_EXPERTS + textwrap.dedent("""
        from backends.offline import capture, offline_target
        from kernels.triton import moe_mxfp4
        target = offline_target("sm_90")
        copies = []
        torch_copy = moe_mxfp4.presplit_columns
        moe_mxfp4.presplit_columns = lambda *a: copies.append(1) or torch_copy(*a)
        for tokens in (64, 96):
            copies.clear()
            with capture(target) as recorder:
                ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t))[:K]
                                   for t in range(tokens)])
                moe_mxfp4.moe_experts_mxfp4(torch.empty(tokens, D, dtype=torch.bfloat16), *w13, *w2,
                                            torch.full((tokens, K), 1 / K), ids, "situ", 4.0, 25.0, max_scale=120)
            names = [launch.kernel for _, launch in recorder.launches]
            print(tokens, ",".join(names), len(copies))
    """), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    gemms = "_gate_up_swap_kernel,_down_swap_kernel,_combine_kernel"
    assert result.stdout.splitlines() == [f"64 _group_pairs_and_columns_kernel,{gemms} 0", f"96 {gemms} 1"], \
        result.stdout

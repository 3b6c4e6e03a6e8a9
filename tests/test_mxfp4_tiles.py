"""The MXFP4 expert tiles (`kernels.triton.moe_mxfp4_tiles`): options that cannot apply together are refused by
name, and the per-call choice on sm_90 (row classes, the fp16 and narrow-width stand-ins, register caps, tail
tiles). The kernels themselves are checked in tests/test_mxfp4_ops.py, whose tiles and experts these reuse.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from kernels.triton import moe_mxfp4  # noqa: E402
from tests.test_mxfp4_ops import (  # noqa: E402
    GEMV_TILE, NATURAL_TILE, PRESPLIT_TILE, SMALL_TILE, SPLIT_TILE, STACKED_TILE, SWAP_TILE, _random_experts)


def test_tile_options_that_cannot_apply_are_refused():
    """split_x / scaled / half_math belong to the swap kernel, and scaled / half_math to 16-bit activations: a tile
    asking for them elsewhere is refused by name rather than silently run as another kernel."""
    gen = torch.Generator().manual_seed(15)
    w13_packed, w13_scale = _random_experts(gen, 2, 64, 64)
    w2_packed, w2_scale = _random_experts(gen, 2, 64, 32)
    x, ids, weights = torch.randn(3, 64, generator=gen), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    for tile, match in ((SWAP_TILE._replace(swap=False, split_x=True), "swap=True"),
                        (SWAP_TILE._replace(scaled=True), "bf16 or fp16"),
                        (SWAP_TILE._replace(half_math=True), "needs bf16"),
                        (GEMV_TILE._replace(swap=True), "gemv tile has no dot"),
                        (NATURAL_TILE._replace(split_x=True), "natural_k is an option"),
                        (SMALL_TILE._replace(natural_k=True), "natural_k is an option"),
                        (SMALL_TILE._replace(presplit=True), "presplit is an option"),
                        (PRESPLIT_TILE._replace(split_x=True), "presplit is an option"),
                        (PRESPLIT_TILE._replace(natural_k=True), "presplit is an option"),
                        (GEMV_TILE._replace(presplit=True), "gemv tile has no dot"),
                        (SMALL_TILE._replace(stacked=True), "stacked is an option"),
                        (STACKED_TILE._replace(natural_k=True), "stacked is an option"),
                        (STACKED_TILE._replace(block_n=16), "stacked is an option"),
                        (GEMV_TILE._replace(stacked=True), "gemv tile has no dot"),
                        (SWAP_TILE._replace(prefetch=True), "set gemv=True"),
                        (GEMV_TILE._replace(block_m=32), "power of two in"),
                        (GEMV_TILE._replace(block_k=96), "power of two in"),
                        (SMALL_TILE._replace(tail_m=16), "tail_m is an option"),
                        (SWAP_TILE._replace(tail_m=16, scaled=True), "tail_m is an option"),
                        (NATURAL_TILE._replace(tail_m=16), "tail_m is an option"),
                        (GEMV_TILE._replace(tail_m=16), "tail_m is an option"),
                        (SWAP_TILE._replace(tail_m=8), "tail_m is an option"),
                        (SWAP_TILE._replace(tail_m=24), "tail_m is an option"),
                        (SWAP_TILE._replace(tail_m=32), "tail_m is an option"),   # longer than block_m
                        (SWAP_TILE._replace(maxnreg=300), "register cap"),
                        (SWAP_TILE._replace(maxnreg=8), "register cap"),
                        (SWAP_TILE._replace(down_maxnreg=300), "down_maxnreg is ptxas' register cap"),
                        (SWAP_TILE._replace(down_block_n=48), "down_block_n"),
                        (GEMV_TILE._replace(down_block_n=8), "down_block_n")):
        with pytest.raises(ValueError, match=match):
            moe_mxfp4.moe_experts_mxfp4(x, w13_packed, w13_scale, w2_packed, w2_scale, weights, ids, "silu", 4.0,
                                        25.0, tile=tile)


def test_a_register_cap_is_refused_off_nvidia():
    """maxnreg is ptxas' option: a tile asking for it on an AMD device is refused by name, not run without it."""
    from kernels.triton.tuning_ops import AssumedDevice, assume_device
    with assume_device(AssumedDevice("amd", "gfx942", 304)):
        with pytest.raises(ValueError, match="maxnreg is a ptxas option"):
            moe_mxfp4._registers(SWAP_TILE._replace(maxnreg=128), torch.device("cpu"))
        assert moe_mxfp4._registers(SWAP_TILE, torch.device("cpu")) == {}
        with pytest.raises(ValueError, match="maxnreg is a ptxas option"):
            moe_mxfp4._registers(SWAP_TILE._replace(down_maxnreg=72), torch.device("cpu"), down=True)
    with assume_device(AssumedDevice("nvidia", "sm_90", 132)):
        assert moe_mxfp4._registers(SWAP_TILE._replace(maxnreg=128), torch.device("cpu")) == {"maxnreg": 128}
        both = SWAP_TILE._replace(maxnreg=80, down_maxnreg=72)       # down's own cap; gate/up keeps maxnreg
        assert moe_mxfp4._registers(both, torch.device("cpu")) == {"maxnreg": 80}
        assert moe_mxfp4._registers(both, torch.device("cpu"), down=True) == {"maxnreg": 72}
        assert moe_mxfp4._registers(SWAP_TILE._replace(maxnreg=80), torch.device("cpu"), down=True) == {"maxnreg": 80}
        assert moe_mxfp4._registers(SWAP_TILE._replace(down_maxnreg=72), torch.device("cpu")) == {}


def test_sm90_tiles_come_from_the_sweep_table_and_fp16_drops_bf16_only_options():
    """On sm_90 the tile of a bf16 call is MXFP4_TILES_NVIDIA's for its row class; an fp16 call gets the same tile
    without half_math and asm_decode (both decode to bf16, and the op refuses them for fp16 x), and that tile
    passes the op's own checks for fp16. The gluon decode tile is bf16 and whole 256-column steps only: fp16 calls
    and other widths get the class's swap tile (`SWAP_TILES_NVIDIA`) instead."""
    from kernels.triton.tuning_ops import AssumedDevice, assume_device
    cpu = torch.device("cpu")
    with assume_device(AssumedDevice("nvidia", "sm_90", 132)):
        for pairs, row_class in ((16, "decode_thin"), (64, "decode_thin"), (112, "decode_thin"), (113, "decode"),
                                 (16 * 16, "decode"), (16 * 32, "decode"),
                                 (16 * 36, "decode_batch"), (16 * 64, "decode_batch"), (112 * 40, "mid"),
                                 (8192, "prefill"), (16384, "prefill")):  # 73 rows: prefill
            want = moe_mxfp4.MXFP4_TILES_NVIDIA[row_class]
            assert moe_mxfp4.mxfp4_row_class(pairs, 112) == row_class
            assert moe_mxfp4.mxfp4_tile(cpu, pairs, 112, 2, torch.bfloat16) == want
            assert moe_mxfp4.mxfp4_tile(cpu, pairs, 112, 2, torch.bfloat16, (3584, 3072)) == want
            swap = moe_mxfp4.SWAP_TILES_NVIDIA[row_class]
            assert swap.swap and not (swap.gluon or swap.wgmma)
            narrow = moe_mxfp4.mxfp4_tile(cpu, pairs, 112, 2, torch.bfloat16, (3584, 3072 + 32))
            assert narrow == (swap if want.gluon or want.wgmma else want)
            fp16 = moe_mxfp4.mxfp4_tile(cpu, pairs, 112, 2, torch.float16)
            assert fp16 == (swap if want.gluon or want.wgmma else want)._replace(half_math=False, asm_decode=False)
            moe_mxfp4.check_tile(fp16)
            moe_mxfp4._check_dtype(fp16, torch.zeros(1, 8, dtype=torch.float16))
    assert moe_mxfp4.MXFP4_TILES_NVIDIA["decode"].gluon
    # the cases the fp16 rule exists for
    assert any(t.half_math or t.asm_decode for t in moe_mxfp4.MXFP4_TILES_NVIDIA.values())


def test_a_wgmma_class_entry_gives_way_to_the_swap_tile_where_it_cannot_run(monkeypatch):
    """With a wgmma tile as the prefill entry (what adopting one after a GPU sweep looks like), bf16 calls whose D and
    I are whole 128-column steps take it; other widths (K3's D with I = 3072 + 32, or D = 3584 + 64) and fp16 calls
    take the class's swap tile, fp16 without its bf16-only options."""
    from kernels.triton.tuning_ops import AssumedDevice, assume_device
    cpu = torch.device("cpu")
    swap = moe_mxfp4.SWAP_TILES_NVIDIA["prefill"]
    wgmma = moe_mxfp4.Mxfp4Tile(block_m=128, block_n=64, block_k=128, num_warps=4, num_stages=3, swap=True,
                                asm_decode=True, presplit=True, stacked=True, wgmma=True)
    monkeypatch.setitem(moe_mxfp4.MXFP4_TILES_NVIDIA, "prefill", wgmma)
    with assume_device(AssumedDevice("nvidia", "sm_90", 132)):
        assert moe_mxfp4.mxfp4_tile(cpu, 16384, 112, 2, torch.bfloat16, (3584, 3072)) == wgmma
        assert moe_mxfp4.mxfp4_tile(cpu, 16384, 112, 2, torch.bfloat16, (384, 128)) == wgmma
        assert moe_mxfp4.mxfp4_tile(cpu, 16384, 112, 2, torch.bfloat16, (3584, 3072 + 32)) == swap
        assert moe_mxfp4.mxfp4_tile(cpu, 16384, 112, 2, torch.bfloat16, (3584 + 64, 3072)) == swap
        fp16 = moe_mxfp4.mxfp4_tile(cpu, 16384, 112, 2, torch.float16, (3584, 3072))
        assert fp16 == swap._replace(half_math=False, asm_decode=False)


def test_sm90_tail_tile_only_past_one_whole_block_an_expert(monkeypatch):
    """Shorter tail blocks (a `MXFP4_TAIL_TILES_NVIDIA` entry) are chosen for NVIDIA bf16 when the mean rows an
    expert exceed one block of the class's tile (16K routed rows over 112 experts: 146 past 128), never at 8K (73:
    one padded block each), for fp16, for a class without an entry, or elsewhere; the committed sm_90 tables have
    no entry (their prefill tile has a tail part of its own), so prefill runs one height."""
    from kernels.triton.tuning_ops import AssumedDevice, assume_device
    cpu = torch.device("cpu")
    with assume_device(AssumedDevice("nvidia", "sm_90", 132)):
        committed = moe_mxfp4.MXFP4_TILES_NVIDIA["prefill"]
        assert committed.tail_m and moe_mxfp4.mxfp4_tail_tile(cpu, committed, 16384, 112, torch.bfloat16) is None
        prefill, tail = SPLIT_TILE._replace(block_m=128), SPLIT_TILE._replace(block_m=32)
        monkeypatch.setitem(moe_mxfp4.MXFP4_TAIL_TILES_NVIDIA, "prefill", tail)
        assert moe_mxfp4.mxfp4_tail_tile(cpu, prefill, 16384, 112, torch.bfloat16) == tail
        assert moe_mxfp4.mxfp4_tail_tile(cpu, prefill, 8192, 112, torch.bfloat16) is None
        assert moe_mxfp4.mxfp4_tail_tile(cpu, prefill, 16384, 112, torch.float16) is None
        assert moe_mxfp4.mxfp4_tail_tile(cpu, moe_mxfp4.MXFP4_TILES_NVIDIA["decode"], 16, 112) is None
        # 146 rows an expert fit one block of a 128 + 32 tile: no second height
        assert moe_mxfp4.mxfp4_tail_tile(cpu, prefill._replace(tail_m=32), 16384, 112, torch.bfloat16) is None
    assert moe_mxfp4.mxfp4_tail_tile(cpu, prefill, 16384, 112) is None                 # the interpreter

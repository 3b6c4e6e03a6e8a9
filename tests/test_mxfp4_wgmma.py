"""The Gluon wgmma prefill kernels' index algebra (`kernels.triton.moe_mxfp4_wgmma`), on the CPU: Gluon has no
interpreter, so the kernels themselves are compiled offline (tests/test_offline_compile.py) and checked against
float64 on the GPU (bench.moe_mxfp4_sweep). What can go wrong without a GPU is the K order: the weight bytes a
thread loads, the x order `kappa_columns` writes and the hidden order gate/up's store writes must agree."""
from __future__ import annotations

import textwrap

import pytest
import torch

from kernels.triton import moe_mxfp4, moe_mxfp4_wgmma
from kernels.triton.moe_mxfp4_tiles import Mxfp4Tile, check_tile
from tests.test_offline_compile import K3_PACKED_EXPERTS, _python


# `_kappa`'s reshape / permute applied to the byte indices: BYTE_OF_KAPPA[kappa] is the byte j at dot position kappa
BYTE_OF_KAPPA = torch.arange(64).reshape(4, 4, 2, 2).permute(1, 2, 0, 3).reshape(64)


def _kernel_kappa(j: torch.Tensor) -> torch.Tensor:
    """gate_up_wgmma_kernel's store: byte j = 16t + 4s + 2h + p -> dot position 16s + 8h + 2t + p (its formula)."""
    return (j // 4 % 4) * 16 + (j // 2 % 2) * 8 + (j // 16) * 2 + j % 2


def test_kappa_order_is_the_operand_order():
    """Position q of a step: the even (odd) half's position kappa holds the column of byte j(kappa)'s low (high)
    nibble, where j(kappa) is what `_kappa`'s reshape / permute puts at kappa."""
    order = moe_mxfp4_wgmma.kappa_order()
    assert sorted(order.tolist()) == list(range(128))
    assert torch.equal(order[:64], 2 * BYTE_OF_KAPPA) and torch.equal(order[64:], 2 * BYTE_OF_KAPPA + 1)
    # the store's inverse: column c of a step goes to position c % 2 * 64 + kappa(c // 2)
    cols = torch.arange(128)
    places = cols % 2 * 64 + _kernel_kappa(cols // 2)
    assert torch.equal(order[places], cols)


def test_kappa_operands_give_the_product():
    """The kernel's dot, simulated: A[w, kappa] = decoded weight of byte j(kappa) (low nibble = column 2j, high =
    2j + 1), x in `kappa_columns` order; sum over both halves equals W @ x^T for a multi-step K."""
    torch.manual_seed(0)
    rows, num_k, tokens = 64, 384, 5
    w = torch.randn(rows, num_k, dtype=torch.float64)
    x = torch.randn(tokens, num_k, dtype=torch.float64)
    xk = moe_mxfp4_wgmma.kappa_columns(x)
    acc = torch.zeros(rows, tokens, dtype=torch.float64)
    for step in range(num_k // 128):
        cols = w[:, step * 128:(step + 1) * 128]
        low, high = cols[:, 0::2][:, BYTE_OF_KAPPA], cols[:, 1::2][:, BYTE_OF_KAPPA]
        xs = xk[:, step * 128:(step + 1) * 128]
        acc += low @ xs[:, :64].T + high @ xs[:, 64:].T
    torch.testing.assert_close(acc, w @ x.T)


def test_kappa_columns_is_the_kappa_order_gather():
    """`kappa_columns`' permuted view puts each step's columns where `kappa_order` says, on a non-contiguous input."""
    x = torch.randn(7, 768, dtype=torch.float64)[:, :384]
    want = x.reshape(7, 3, 128)[:, :, moe_mxfp4_wgmma.kappa_order()].reshape(7, 384)
    assert torch.equal(moe_mxfp4_wgmma.kappa_columns(x), want)


def test_kappa_columns_refuses_partial_steps():
    with pytest.raises(ValueError, match="multiple of 128"):
        moe_mxfp4_wgmma.kappa_columns(torch.zeros(2, 192))


def test_wgmma_tile_rules():
    good = Mxfp4Tile(block_m=128, block_n=64, block_k=128, num_warps=4, num_stages=3, swap=True, asm_decode=True,
                     presplit=True, stacked=True, wgmma=True)
    check_tile(good)
    check_tile(good._replace(block_m=256))                      # 3 x (4 + 64) KiB = 204 KiB
    check_tile(good._replace(block_m=64, tail_m=32))            # 96 rows: one decode of each weight tile for both
    for bad in (good._replace(block_m=192), good._replace(block_m=8), good._replace(block_k=256),
                good._replace(num_stages=2), good._replace(num_stages=6), good._replace(block_m=256, num_stages=4),
                good._replace(block_m=256, tail_m=32),          # 3 x (4 + 72) KiB > 224 KiB
                good._replace(gluon=True), good._replace(stacked=False)):
        with pytest.raises(ValueError, match="wgmma tile"):
            check_tile(bad)


def test_wgmma_tile_needs_whole_steps():
    tile = Mxfp4Tile(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3, swap=True, asm_decode=True,
                     presplit=True, stacked=True, wgmma=True)
    with pytest.raises(ValueError, match="wgmma tile needs D and I multiples of 128"):
        moe_mxfp4._check_gluon(tile, 3584, 3000)


def test_wgmma_kernels_compile_for_sm90():
    """Both kernels through the op at K3's per-GPU widths and 1024 tokens (16K routed rows), folded and exact scales
    (offline, in a subprocess: conftest.py's TRITON_INTERPRET=1 gives interpreter stand-ins): every launch
    compiles (the layouts' `assert_trivial` conversions hold, the tail wgmma's operand included), 16- to 128-row
    blocks and 64 + 32 with no local-memory stack and at least 2 programs an SM (so one program's decode can run
    under the other's MMA), 256-row blocks at 1."""
    result = _python(K3_PACKED_EXPERTS + textwrap.dedent("""
        from backends.offline import capture, compile_launch, offline_target
        from kernels.triton.moe_mxfp4 import Mxfp4Tile, moe_experts_mxfp4
        target = offline_target("sm_90")
        T = 1024
        base = Mxfp4Tile(64, 64, 128, 4, 4, swap=True, asm_decode=True, presplit=True, stacked=True, wgmma=True)
        for block_m, tail_m, stages, max_scale in ((16, 0, 4, 120), (64, 0, 4, 120), (128, 0, 3, 120),
                                                   (128, 0, 3, 255), (256, 0, 3, 120), (64, 32, 3, 120)):
            with capture(target) as recorder:
                ids = torch.arange(T * K).view(T, K) % E
                moe_experts_mxfp4(torch.empty(T, D, dtype=torch.bfloat16), *w13, *w2, torch.full((T, K), 1 / K),
                                  ids, "situ", 4.0, 25.0, max_scale=max_scale,
                                  tile=base._replace(block_m=block_m, tail_m=tail_m, num_stages=stages))
            for _, launch in recorder.launches:
                if "wgmma" in launch.kernel:
                    c = compile_launch(launch, target)
                    r = c.resources
                    print(f"{block_m}+{tail_m}", launch.kernel, c.error or "ok", r.scratch_bytes, r.occupancy)
    """), timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 12, lines
    for line in lines:
        block_m, kernel, status, stack, occupancy = line.split()
        assert status == "ok", line
        if block_m != "256+0":
            assert stack == "0" and int(occupancy) >= 2, line
        else:
            assert int(occupancy) >= 1, line

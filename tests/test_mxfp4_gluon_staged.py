"""The Gluon MXFP4 decode kernels' staged K loop (`moe_mxfp4_gluon._k_loop_staged`, a gluon tile with num_stages
2-4): each thread's weight bytes copied by cp.async into shared memory steps ahead of their decode.

Gluon has no interpreter, so what runs here: the piece order (`_thread_pieces`, `_piece_rows`) on index tensors,
the tile and alignment rules, and an offline sm_90 compile of both kernels through the op (16-byte copies only,
shared memory as the stages need, programs an SM). The GPU sweep checks the kernels against float64 before timing
them (bench/sweeps/coalesced.json).
"""
from __future__ import annotations

import itertools
import textwrap

import pytest
import torch

from kernels.triton import moe_mxfp4, moe_mxfp4_tiles
from tests.test_offline_compile import K3_PACKED_EXPERTS, _python

operands = pytest.importorskip("kernels.triton.moe_mxfp4_gluon_operands")
GLUON_TILE = moe_mxfp4_tiles.GLUON_DECODE_TILE_NVIDIA


@pytest.mark.parametrize("rows,coalesced_w", list(itertools.product((64, 128), (False, True))))
def test_thread_pieces_hold_each_threads_own_bytes_and_invert(rows, coalesced_w):
    """Piece P of thread T = 32w + 4g + t is the 16 bytes `_bytes_layout` gives that thread in its P-th load: row
    64a2 + 16w + 8a + g (P = 4a2 + 2a + b), bytes 32t + 16b.. (coalesced_w: 64b + 16t..). The compile-time
    `assert_trivial` then checks that this order is the registers' own; here, that the copy reads and `_piece_rows`
    returns the bytes the decode expects."""
    codes = torch.arange(rows * 128).view(rows, 128)                       # row * 128 + byte
    pieces = operands._thread_pieces.fn(codes, rows, coalesced_w)
    assert pieces.shape == (rows // 16, 128, 16)
    for piece, thread in itertools.product(range(rows // 16), range(128)):
        warp, lane = divmod(thread, 32)
        g, t = divmod(lane, 4)
        a2, a, b = piece // 4, piece // 2 % 2, piece % 2
        start = 64 * b + 16 * t if coalesced_w else 32 * t + 16 * b
        row = 64 * a2 + 16 * warp + 8 * a + g
        assert torch.equal(pieces[piece, thread], row * 128 + start + torch.arange(16)), (piece, thread)
    assert torch.equal(operands._piece_rows.fn(pieces, rows, coalesced_w), codes)


def test_staged_tiles_are_checked_and_misaligned_weights_refused():
    for stages in (0, 5):
        with pytest.raises(ValueError, match="1-4 stages"):
            moe_mxfp4.check_tile(GLUON_TILE._replace(num_stages=stages))
    for stages in (2, 3, 4):
        moe_mxfp4.check_tile(GLUON_TILE._replace(num_stages=stages, block_m=16, block_n=128))
    packed = torch.zeros(2, 64, 129, dtype=torch.uint8)
    moe_mxfp4._check_staged(GLUON_TILE, packed[:, :, 1:])                  # one stage: no copies, no rule
    with pytest.raises(ValueError, match="16-byte pieces"):
        moe_mxfp4._check_staged(GLUON_TILE._replace(num_stages=2), packed[:, :, 1:])
    moe_mxfp4._check_staged(GLUON_TILE._replace(num_stages=2), torch.zeros(2, 64, 128, dtype=torch.uint8))


def test_staged_kernels_compile_for_sm90_with_16_byte_copies():
    """K3's per-GPU widths through the op, offline: 8-row blocks at 2 and 3 stages (decode_thin's 72-register cap
    and 80), 16-row blocks with coalesced_x and coalesced_w at 3, 128-row programs at 2. Every launch compiles
    (the piece order is the registers' own: `assert_trivial`), every weight copy is one 16-byte cp.async, shared
    memory is the stages (8 KiB each at 64 rows) plus at most the GLU exchange, and the capped 8-row kernels keep 6
    or more programs an SM."""
    result = _python(K3_PACKED_EXPERTS + textwrap.dedent("""
        import re
        from backends.offline import capture, compile_launch, offline_target
        from kernels.triton.moe_mxfp4 import MXFP4_TILES_NVIDIA, moe_experts_mxfp4
        import triton
        from triton.experimental.gluon._runtime import GluonASTSource
        target = offline_target("sm_90")
        for block_m, rows, cap, stages, tokens, layout in (
                (8, 64, 72, 2, 1, {}), (8, 64, 80, 3, 16, {}),
                (16, 64, 0, 3, 64, dict(coalesced_x=True, coalesced_w=True)),
                (16, 128, 0, 2, 64, dict(coalesced_x=True, coalesced_w=True))):
            tile = MXFP4_TILES_NVIDIA["decode"]._replace(block_m=block_m, block_n=rows, maxnreg=cap,
                                                         num_stages=stages, **layout)
            with capture(target) as recorder:
                ids = torch.arange(tokens * K).view(tokens, K) % E
                moe_experts_mxfp4(torch.empty(tokens, D, dtype=torch.bfloat16), *w13, *w2,
                                  torch.full((tokens, K), 1 / K), ids, "situ", 4.0, 25.0, max_scale=120, tile=tile)
            for _, launch in recorder.launches:
                if "gluon" in launch.kernel:
                    c = compile_launch(launch, target)
                    opts = {k: v for k, v in launch.options.items() if v is not None}
                    ptx = triton.compile(GluonASTSource(launch.fn, launch.signature, launch.constexprs,
                                                        launch.attrs), target=target.triton_target,
                                         options=opts).asm["ptx"]
                    sizes = sorted(set(re.findall(r"cp[.]async[.]c[ag][.]shared[.]global [^;]*, (0x[0-9a-f]+)", ptx)))
                    print(block_m, rows, cap, stages, launch.kernel, c.error or "ok", c.resources.shared_bytes,
                          c.resources.occupancy, ",".join(sizes))
    """), timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 8, lines
    for line in lines:
        block_m, rows, cap, stages, kernel, status, shared, occupancy, sizes = line.split()
        stage_bytes = int(stages) * int(rows) * 128
        assert status == "ok" and sizes == "0x10", line
        assert stage_bytes <= int(shared) <= stage_bytes + 512 * int(block_m) * int(rows) // 64, line
        assert int(occupancy) >= (6 if cap != "0" else 2), line

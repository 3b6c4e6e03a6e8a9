"""The Gluon mma.sync decode kernels of the MXFP4 experts (`kernels.triton.moe_mxfp4_gluon`, sm_90's decode tile).

Gluon has no interpreter, so no CPU test runs these kernels. What runs here: the PTX of their four-byte decode,
executed by tests/test_mxfp4_asm_decode.py's interpreter on every byte in every position of a word and on the scale
bytes at and around the E8M0 extremes, bit for bit against the float64 reference; the tile rules (refusals, when
the swap tile stands in); and an offline sm_90 compile of both kernels through the op (no shared-memory staging,
registers for 6 or more programs an SM at 8 rows a block). The GPU sweep checks the kernels against float64 and
the extreme scales before timing them (bench/results/moe-mxfp4-gluon-nvidia-h200.txt).
"""
from __future__ import annotations

import itertools
import re
import textwrap

import pytest
import torch

from k3core.model.mxfp4 import _code_table, _scale_table
from kernels.triton import moe_mxfp4, moe_mxfp4_tiles
from tests.test_mxfp4_asm_decode import FOLD_SCALES, _all_scale_bits, _float_to_bf16, run_ptx
from tests.test_mxfp4_ops import _random_experts
from tests.test_offline_compile import K3_PACKED_EXPERTS, _python

gluon = pytest.importorskip("kernels.triton.moe_mxfp4_gluon_operands")
GLUON_TILE = moe_mxfp4_tiles.GLUON_DECODE_TILE_NVIDIA          # the plain (unstreamed) Gluon decode tile


@pytest.mark.parametrize("folded", [False, True], ids=["two-multiplies", "folded"])
def test_quad_decode_gives_every_byte_in_every_position_the_reference_value(folded):
    """Four bytes a call: the low-nibble codes of bytes (0, 1) and (2, 3), then the high-nibble ones, each times
    its byte's scale; every byte value in each of the four positions, scale bytes at the extremes (the folded form
    up to FOLD_MAX_SCALE, its only domain), each byte its own scale so that a swapped operand shows."""
    codes = _code_table(torch.device("cpu"), torch.float64)
    scales = _scale_table(torch.device("cpu"), torch.float64)
    extremes = FOLD_SCALES if folded else (0, 1, 2, 100, 126, 127, 128, 200, 252, 253, 254, 255)
    scale_bits = _all_scale_bits(folded)
    text = (gluon._QUAD_DECODE_FOLDED if folded else gluon._QUAD_DECODE).value
    for shift in range(len(extremes)):
        scale_bytes = [extremes[(shift + 3 * i) % len(extremes)] for i in range(4)]
        bits = [scale_bits[b] for b in scale_bytes]
        for first in range(256):
            packed = [first, (7 * first + 1 + shift) % 256, (13 * first + 5) % 256, (255 - first + shift) % 256]
            word = packed[0] | packed[1] << 8 | packed[2] << 16 | packed[3] << 24
            regs = run_ptx(text, {"$4": word, "$5": bits[0] | bits[1] << 16, "$6": bits[2] | bits[3] << 16})
            low = [regs["$0"] & 0xFFFF, regs["$0"] >> 16, regs["$1"] & 0xFFFF, regs["$1"] >> 16]
            high = [regs["$2"] & 0xFFFF, regs["$2"] >> 16, regs["$3"] & 0xFFFF, regs["$3"] >> 16]
            for i, (byte, scale_byte) in enumerate(zip(packed, scale_bytes)):
                want = (_float_to_bf16(codes[byte & 15].item() * scales[scale_byte].item()),
                        _float_to_bf16(codes[byte >> 4].item() * scales[scale_byte].item()))
                assert (low[i], high[i]) == want, (i, byte, scale_byte, hex(low[i]), hex(high[i]))


@pytest.mark.parametrize("folded", [False, True], ids=["two-multiplies", "folded"])
def test_quad_decode_uses_only_the_operands_its_constraints_declare(folded):
    """4 outputs ($0-$3: two bf16 pairs of each tile) and 3 inputs ($4 the word, $5 / $6 the scale pairs)."""
    text = (gluon._QUAD_DECODE_FOLDED if folded else gluon._QUAD_DECODE).value
    assert set(re.findall(r"\$(\d+)", text)) == {str(i) for i in range(7)}


def test_gluon_tiles_are_checked_and_refused_where_they_cannot_run():
    for change, match in ((dict(block_m=32), "block_m 8 or 16"), (dict(presplit=False), "presplit"),
                          (dict(block_k=128), "block_k 256"), (dict(split_x=True), "no other option"),
                          (dict(num_warps=8), "4-warp"), (dict(num_stages=5), "1-4 stages"),
                          (dict(asm_decode=False), "asm_decode"), (dict(prefetch=True), "no other option"),
                          (dict(block_n=32), "64 or 128 weight rows"), (dict(down_block_n=256), "64 or 128")):
        with pytest.raises(ValueError, match=match):
            moe_mxfp4.check_tile(GLUON_TILE._replace(**change))
    moe_mxfp4.check_tile(GLUON_TILE)
    moe_mxfp4.check_tile(GLUON_TILE._replace(block_m=16))
    moe_mxfp4.check_tile(GLUON_TILE._replace(block_n=128, down_block_n=64))
    moe_mxfp4.check_tile(GLUON_TILE._replace(down_block_n=128))
    gen = torch.Generator().manual_seed(4)
    experts, dim, inter = 2, 256, 256
    (w13p, w13s), (w2p, w2s) = _random_experts(gen, experts, 2 * inter, dim), _random_experts(gen, experts, dim, inter)
    x, ids, weights = torch.randn(3, dim).bfloat16(), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    with pytest.raises(ValueError, match="asm_decode is NVIDIA PTX"):          # the interpreter: no Gluon
        moe_mxfp4.moe_experts_mxfp4(x, w13p, w13s, w2p, w2s, weights, ids, "silu", None, None, tile=GLUON_TILE)
    with pytest.raises(ValueError, match="multiples of 256"):
        moe_mxfp4._check_gluon(GLUON_TILE, 384, 256)


def test_gluon_columns_are_presplit_and_coalesced_places_hold_the_documented_columns():
    """The host side of the kernels' x (and hidden) order (`_x_layout`): plain, the presplit order every presplit
    tile reads; coalesced_x, the 8-column piece c of thread t's columns at 32c + 8t of its half, so that the four
    threads of a token read 64 contiguous bytes a load. Thread t's pieces are columns 32t + 8c.. of the half, or
    with coalesced_w (its weight bytes 16t.. and 64 + 16t..) 64q + 16t + 8h.. for piece c = 2q + h."""
    rows, num_k = 3, 512
    x = torch.arange(rows * num_k, dtype=torch.float32).view(rows, num_k)
    assert torch.equal(gluon.gluon_columns(x, False, False), moe_mxfp4.presplit_columns(x, 256))
    for coalesced_w in (False, True):
        stored = gluon.gluon_columns(x, True, coalesced_w)
        for step, odd, t, c in itertools.product(range(num_k // 256), range(2), range(4), range(4)):
            first = 64 * (c // 2) + 16 * t + 8 * (c % 2) if coalesced_w else 32 * t + 8 * c
            j = first + torch.arange(8)
            place = step * 256 + odd * 128 + 32 * c + 8 * t
            assert torch.equal(stored[:, place:place + 8], x[:, step * 256 + 2 * j + odd]), (step, odd, t, c)
    # gate/up's hidden store places (`moe_mxfp4_prologue.stored_column`) agree with gluon_columns:
    # tests/test_mxfp4_prologue.py
    with pytest.raises(ValueError, match="multiple of 256"):
        gluon.gluon_columns(x[:, :384], True, False)
    with pytest.raises(ValueError, match="coalesced_x and coalesced_w are options of the Gluon"):
        moe_mxfp4.check_tile(moe_mxfp4_tiles.SWAP_DECODE_TILE_NVIDIA._replace(coalesced_w=True))
    with pytest.raises(ValueError, match="coalesced_w reorders x as coalesced_x stores it"):
        moe_mxfp4.check_tile(GLUON_TILE._replace(coalesced_w=True))
    moe_mxfp4.check_tile(GLUON_TILE._replace(coalesced_x=True, coalesced_w=True, stream=True))
    for tile in (moe_mxfp4_tiles.SWAP_DECODE_TILE_NVIDIA, GLUON_TILE):        # 16-row blocks of a gluon tile only
        with pytest.raises(ValueError, match="half_blocks is an option of the Gluon"):
            moe_mxfp4.check_tile(tile._replace(half_blocks=True))
    moe_mxfp4.check_tile(GLUON_TILE._replace(block_m=16, half_blocks=True))


def test_gluon_kernels_compile_for_sm90_with_no_shared_memory_staging():
    """Both kernels through the op at K3's per-GPU widths, 1 and 16 tokens, 8- and 16-row blocks, folded and
    exact scales, 64- and 128-row programs (offline, in a subprocess: conftest.py's TRITON_INTERPRET=1 gives
    interpreter stand-ins): every launch compiles (the 128-row operand tiles map onto the MMA's layouts with no
    data movement: `assert_trivial`), asks for at most 4 KiB of shared memory a 64-row program (the GLU
    epilogue's exchange; the operands never pass through it; 8 KiB at 128 rows and 16), and fits at least 6
    programs of 4 warps an SM with 8-row blocks (the committed tile; 3 for the swap tile it replaced), 4 with 16,
    7 for decode_thin's 72-register cap (K3's one-token down grid, 896 programs, in one wave of 132 x 7) and 4 for
    128-row programs under a 128-register cap (a 64-row down kernel beside them keeps its 6); coalesced_x (16-row
    blocks) and coalesced_w (8-row blocks, 128-row gate/up programs) as the plain kernels (their stored-order x
    and weight tiles map onto the operand layouts with no data movement: `assert_trivial`), and 16-row blocks
    with both and half_blocks (each kernel holding the 8- and the 16-row product) at 5 programs an SM."""
    result = _python(K3_PACKED_EXPERTS + textwrap.dedent("""
        from backends.offline import capture, compile_launch, offline_target
        from kernels.triton.moe_mxfp4 import MXFP4_TILES_NVIDIA, moe_experts_mxfp4
        target = offline_target("sm_90")
        CX, CXW = dict(coalesced_x=True), dict(coalesced_x=True, coalesced_w=True)
        for name, block_m, rows, down_rows, cap, tokens, max_scale, layout in (
                ("decode", 8, 64, 0, 0, 1, 120, {}), ("decode", 8, 64, 0, 0, 16, 255, {}),
                ("decode", 16, 64, 0, 0, 4, 120, {}), ("decode_thin", 8, 64, 0, 72, 1, 120, {}),
                ("decode", 8, 128, 64, 0, 1, 120, {}), ("decode", 16, 128, 0, 128, 64, 255, {}),
                ("coalesced", 16, 64, 0, 0, 64, 120, CX), ("coalesced", 8, 128, 64, 0, 1, 255, CXW),
                ("half_blocks", 16, 64, 0, 0, 64, 120, dict(CXW, half_blocks=True))):
            tile = MXFP4_TILES_NVIDIA["decode_thin" if name == "decode_thin" else "decode"]._replace(
                block_m=block_m, block_n=rows, down_block_n=down_rows, maxnreg=cap, **layout)
            with capture(target) as recorder:
                ids = torch.arange(tokens * K).view(tokens, K) % E
                moe_experts_mxfp4(torch.empty(tokens, D, dtype=torch.bfloat16), *w13, *w2,
                                  torch.full((tokens, K), 1 / K), ids, "situ", 4.0, 25.0, max_scale=max_scale,
                                  tile=tile)
            for _, launch in recorder.launches:
                if "gluon" in launch.kernel:
                    c = compile_launch(launch, target)
                    r = c.resources
                    named = {launch.fn.arg_names[path[0]]: value for path, value in launch.constexprs.items()}
                    print(name, block_m, named["WEIGHT_ROWS"], launch.kernel, c.error or "ok", r.shared_bytes,
                          r.occupancy)
    """), timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 18, lines
    for line in lines:
        name, block_m, rows, kernel, status, shared, occupancy = line.split()
        least = (4 if rows == "128" else 7 if name == "decode_thin" else 6 if block_m == "8"
                 else 5 if name == "half_blocks" else 4)
        shared_bound = 4096 if rows == "64" else 512 * int(block_m)
        assert status == "ok" and int(shared) <= shared_bound and int(occupancy) >= least, line

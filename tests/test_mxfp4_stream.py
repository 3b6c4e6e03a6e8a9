"""The streamed gate/up -> down pair of the Gluon MXFP4 decode kernels (a gluon tile's `stream` option,
`kernels.triton.moe_mxfp4_gluon`: per-row-block counters instead of a kernel boundary).

Gluon has no interpreter, so no CPU test runs the pair. What runs here: the tile and call rules (a stream tile is a
gluon one, its two GEMMs share one counter buffer, and it needs programmatic dependent launch: NVIDIA sm_90+), and an
offline sm_90 compile of both kernels through the op at K3's one-token shape that reads the launch and the PTX: the
gate/up grid is block-major, only the down kernel is a programmatic dependent launch, the release / acquire pairs
and the bounded poll are where the protocol needs them, and the plain pair carries none of it. The GPU sweep
checks the pair against float64, the extreme scales and a repeated call before timing it (bench/sweeps/stream.json).
"""
from __future__ import annotations

import textwrap

import pytest
import torch

from kernels.triton import moe_mxfp4
from kernels.triton.tuning_ops import AssumedDevice, assume_device
from tests.test_offline_compile import K3_PACKED_EXPERTS, _python

STREAM_TILE = moe_mxfp4.MXFP4_TILES_NVIDIA["decode_thin"]._replace(stream=True)


def test_stream_is_an_option_of_the_gluon_tiles_only():
    moe_mxfp4.check_tile(STREAM_TILE)
    with pytest.raises(ValueError, match="stream is an option of the Gluon mma.sync"):
        moe_mxfp4.check_tile(moe_mxfp4.SWAP_TILES_NVIDIA["decode"]._replace(stream=True))
    with pytest.raises(ValueError, match="fold_combine counts the streamed pair's down programs"):
        moe_mxfp4.check_tile(STREAM_TILE._replace(stream=False))


def test_only_a_fold_combine_tile_hands_down_the_output():
    """The combine's arguments go to a down kernel that writes the output only with a fold_combine tile; any other
    tile's down would leave the output unwritten, so it refuses them by name (before touching a tensor)."""
    blocks = moe_mxfp4.ExpertBlocks(torch.zeros(8, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                                    torch.zeros(1, dtype=torch.long))
    hidden = torch.zeros(8, 512, dtype=torch.bfloat16)
    w2 = torch.zeros(1, 256, 256, dtype=torch.uint8)
    combine = moe_mxfp4.Combine(torch.zeros(1, 256), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="only a fold_combine tile's down kernel combines the rows"):
        moe_mxfp4.down(hidden, w2, torch.zeros(1, 256, 16, dtype=torch.uint8), blocks,
                       STREAM_TILE._replace(fold_combine=False), counters=torch.zeros(8, dtype=torch.int32),
                       combine=combine)


def test_the_two_gemms_of_a_stream_tile_share_one_counter_buffer():
    """gate_up or down alone with a stream tile would leave (or wait for) counts nobody makes: refused by name."""
    with pytest.raises(ValueError, match="runs gate_up and down as a pair"):
        moe_mxfp4._check_stream(STREAM_TILE, None)
    with pytest.raises(ValueError, match="counters are a stream tile's"):
        moe_mxfp4._check_stream(STREAM_TILE._replace(stream=False), torch.zeros(8, dtype=torch.int32))
    moe_mxfp4._check_stream(STREAM_TILE, torch.zeros(8, dtype=torch.int32))
    assert moe_mxfp4._stream_counters(STREAM_TILE._replace(stream=False), torch.device("cpu"), 4) is None


@pytest.mark.parametrize("vendor, arch", [("nvidia", "sm_80"), ("amd", "gfx942"), (None, None)],
                         ids=["sm_80", "gfx942", "interpreter"])
def test_a_stream_tile_is_refused_without_programmatic_dependent_launch(vendor, arch):
    """The down kernel's launch is a programmatic dependent launch: sm_90+ only; elsewhere the call says why."""
    device = torch.device("cpu")
    if vendor is None:
        with pytest.raises(ValueError, match=r"programmatic dependent launch \(NVIDIA sm_90\+\)"):
            moe_mxfp4._stream_counters(STREAM_TILE, device, 4)
        return
    with assume_device(AssumedDevice(vendor, arch, 132)):
        with pytest.raises(ValueError, match=r"programmatic dependent launch \(NVIDIA sm_90\+\)"):
            moe_mxfp4._stream_counters(STREAM_TILE, device, 4)


def test_stream_pair_compiles_for_sm90_with_its_protocol_in_place():
    """K3's one token (16 row blocks, I = 3072, D = 3584), offline sm_90, in a subprocess (conftest.py's
    TRITON_INTERPRET=1 gives interpreter stand-ins). Streamed: gate/up's grid is (I / 32, blocks), so each block's
    programs start together; only down is launched with PDL; both keep decode_thin's 72 registers and 7 programs
    an SM; gate/up signals launch_dependents and, after a CTA barrier, makes one release increment; down polls with
    an acquire load between naps, traps past the bound, counts out with an acquire-release add and makes a second
    one into its column block's counter, and no combine kernel follows. Plain: the grid (blocks, I / 32), no PDL,
    none of those instructions, and the combine launch after down."""
    result = _python(K3_PACKED_EXPERTS + textwrap.dedent("""
        import triton
        from triton.experimental.gluon._runtime import GluonASTSource
        from backends.offline import capture, compile_launch, offline_target
        from kernels.triton.moe_mxfp4 import MXFP4_TILES_NVIDIA, moe_experts_mxfp4
        target = offline_target("sm_90")
        marks = ("griddepcontrol.launch_dependents", "atom.global.gpu.release.add", "ld.global.gpu.acquire",
                 "nanosleep", "trap;", "atom.global.gpu.acq_rel.add")
        for stream in (True, False):
            with capture(target) as recorder:
                moe_experts_mxfp4(torch.empty(1, D, dtype=torch.bfloat16), *w13, *w2, torch.full((1, K), 1 / K),
                                  torch.arange(K).view(1, K), "situ", 4.0, 25.0, max_scale=120,
                                  tile=MXFP4_TILES_NVIDIA["decode_thin"]._replace(stream=stream,
                                                                                  fold_combine=stream))
            for _, launch in recorder.launches:
                if "gluon" not in launch.kernel:
                    continue
                c = compile_launch(launch, target)
                options = {k: v for k, v in launch.options.items() if v is not None}
                ptx = triton.compile(GluonASTSource(launch.fn, launch.signature, launch.constexprs, launch.attrs),
                                     target=target.triton_target, options=options).asm["ptx"]
                found = ",".join(m for m in marks if m in ptx) or "-"
                barrier_first = ptx.rfind("bar.sync", 0, ptx.find("atom.global.gpu.release")) >= 0
                print(stream, launch.kernel, c.error or "ok", c.resources.registers, c.resources.occupancy,
                      "x".join(map(str, launch.grid)), launch.options.get("launch_pdl"), found, barrier_first,
                      ptx.count("atom.global.gpu.acq_rel.add"))
            print(stream, "launches", ",".join(launch.kernel for _, launch in recorder.launches))
    """), timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {(line.split()[0], line.split()[1]): line.split()[2:] for line in result.stdout.splitlines()}
    launches = {stream: rows.pop((stream, "launches"))[0] for stream in ("True", "False")}
    assert launches == {"True": "_group_pairs_and_columns_kernel,gate_up_gluon_kernel,down_gluon_kernel",
                        "False": "_group_pairs_and_columns_kernel,gate_up_gluon_kernel,down_gluon_kernel,"
                                 "_combine_kernel"}, launches       # streamed, down writes the combine itself
    assert sorted(rows) == [("False", "down_gluon_kernel"), ("False", "gate_up_gluon_kernel"),
                            ("True", "down_gluon_kernel"), ("True", "gate_up_gluon_kernel")], result.stdout
    for (stream, kernel), (status, registers, occupancy, grid, pdl, found, barrier_first, acq_rel) in rows.items():
        assert status == "ok" and int(registers) <= 72 and int(occupancy) >= 7, (stream, kernel, rows)
        gate_up = kernel.startswith("gate_up")
        if stream == "False":
            assert found == "-" and pdl == "False", (kernel, found, pdl)
            assert grid == ("16x96" if gate_up else "896"), (kernel, grid)
        elif gate_up:
            assert (grid, pdl, barrier_first) == ("96x16", "False", "True"), (grid, pdl, barrier_first)
            assert found == "griddepcontrol.launch_dependents,atom.global.gpu.release.add", found
        else:
            assert (grid, pdl) == ("896", "True"), (grid, pdl)
            assert found == "ld.global.gpu.acquire,nanosleep,trap;,atom.global.gpu.acq_rel.add", found
            assert acq_rel == "2", acq_rel             # the block's count-out and the column block's arrival


def test_stream_waits_count_exactly_the_programs_each_block_launches():
    """A down program waits until its block's counter reaches I / GATE_UP_COLS and counts out of D / ROWS: with
    64- and 128-row programs on either side, those must be the gate/up programs each block launches and the down
    programs each block launches, or down traps (too many awaited) or reads a half-written hidden (too few).
    Captured launches of K3's 1- and 16-token calls, offline (no compile)."""
    result = _python(K3_PACKED_EXPERTS + textwrap.dedent("""
        from backends.offline import capture, offline_target
        from kernels.triton.moe_mxfp4 import MXFP4_TILES_NVIDIA, moe_experts_mxfp4
        for rows, down_rows in ((64, 0), (128, 0), (128, 64), (64, 128)):
            for tokens in (1, 16):
                tile = MXFP4_TILES_NVIDIA["decode"]._replace(stream=True, block_n=rows, down_block_n=down_rows)
                with capture(offline_target("sm_90")) as recorder:
                    moe_experts_mxfp4(torch.empty(tokens, D, dtype=torch.bfloat16), *w13, *w2,
                                      torch.full((tokens, K), 1 / K),
                                      torch.arange(tokens * K).view(tokens, K) % E, "situ", 4.0, 25.0,
                                      max_scale=120, tile=tile)
                launches = {launch.kernel: launch for _, launch in recorder.launches if "gluon" in launch.kernel}
                gate_up, down = launches["gate_up_gluon_kernel"], launches["down_gluon_kernel"]
                named = {down.fn.arg_names[path[0]]: value for path, value in down.constexprs.items()}
                print(rows, down_rows, tokens, *gate_up.grid, *down.grid, named["GATE_UP_COLS"], named["WEIGHT_ROWS"])
    """))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [list(map(int, line.split())) for line in result.stdout.splitlines()]
    assert len(lines) == 8, result.stdout
    inter, hidden = 3072, 3584
    for rows, down_rows, tokens, up_cols, blocks, down_grid, awaited_cols, down_program_rows in lines:
        assert up_cols == inter // (rows // 2) and awaited_cols == rows // 2, lines   # awaited = launched
        assert down_program_rows == (down_rows or rows) and down_grid == blocks * hidden // down_program_rows, lines


def test_counter_invariant_names_what_a_pair_left_behind(monkeypatch):
    """`check_invariants` (run by the sweep after a stream tile's calls) passes on zeroed counters and names the
    non-zero ones otherwise; a call with more row blocks than the grid's y axis holds is refused."""
    stream = pytest.importorskip("kernels.triton.moe_mxfp4_stream")
    cpu = torch.device("cpu")
    counters = torch.zeros(16, dtype=torch.int32)
    monkeypatch.setattr(stream, "_COUNTERS", {(str(cpu), 0x7): counters})
    stream.check_invariants(cpu)
    counters[5] = 56                                   # block 2's down programs counted out, never reset
    with pytest.raises(AssertionError, match=r"stream 0x7 on cpu left non-zero after a streamed pair, at \[5\]"):
        stream.check_invariants(cpu)
    stream.check_invariants(torch.device("cuda", 0))   # another device's buffers are not this one's
    with pytest.raises(ValueError, match="at most 65535"):
        stream.stream_counters(cpu, 65536, 56)
    with pytest.raises(ValueError, match="at most 4096 column blocks"):
        stream.stream_counters(cpu, 16, 4097)
    buffer = stream.stream_counters(cpu, 16, 56)       # the column counters are the buffer's tail
    assert stream.column_counters(buffer).data_ptr() == buffer[-stream.MAX_COLUMN_BLOCKS:].data_ptr()

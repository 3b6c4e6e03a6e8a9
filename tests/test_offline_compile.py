"""The offline compile report (bench.kernel_resources --arch, backends.offline): launches captured from the real op
wrappers with the target's tables, compiled for AMD and NVIDIA on the CPU, and a non-zero exit on a failure.

Each test runs in a subprocess: conftest.py sets TRITON_INTERPRET=1, under which @triton.jit gives interpreter
stand-ins that cannot be compiled."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# K3's per-GPU experts for an offline compile of the MXFP4 op (packed codes and scales; never read, nothing runs),
# as a prelude for `_python`: E local experts of latent D and width I, top-K
K3_PACKED_EXPERTS = textwrap.dedent("""
    import torch
    E, D, I, K = 112, 3584, 3072, 16
    w13 = (torch.empty(E, 2 * I, D // 2, dtype=torch.uint8), torch.empty(E, 2 * I, D // 32, dtype=torch.uint8))
    w2 = (torch.empty(E, D, I // 2, dtype=torch.uint8), torch.empty(E, D, I // 32, dtype=torch.uint8))
""")


def _python(code: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_attn_res_compiles_for_both_amd_targets_in_both_dtypes():
    """attn_res once selected between pointers of two arguments, which Triton 3.6.0's AMD buffer-ops pass rejects:
    every AttnRes launch of K3 must compile for gfx942 and gfx950."""
    result = _python("""
        from bench.kernel_resources import main
        raise SystemExit(main(["--arch", "gfx942,gfx950", "--ops", "attn_res_read", "--models", "k3:8:8",
                               "--jobs", "1"]))
    """)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| attn_res_read |")]
    assert len(rows) >= 4 and all("| ok |" in row for row in rows), rows      # 2 targets x num_valid == 1 or not
    assert "Every launch compiles and fits" in result.stdout


def test_capture_uses_the_assumed_targets_tables_and_specialisation():
    """The recorded launch is what a GPU launch of that vendor would be: the AMD table's 8 wavefronts for an
    8192-wide AttnRes row (NVIDIA's 4 warps), num_valid == 1 specialised as a constant, 16-byte pointers marked."""
    result = _python("""
        import torch
        from backends.offline import capture, offline_target
        from kernels.triton.attn_res import attn_res_read
        for arch in ("gfx942", "sm_90"):
            for num_valid in (1, 5):
                with capture(offline_target(arch)) as recorder:
                    attn_res_read(torch.empty(64, 8, 7168, dtype=torch.bfloat16), num_valid,
                                  torch.empty(64, 7168, dtype=torch.bfloat16), torch.empty(7168), 1e-5)
                (_, launch), = recorder.launches
                pointer_range = ["tt.pointer_range", 32] in launch.attrs[(0,)]
                print(arch, num_valid, launch.options["num_warps"], launch.signature["num_valid"],
                      ["tt.divisibility", 16] in launch.attrs[(0,)], pointer_range)
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:4] == ["gfx942 1 8 constexpr True True", "gfx942 5 8 i32 True True",
                                             "sm_90 1 4 constexpr True False", "sm_90 5 4 i32 True False"]


def test_an_lds_overrun_fails_the_report():
    """A launch that asks for more LDS than the target has exits non-zero and names the launch (here a gfx942 with
    a 32-byte LDS, which the 8192-wide RMSNorm's reduction scratch exceeds)."""
    result = _python("""
        import backends.offline as offline
        from bench.kernel_resources import main
        offline.TARGETS["gfx942"] = offline.TARGETS["gfx942"]._replace(shared_bytes=32)
        raise SystemExit(main(["--arch", "gfx942", "--ops", "rms_norm", "--models", "k3-mini", "--dtypes", "bf16",
                               "--jobs", "1"]))
    """)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "FAILED" in result.stdout and "the gfx942 limit is 32 B" in result.stdout


def test_every_registered_triton_op_has_an_offline_case():
    """An op registered for a backend without a case here would silently never be compiled offline."""
    result = _python("""
        from backends.offline_cases import model_shape, op_calls
        from backends.offline_report import backend_functions
        from k3core.config import load_config
        import torch
        for backend in ("rocm", "cuda"):
            functions, _ = backend_functions(backend)
            calls = list(op_calls(model_shape(load_config("k3-mini")), torch.bfloat16, functions))
            assert {c.op for c in calls} == set(functions), (backend, set(functions) - {c.op for c in calls})
            print(backend, len(functions))
    """)
    assert result.returncode == 0, result.stderr[-3000:]


def test_float32_kda_prefill_fits_both_amd_targets():
    """The float32 state pass asked for 128 KiB of LDS on gfx942 (64 KiB) at the table's chunk and block_v; fitted
    from the target's LDS size, every kda_prefill launch (state and intra passes) compiles and fits on both."""
    result = _python("""
        from bench.kernel_resources import main
        raise SystemExit(main(["--arch", "gfx942,gfx950", "--ops", "kda_prefill", "--models", "k3-mini",
                               "--dtypes", "float32"]))
    """)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    state_rows = [line for line in result.stdout.splitlines() if "| kda_chunk_state_kernel |" in line]
    assert state_rows and all("| ok |" in row for row in state_rows), state_rows


def test_state_config_and_precision_follow_the_architecture():
    """Chunk and block_v from the LDS size (not per-case guards); a precision the architecture rejects replaced."""
    from kernels.triton.tuning import (dot_precision, fit_chunk_size, fit_state_config, kernel_config,
                                       shared_memory_limit, state_shared_bytes)
    from kernels.triton.tuning_ops import AssumedDevice, assume_device
    amd = (kernel_config("kda_state", "amd"), kernel_config("kda_state_wide", "amd"))
    expected = {("gfx942", 2): (64, 16), ("gfx942", 4): (32, 16), ("gfx950", 2): (64, 32), ("gfx950", 4): (64, 16)}
    for (arch, element_size), (chunk, block_v) in expected.items():
        with assume_device(AssumedDevice("amd", arch, 256)):
            limit = shared_memory_limit()
            assert fit_chunk_size(64, 128, element_size, amd) == chunk, (arch, element_size)
            fitted = fit_state_config(amd[0], chunk, 128, element_size, limit)
            assert fitted.block_v == block_v, (arch, element_size, fitted)
            assert state_shared_bytes(chunk, 128, fitted.block_v, fitted.num_stages, element_size) <= limit
    assert fit_state_config(amd[0], 64, 128, 4, None) == amd[0]          # the interpreter: unchanged
    with assume_device(AssumedDevice("amd", "gfx950", 256)):
        assert dot_precision("tf32") == "bf16x3" and dot_precision("ieee") == "ieee"
    with assume_device(AssumedDevice("amd", "gfx942", 304)):
        assert dot_precision("tf32") == "tf32"
    with assume_device(AssumedDevice("nvidia", "sm_90", 132)):
        assert dot_precision("tf32") == "tf32" and dot_precision("bf16x3") == "tf32x3"


def test_mxfp4_experts_use_dot_scaled_on_sm100_and_gfx950_and_compile_there():
    """On sm_100 and gfx950 the provider's bf16 MXFP4 expert GEMMs go through tl.dot_scaled (the swap kernels with
    SCALED), and both compile there within the target's shared memory / LDS; sm_90 keeps its own decode
    (MXFP4_TILES_NVIDIA's one-token decode tile: the Gluon mma.sync kernels with their PTX decode since the H200
    sweep at 12058ee)."""
    result = _python("""
        import torch
        from backends.offline import capture, compile_launch, offline_target
        from kernels.triton.moe_mxfp4 import moe_experts_mxfp4
        experts, latent, width, top_k = 112, 3584, 3072, 16
        u8 = dict(dtype=torch.uint8)
        w13 = (torch.empty(experts, 2 * width, latent // 2, **u8), torch.empty(experts, 2 * width, latent // 32, **u8))
        w2 = (torch.empty(experts, latent, width // 2, **u8), torch.empty(experts, latent, width // 32, **u8))
        for arch in ("sm_100", "gfx950", "sm_90"):
            target = offline_target(arch)
            with capture(target) as recorder:
                ids = torch.arange(top_k)[None, :]
                moe_experts_mxfp4(torch.empty(1, latent, dtype=torch.bfloat16), *w13, *w2,
                                  torch.full((1, top_k), 1 / top_k), ids, "situ", 4.0, 25.0)
            for _, launch in recorder.launches:
                if "gate_up" in launch.kernel or "down" in launch.kernel:
                    compiled = compile_launch(launch, target)
                    print(arch, launch.kernel, "SCALED=True" in launch.describe(),
                          "ASM_DECODE=True" in launch.describe(), compiled.error or "ok")
    """)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = sorted(result.stdout.splitlines()[:6])
    assert lines == sorted(["sm_100 _gate_up_swap_kernel True False ok", "sm_100 _down_swap_kernel True False ok",
                            "gfx950 _gate_up_swap_kernel True False ok", "gfx950 _down_swap_kernel True False ok",
                            "sm_90 gate_up_gluon_kernel False False ok", "sm_90 down_gluon_kernel False False ok"]), \
        result.stdout


def _mxfp4_compiles(tiles: str, archs: tuple[str, ...], experts: int, kernels: str) -> list[str]:
    """Compile the launches of `moe_experts_mxfp4` at 4 tokens and K3's per-GPU widths for each tile (`tiles`: a
    Python expression over Mxfp4Tile) and arch, kernels whose name contains `kernels`; a line per launch:
    'arch block_m kernel status stack spills'."""
    result = _python(f"""
        import torch
        from backends.offline import capture, compile_launch, offline_target
        from kernels.triton.moe_mxfp4 import Mxfp4Tile, moe_experts_mxfp4
        experts, latent, width, top_k = {experts}, 3584, 3072, 16
        u8 = dict(dtype=torch.uint8)
        w13 = (torch.empty(experts, 2 * width, latent // 2, **u8), torch.empty(experts, 2 * width, latent // 32, **u8))
        w2 = (torch.empty(experts, latent, width // 2, **u8), torch.empty(experts, latent, width // 32, **u8))
        for arch in {archs!r}:
            target = offline_target(arch)
            for tile in {tiles}:
                with capture(target) as recorder:
                    ids = torch.arange(4 * top_k).view(4, top_k) % experts
                    moe_experts_mxfp4(torch.empty(4, latent, dtype=torch.bfloat16), *w13, *w2,
                                      torch.full((4, top_k), 1 / top_k), ids, "situ", 4.0, 25.0, tile=tile)
                for _, launch in recorder.launches:
                    if {kernels!r} in launch.kernel:
                        c = compile_launch(launch, target)
                        r = c.resources
                        print(arch, tile.block_m, launch.kernel, c.error or "ok", r.scratch_bytes, r.spills or 0)
    """)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout.splitlines()


def test_mxfp4_gemv_tiles_compile_for_sm90_and_both_amd_targets_without_spilling():
    """The gemv decode tiles (no tl.dot; bench.moe_mxfp4_sweep's one-row and four-row candidates, and one with the
    next step's words prefetched) compile for sm_90, gfx942 and gfx950 at K3's per-GPU shapes with no local-memory
    stack (NVIDIA) and no VGPR spills (AMD)."""
    lines = _mxfp4_compiles("(Mxfp4Tile(1, 64, 128, 4, 3, gemv=True), Mxfp4Tile(4, 32, 128, 4, 3, gemv=True), "
                            "Mxfp4Tile(1, 64, 128, 4, 3, gemv=True, prefetch=True))",
                            ("sm_90", "gfx942", "gfx950"), 112, "gemv")
    assert len(lines) == 18, lines
    for line in lines:
        arch, block_m, kernel, status, stack, spills = line.split()
        assert status == "ok" and stack == "0" and spills == "0", line


def test_presplit_and_stacked_swap_tiles_compile_for_amd_and_sm100_without_spilling():
    """The presplit / stacked swap kernels (sm_90's defaults, there with the PTX decode), also with a tail part
    (tail_m: sm_90's mid and prefill tiles), are portable Triton without it: with the Triton decode they compile
    for gfx942, gfx950 and sm_100 at K3's per-GPU widths with no VGPR spills or local-memory stack. Never run on
    those devices."""
    lines = _mxfp4_compiles("(Mxfp4Tile(16, 64, 256, 4, 2, swap=True, presplit=True, stacked=True), "
                            "Mxfp4Tile(32, 64, 128, 4, 2, swap=True, presplit=True, stacked=True, tail_m=16))",
                            ("gfx942", "gfx950", "sm_100"), 8, "swap")
    assert len(lines) == 12, lines
    for line in lines:
        arch, block_m, kernel, status, stack, spills = line.split()
        assert status == "ok" and stack == "0" and spills == "0", line


def test_the_swap_gate_up_kernel_drops_its_weight_row_mask_where_every_column_is_real():
    """K3 at 64 tokens on sm_90 takes the decode_batch swap tile. I = 3072 is a multiple of a stacked program's 32
    columns, so gate/up is launched with EVEN_N: no row mask on its weight loads. Compiled both ways, that form has
    fewer SASS instructions at no more registers, no stack and its wgmma as batched (as many WARPGROUP arrive /
    wait instructions). Down is launched masked: EVEN_N there made ptxas wait on each wgmma alone. The masked
    gate/up form runs in the interpreted tests (tests/test_mxfp4_ops.py: 64-column stacked programs, I = 96)."""
    result = _python(K3_PACKED_EXPERTS + textwrap.dedent("""
        import dataclasses
        from backends.offline import capture, compile_launch, launch_sass, offline_target
        from bench.kernel_resources import SASS_INSTRUCTION
        from kernels.triton.moe_mxfp4 import moe_experts_mxfp4
        target = offline_target("sm_90")
        tokens = 64
        ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t))[:K] for t in range(tokens)])
        with capture(target) as recorder:
            moe_experts_mxfp4(torch.empty(tokens, D, dtype=torch.bfloat16), *w13, *w2, torch.full((tokens, K), 1 / K),
                              ids, "situ", 4.0, 25.0, max_scale=120)
        launches = {launch.kernel: launch for _, launch in recorder.launches}
        print("down", "EVEN_N" in launches["_down_swap_kernel"].describe())
        gate_up = launches["_gate_up_swap_kernel"]
        even = next(path for path in gate_up.constexprs if gate_up.fn.arg_names[path[0]] == "EVEN_N")
        for form, constexprs in (("even", gate_up.constexprs), ("masked", {**gate_up.constexprs, even: False})):
            launch = dataclasses.replace(gate_up, constexprs=constexprs)
            c = compile_launch(launch, target)
            sass = launch_sass(launch, target)
            instructions = len(SASS_INSTRUCTION.findall(sass))
            print(form, c.error or "ok", c.resources.registers, c.resources.scratch_bytes, instructions,
                  sass.count("WARPGROUP.ARRIVE"), sass.count("WARPGROUP.DEPBAR"), constexprs[even])
    """), timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {line.split()[0]: line.split()[1:] for line in result.stdout.splitlines()}
    assert rows["down"] == ["False"], result.stdout
    even, masked = rows["even"], rows["masked"]
    assert even[0] == masked[0] == "ok" and even[-1] == "True" and masked[-1] == "False", result.stdout
    assert int(even[1]) <= min(128, int(masked[1])) and even[2] == masked[2] == "0", result.stdout
    assert int(even[3]) < int(masked[3]), result.stdout                # fewer instructions
    assert even[4:6] == masked[4:6], result.stdout                     # the wgmma batched as before


def test_the_gluon_decode_kernels_load_x_with_no_row_mask():
    """A decode block's padding columns read a real row's x (`moe_mxfp4_gluon._x_rows`), so at 1 and 16 tokens of
    K3 on sm_90 the Gluon kernels' K loops load x / hidden with no predicate: masked, each was a predicated
    LDG.E.128 whose registers were zeroed first (16 CS2R a K step). The loop is the SASS between a backward branch
    and its target that holds the HMMAs. (The swap kernels keep their masks: `moe_mxfp4_operands._rows_t`.) At 16
    tokens (the decode tile) the loop reloads no spill either."""
    result = _python(K3_PACKED_EXPERTS + textwrap.dedent("""
        import re
        from backends.offline import capture, launch_sass, offline_target
        from bench.kernel_resources import SASS_INSTRUCTION
        from kernels.triton.moe_mxfp4 import moe_experts_mxfp4
        target = offline_target("sm_90")
        for tokens in (1, 16):
            ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t))[:K]
                               for t in range(tokens)])
            with capture(target) as recorder:
                moe_experts_mxfp4(torch.empty(tokens, D, dtype=torch.bfloat16), *w13, *w2,
                                  torch.full((tokens, K), 1 / K), ids, "situ", 4.0, 25.0, max_scale=120)
            for _, launch in recorder.launches:
                if "gluon" not in launch.kernel:
                    continue
                lines = [m.group(0) for m in SASS_INSTRUCTION.finditer(launch_sass(launch, target))]
                address = [int(re.search(r"/\\*([0-9a-f]+)\\*/", line).group(1), 16) for line in lines]
                for end, line in enumerate(lines):
                    jump = re.search(r"BRA\\s.*?0x([0-9a-f]+)", line)
                    if jump and int(jump.group(1), 16) in address[:end]:
                        body = lines[address.index(int(jump.group(1), 16)):end + 1]
                        if any("HMMA" in b for b in body):
                            print(tokens, launch.kernel, len(body), sum("HMMA" in b for b in body),
                                  sum(bool(re.search(r"@!?P\\d+\\s+LDG", b)) for b in body),
                                  sum("CS2R" in b for b in body), sum("LDL" in b for b in body))
    """), timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {tuple(line.split()[:2]): [int(n) for n in line.split()[2:]] for line in result.stdout.splitlines()}
    assert set(rows) == {(tokens, kernel) for tokens in ("1", "16")
                         for kernel in ("gate_up_gluon_kernel", "down_gluon_kernel")}, result.stdout
    for key, (instructions, mmas, predicated_loads, zeroing, local_loads) in rows.items():
        assert mmas == 16 and predicated_loads == 0 and zeroing == 0, (key, result.stdout)
    # the decode tile (no register cap) reloads no spill in its K loop: a reload there cost K3's 16-token gate/up
    # 7% on an H100 (bbaa114, and 3322492's paired decode); decode_thin's cap of 72 keeps one of 8 bytes
    assert rows[("16", "gate_up_gluon_kernel")][4] == rows[("16", "down_gluon_kernel")][4] == 0, result.stdout


def test_a_down_register_cap_applies_to_the_down_kernel_alone():
    """`Mxfp4Tile.down_maxnreg` (bench/sweeps/registers-thin.json): K3 at one token on sm_90 with decode_thin's
    tile at maxnreg 80 and down_maxnreg 72 compiles gate/up at 80 registers with no stack (no spill to reload in its
    K loop) and down at 72, whose 896 programs then fit one wave at 7 programs an SM."""
    result = _python(K3_PACKED_EXPERTS + textwrap.dedent("""
        from backends.offline import capture, compile_launch, offline_target
        from kernels.triton.moe_mxfp4 import MXFP4_TILES_NVIDIA, moe_experts_mxfp4
        target = offline_target("sm_90")
        tile = MXFP4_TILES_NVIDIA["decode_thin"]._replace(maxnreg=80, down_maxnreg=72)
        with capture(target) as recorder:
            moe_experts_mxfp4(torch.empty(1, D, dtype=torch.bfloat16), *w13, *w2, torch.full((1, K), 1 / K),
                              torch.arange(K).view(1, K), "situ", 4.0, 25.0, max_scale=120, tile=tile)
        for _, launch in recorder.launches:
            if "gluon" in launch.kernel:
                c = compile_launch(launch, target)
                print(launch.kernel, c.error or "ok", launch.options["maxnreg"], c.resources.registers,
                      c.resources.scratch_bytes, c.resources.occupancy)
    """), timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {line.split()[0]: line.split()[1:] for line in result.stdout.splitlines()}
    assert rows["gate_up_gluon_kernel"] == ["ok", "80", "80", "0", "6"], result.stdout
    down = rows["down_gluon_kernel"]
    assert down[:3] == ["ok", "72", "72"] and down[4] == "7", result.stdout


def test_the_one_program_grouping_compiles_for_every_target_at_both_ends_of_its_range():
    """`moe_blocks._group_pairs_kernel` (tl.histogram, tl.sort and tl.gather over every pair at once) is the MoE
    bookkeeping of every decode-sized batch on every backend: it compiles for sm_90, sm_100, gfx942 and gfx950 at
    one token of K3 (16 pairs, 112 local experts), at its largest batch (1024 pairs) and at its most experts (1024),
    with no local-memory stack or VGPR spill."""
    result = _python("""
        import torch
        from backends.offline import capture, compile_launch, offline_target
        from kernels.triton.moe_blocks import MAX_KERNEL_EXPERTS, SMALL_BATCH_PAIRS, group_pairs_small
        for arch in ("sm_90", "sm_100", "gfx942", "gfx950"):
            target = offline_target(arch)
            for pairs, experts in ((16, 112), (SMALL_BATCH_PAIRS, 112), (SMALL_BATCH_PAIRS, MAX_KERNEL_EXPERTS)):
                with capture(target) as recorder:
                    group_pairs_small(torch.zeros(pairs, dtype=torch.long), 0, experts, 16)
                (_, launch), = recorder.launches
                c = compile_launch(launch, target)
                print(arch, pairs, experts, launch.kernel, c.error or "ok", c.resources.scratch_bytes,
                      c.resources.spills or 0)
    """)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 12, lines
    for line in lines:
        arch, pairs, experts, kernel, status, stack, spills = line.split()
        assert kernel == "_group_pairs_kernel" and status == "ok" and stack == "0" and spills == "0", line

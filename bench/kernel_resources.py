"""Registers, spills, LDS / shared memory and occupancy of every kernel launch, compiled offline for a GPU that is
not here.

    python -m bench.kernel_resources --arch gfx942            # every launch of the rocm backend, for an MI300X
    python -m bench.kernel_resources --arch gfx942,gfx950,sm_90 --out conformance/results/offline-compile.md
    python -m bench.kernel_resources --kernels kda_state      # the KDA prefill kernels by hand, with SASS counts

The first form runs every Triton op provider of the target's backend (rocm for gfx942 / gfx950, cuda for sm_90 /
sm_100) on CPU tensors at the per-GPU shapes of K3 (TP8 / EP8) and k3-mini, in bf16 and float32, records the launches
instead of running them (`backends.offline`), compiles each distinct one for the target and prints a table per
target. It exits non-zero when any launch fails to compile or asks for more LDS / shared memory than the target
has: the check CI runs so that a change which breaks an AMD compile fails before anyone holds an AMD GPU.

The second form (`--kernels`, NVIDIA only) compiles the KDA prefill kernels with hand-written signatures and counts
their SASS instructions, the offline proxy bench/README.md quotes for the issue-bound intra pass.

No GPU needed: Triton's wheel compiles for both vendors on the CPU (ptxas and cuobjdump for NVIDIA are bundled; the
AMD backend links in-process). What it cannot say is time; time comes from the GPU benchmarks.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

KDA_SHAPE = dict(H=12, K=128, V=128, BT=64, BK=128)      # K3 at TP8: 12 heads, K = V = 128, chunks of 64
# kda_state_prefetch = the state pass loading each chunk's inputs one step ahead (KernelConfig.prefetch)
# kda_segment_map + kda_segment_scan (+ kda_state per segment) = the segmented state pass (KernelConfig.segment_chunks)
KERNELS = ("kda_intra", "kda_intra_two_block", "kda_state", "kda_state_prefetch", "kda_segment_map", "kda_segment_scan")
STATE_KERNELS = ("kda_state", "kda_state_prefetch")
# one SASS instruction line of `cuobjdump --dump-sass`: "/*0120*/  @!P0 FMUL R4, R2, R3 ;"
SASS_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+\S.*;", re.MULTILINE)


@dataclass(frozen=True)
class Resources:
    kernel: str
    config: str
    registers: int          # per thread (255 is the cap)
    stack_bytes: int        # per thread, local memory: > 0 means spills (or a real local array)
    shared_bytes: int       # per program, as Triton reports it
    sass_per_program: int   # static SASS instructions x warps: what a program issues when it has no loop (the intra
                            # passes), a proxy for issue-bound kernels, whose time tracked it on the H200 (README)


def _tool(name: str) -> Path:
    import triton.backends.nvidia as nvidia  # noqa: PLC0415 (only where Triton's NVIDIA backend is installed)
    path = Path(nvidia.__file__).parent / "bin" / name
    if not path.exists():
        raise SystemExit(f"{path} is missing: this Triton install has no bundled {name}")
    return path


def _signature(kernel: str) -> tuple[object, dict[str, str], dict]:
    """(the jit function, its argument types, its constexprs) for one kernel at K3's shape in bf16."""
    if kernel in ("kda_intra", "kda_intra_two_block"):
        from kernels.triton import kda_chunk_intra  # noqa: PLC0415
        fn = (kda_chunk_intra.kda_chunk_intra_kernel if kernel == "kda_intra"
              else kda_chunk_intra.kda_chunk_intra_two_block_kernel)
        pointers = {"q_ptr": "bf16", "k_ptr": "bf16", "v_ptr": "bf16", "f_ptr": "bf16", "beta_ptr": "bf16",
                    "a_log_ptr": "fp32", "dt_bias_ptr": "fp32", "chunk_start_ptr": "i32", "chunk_len_ptr": "i32",
                    "w_ptr": "bf16", "u_ptr": "bf16", "qg_ptr": "bf16", "kd_ptr": "bf16", "aqk_ptr": "bf16",
                    "decay_ptr": "fp32"}
        scalars = {"lower_bound": "fp32"}
        consts = dict(KDA_SHAPE, BVF=128, SUB=16, FORM=1, PRECISION="tf32")
        if kernel == "kda_intra":
            consts["DENSE"] = True
    elif kernel == "kda_segment_map":
        from kernels.triton.kda_chunk_segments import kda_segment_map_kernel as fn  # noqa: PLC0415
        pointers = {"w_ptr": "bf16", "u_ptr": "bf16", "kd_ptr": "bf16", "decay_ptr": "fp32",
                    "chunk_start_ptr": "i32", "chunk_len_ptr": "i32", "seg_chunk_ptr": "i32", "map_ptr": "fp32"}
        scalars = {}
        consts = dict(H=12, K=128, V=128, BT=64, BK=128, INTERPRETED=False, PRECISION="tf32")
    elif kernel == "kda_segment_scan":
        from kernels.triton.kda_chunk_segments import kda_segment_scan_kernel as fn  # noqa: PLC0415
        pointers = {"map_ptr": "fp32", "state_ptr": "fp32", "slot_ptr": "i32", "has_init_ptr": "i32",
                    "seq_seg_ptr": "i32", "seg_state_ptr": "fp32"}
        scalars = {"state_stride": "i64"}
        consts = dict(H=12, K=128, V=128, BK=128, INTERPRETED=False, PRECISION="tf32")
    elif kernel in STATE_KERNELS:
        from kernels.triton.kda_chunk_state import kda_chunk_state_kernel as fn  # noqa: PLC0415
        pointers = {name: "bf16" for name in ("w_ptr", "u_ptr", "qg_ptr", "kd_ptr", "aqk_ptr")}
        pointers.update(decay_ptr="fp32", o_ptr="bf16", state_ptr="fp32", slot_ptr="i32", has_init_ptr="i32",
                        seq_chunk_ptr="i32", chunk_start_ptr="i32", chunk_len_ptr="i32",
                        ckpt_ptr="fp32", chunk_ckpt_ptr="i32")
        scalars = {"state_stride": "i64", "scale": "fp32"}
        consts = dict(KDA_SHAPE, CHECKPOINTS=False, INTERPRETED=False, PRECISION="ieee",
                      PREFETCH=kernel == "kda_state_prefetch")
    else:
        raise ValueError(f"unknown kernel {kernel!r}; choose from {', '.join(KERNELS)}")
    names = fn.arg_names
    signature = {}
    for name in names:
        if name in pointers:
            signature[name] = "*" + pointers[name]
        elif name in scalars:
            signature[name] = scalars[name]
        else:
            signature[name] = "constexpr"
    return fn, signature, consts


def _launch_attrs(fn, signature: dict[str, str]) -> dict:
    """The specialisation a real launch gets: Triton marks every argument whose value is a multiple of 16 (pointers:
    their address) as divisible by 16, which decides how wide its loads vectorise and whether the pipeliner can use
    cp.async. The bench's tensors are fresh torch allocations (16-byte aligned) and the only integer argument here
    that is not a constexpr, the state's slot stride (H * V * K), is a multiple of 16 at K3's shape. Without these
    attributes the compile is of a kernel no launch runs (narrower loads, different spills)."""
    divisible = [name for name, kind in signature.items() if kind.startswith("*") or name == "state_stride"]
    return {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}


def measure(kernel: str, num_warps: int, num_stages: int, arch: int = 90, block_v: int | None = None,
            chunk: int = 64) -> Resources:
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415
    fn, signature, consts = _signature(kernel)
    consts["BT"] = chunk
    if kernel in (*STATE_KERNELS, "kda_segment_scan"):
        consts["BV"] = block_v or 16
    if kernel == "kda_segment_map":             # block_v stands for its column block of [T | b]
        consts["BC"] = block_v or 16
    if kernel == "kda_segment_scan":            # it has no chunk rows
        consts.pop("BT")
    compiled = triton.compile(ASTSource(fn, signature, consts, _launch_attrs(fn, signature)),
                              target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.TemporaryDirectory() as directory:
        cubin = Path(directory) / f"{kernel}.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(_tool("cuobjdump")), "-res-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([str(_tool("cuobjdump")), "--dump-sass", str(cubin)], capture_output=True,
                              text=True, check=True).stdout
    registers = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    if not registers or not stack:
        raise RuntimeError(f"cuobjdump printed no resource line for {kernel}:\n{usage}")
    config = f"chunk={chunk} num_warps={num_warps} num_stages={num_stages}" + (f" block_v={block_v}" if block_v
                                                                                else "")
    instructions = len(SASS_INSTRUCTION.findall(sass))
    return Resources(kernel, config, int(registers.group(1)), int(stack.group(1)), int(compiled.metadata.shared),
                     instructions * num_warps)


DEFAULT_CONFIGS = (("kda_intra", 4, 1, None), ("kda_intra", 8, 1, None), ("kda_intra", 16, 1, None),
                   ("kda_intra_two_block", 2, 1, None), ("kda_intra_two_block", 4, 1, None),
                   ("kda_intra_two_block", 8, 1, None),
                   ("kda_state", 4, 2, 16), ("kda_state", 8, 2, 16), ("kda_state", 4, 2, 64),
                   ("kda_state_prefetch", 4, 2, 16), ("kda_state_prefetch", 4, 1, 64), ("kda_segment_map", 4, 2, 16),
                   ("kda_segment_map", 4, 2, 32), ("kda_segment_scan", 8, 1, 16))


MODELS = "k3:8:8,k3-mini:1:1"           # preset:tp:ep, the per-GPU shapes the report compiles
DTYPES = {"bf16": "bfloat16", "float32": "float32"}


def kda_kernels(kernels: str, arch: str, chunks: str) -> int:
    """The hand-written KDA prefill signatures (see the module docstring), one line per config."""
    if not arch.removeprefix("sm_").isdigit():
        raise SystemExit(f"--kernels compiles for NVIDIA only (its SASS counts need cuobjdump); got --arch {arch}")
    capability = int(arch.removeprefix("sm_"))
    wanted = set(kernels.split(","))
    print(f"sm_{capability}, {KDA_SHAPE['H']} heads, K = V = {KDA_SHAPE['K']}, bf16")
    print(f"{'kernel':16} {'config':46} {'registers':>9} {'stack B':>8} {'shared B':>9} {'SASS/program':>12}")
    for chunk in (int(c) for c in chunks.split(",")):
        for kernel, warps, stages, block_v in DEFAULT_CONFIGS:
            if kernel not in wanted:
                continue
            r = measure(kernel, warps, stages, capability, block_v, chunk)
            print(f"{r.kernel:16} {r.config:46} {r.registers:9d} {r.stack_bytes:8d} {r.shared_bytes:9d} "
                  f"{r.sass_per_program:12d}", flush=True)
    return 0


def _model_shapes(models: str) -> list:
    from backends.offline_cases import model_shape  # noqa: PLC0415
    from k3core.config import load_config  # noqa: PLC0415
    shapes = []
    for item in models.split(","):
        preset, tp, ep = (item.split(":") + ["1", "1"])[:3]
        shapes.append(model_shape(load_config(preset), tp=int(tp), ep=int(ep)))
    return shapes


def launch_report(arches: str, models: str, dtypes: str, ops: str, out: str, jobs: int) -> int:
    """Every launch of the backend for each target in `arches`; 1 when any fails to compile or overruns."""
    import datetime  # noqa: PLC0415

    import torch  # noqa: PLC0415
    import triton  # noqa: PLC0415

    from backends.offline import offline_target  # noqa: PLC0415
    from backends.offline_report import compile_report, markdown  # noqa: PLC0415
    from k3core.provenance import commit_under_test  # noqa: PLC0415
    targets = [offline_target(a.strip()) for a in arches.split(",") if a.strip()]
    unknown = [d for d in dtypes.split(",") if d not in DTYPES]
    if unknown:
        raise SystemExit(f"unknown dtype(s) {', '.join(unknown)}; choose from: {', '.join(DTYPES)}")
    torch_dtypes = [getattr(torch, DTYPES[d]) for d in dtypes.split(",")]
    shapes = _model_shapes(models)
    header = (f"# Offline compile report\n\ntriton {triton.__version__}, torch {torch.__version__}, commit "
              f"{commit_under_test()}, {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}"
              f"\n\n`python -m bench.kernel_resources --arch {arches} --models {models} --dtypes {dtypes}"
              + (f" --ops {ops}" if ops else "") + "`: every launch of the op providers at the per-GPU shapes of "
              + ", ".join(s.name for s in shapes) + f" in {dtypes.replace(',', ' and ')}, compiled offline (no GPU)."
              "\n")
    print(header, flush=True)
    sections, failures = [header], []
    for target in targets:
        report = compile_report(target, shapes, torch_dtypes, set(ops.split(",")) if ops else None, jobs)
        text = markdown(report)
        print(text, flush=True)
        sections.append(text)
        failures += [f"{target.arch}: {f}" for f in report.failures]
    summary = (f"FAILED: {len(failures)} launch(es) cannot run:\n" + "\n".join(f"- {f}" for f in failures)
               if failures else "Every launch compiles and fits on every target above.")
    print(summary)
    sections.append("\n" + summary + "\n")
    if out:
        Path(out).write_text("\n".join(sections))
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="sm_90",
                        help="comma-separated targets: gfx942, gfx950, sm_90, sm_100 (a bare number n reads as sm_n)")
    parser.add_argument("--models", default=MODELS, help="comma-separated preset:tp:ep (default %(default)s)")
    parser.add_argument("--dtypes", default="bf16,float32", help="activation dtypes: bf16, float32")
    parser.add_argument("--ops", default="", help="only these ops (default: every op of the backend)")
    parser.add_argument("--out", default="", help="also write the report (markdown) to this file")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="compile in this many processes (default %(default)s)")
    parser.add_argument("--kernels", default="",
                        help=f"instead: the hand-written KDA prefill kernels ({', '.join(KERNELS)}) with SASS counts")
    parser.add_argument("--chunks", default="64,32", help="--kernels: tokens per chunk (the kernels' BT)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: the interpreter replaces the kernels that this compiles")
    if args.kernels:
        return kda_kernels(args.kernels, args.arch, args.chunks)
    return launch_report(args.arch, args.models, args.dtypes, args.ops, args.out, args.jobs)


if __name__ == "__main__":
    sys.exit(main())

"""Offline compiles: the kernel launches the op wrappers would make on a GPU that is not here, compiled for it.

Triton 3.6's wheel compiles for AMD (hip gfx942 / gfx950: the ocml/ockl bitcode and lld are inside libtriton) and
NVIDIA (cuda sm_90 / sm_100: the wheel's ptxas) on a CPU-only machine. Two steps:

* `capture(target)`: inside this block the launch parameters are chosen as for `target` (`assume_device`) and
  `JITFunction.run`, the code behind `kernel[grid](...)`, records the launch instead of running it: the signature,
  the constexprs, the specialisation attributes (16-divisible integers and pointers, AMD's 32-bit pointer ranges)
  and the options, bound by Triton's own binder for the target's backend. Op wrappers called on CPU tensors inside
  it therefore produce exactly the launches a GPU run would, with the vendor's own tuning tables.
* `compile_launch(launch, target)`: `triton.compile` of one recorded launch, and its resources read back
  (registers, spills, scratch, LDS / shared memory against the target's limit, occupancy).

Nothing here needs a GPU; nothing inside `capture` may expect a kernel's output.
"""
from __future__ import annotations

import contextlib
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, NamedTuple


class OfflineTarget(NamedTuple):
    """One GPU architecture the launches are compiled for, with the facts the report checks against."""
    arch: str                    # "gfx942", "sm_90", ...
    vendor: str                  # "amd" | "nvidia" (kernels.triton.tuning's vendor names)
    backend: str                 # the k3core backend whose tables it uses: "rocm" | "cuda"
    device: str                  # what it is, for the report
    compute_units: int           # CUs or SMs (split-KV and state configs size their grids from it)
    warp_size: int
    shared_bytes: int            # LDS per workgroup (AMD) / opt-in shared memory per block (NVIDIA)
    registers_per_thread: int    # the most a thread can hold (AMD: the unified VGPR file at one wave per SIMD)

    @property
    def triton_target(self):
        from triton.backends.compiler import GPUTarget  # noqa: PLC0415
        if self.vendor == "amd":
            return GPUTarget("hip", self.arch, self.warp_size)
        return GPUTarget("cuda", int(self.arch.removeprefix("sm_")), self.warp_size)


TARGETS: dict[str, OfflineTarget] = {
    "gfx942": OfflineTarget("gfx942", "amd", "rocm", "MI300X (CDNA3)", 304, 64, 64 * 1024, 512),
    "gfx950": OfflineTarget("gfx950", "amd", "rocm", "MI355X (CDNA4)", 256, 64, 160 * 1024, 512),
    "sm_90": OfflineTarget("sm_90", "nvidia", "cuda", "H100 / H200 (Hopper)", 132, 32, 227 * 1024, 255),
    "sm_100": OfflineTarget("sm_100", "nvidia", "cuda", "B200 (Blackwell)", 148, 32, 227 * 1024, 255),
}


def offline_target(arch: str) -> OfflineTarget:
    """The target named `arch` ("gfx942", "sm_90"; "90" reads as "sm_90")."""
    name = f"sm_{arch}" if arch.isdigit() else arch
    if name not in TARGETS:
        raise ValueError(f"unknown offline target {arch!r}; choose one of: {', '.join(TARGETS)}")
    return TARGETS[name]


@dataclass
class Launch:
    """One recorded `kernel[grid](...)` call, as Triton would have compiled it."""
    fn: Any                      # the JITFunction
    signature: dict[str, str]
    constexprs: dict
    attrs: dict
    options: dict[str, Any]      # the backend's parsed options (num_warps, num_stages, ...)
    grid: tuple

    @property
    def kernel(self) -> str:
        return self.fn.fn.__name__

    @property
    def key(self) -> tuple:
        """Two launches with one key compile to one binary (the grid does not enter the compile)."""
        return (self.fn.fn.__module__, self.kernel, tuple(self.signature.items()), repr(sorted(self.constexprs.items())),
                repr(sorted(self.attrs.items())), repr(sorted(self.options.items())))

    def describe(self) -> str:
        """The launch's constexprs and warps/stages, short: 'BT=64 BV=32, 4w 2s'."""
        names = self.fn.arg_names
        consts = " ".join(f"{names[path[0]]}={_short(value)}" for path, value in sorted(self.constexprs.items())
                          if len(path) == 1 and self.signature.get(names[path[0]]) == "constexpr")
        return f"{consts}, {self.options['num_warps']}w {self.options['num_stages']}s"


    def unaligned_ints(self) -> str:
        """The integer arguments this launch does not specialise as multiples of 16: what tells two launches of one
        config apart (Triton compiles a 16-divisible integer, e.g. a row stride, into wider vector accesses)."""
        names = self.fn.arg_names
        found = [name for index, name in enumerate(names) if self.signature.get(name) in ("i32", "i64")
                 and ["tt.divisibility", 16] not in self.attrs.get((index,), [])]
        return " ".join(found) or "-"


def _short(value: Any) -> str:
    return str(value.value if hasattr(value, "value") else value)


@dataclass
class Recorder:
    """The launches recorded inside one `capture` block, in call order, with the op each belongs to."""
    target: OfflineTarget
    launches: list[tuple[str, Launch]] = field(default_factory=list)
    op: str = ""

    def record(self, launch: Launch) -> None:
        self.launches.append((self.op, launch))


@contextlib.contextmanager
def capture(target: OfflineTarget) -> Iterator[Recorder]:
    """Record instead of run every Triton launch made inside the block, with launch parameters chosen for `target`.
    Set `recorder.op` to label what follows. Needs compiled (not interpreted) kernels: TRITON_INTERPRET unset before
    the kernel modules are imported."""
    from triton import knobs  # noqa: PLC0415
    from triton.compiler import make_backend  # noqa: PLC0415
    from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: PLC0415

    from kernels.triton.tuning_ops import AssumedDevice, assume_device  # noqa: PLC0415
    backend = make_backend(target.triton_target)
    recorder = Recorder(target)
    binders: dict[int, Any] = {}

    def record_run(fn, *args, grid, warmup, **kwargs):
        kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        binder = binders.get(id(fn))
        if binder is None:
            binder = binders[id(fn)] = create_function_from_signature(fn.signature, fn.params, backend)
        bound_args, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
        recorder.record(Launch(fn, signature, constexprs, attrs, dict(options.__dict__),
                               tuple(grid) if not callable(grid) else ("callable",)))
        return None

    original = JITFunction.run
    JITFunction.run = record_run
    try:
        with assume_device(AssumedDevice(target.vendor, target.arch, target.compute_units)):
            yield recorder
    finally:
        JITFunction.run = original


# ---- compile and read the resources ------------------------------------------------------------------------
@dataclass(frozen=True)
class Resources:
    """What one compiled launch uses per thread / per program, and whether it fits the target."""
    registers: int               # per thread: VGPRs on AMD (the unified file: AGPRs included), registers on NVIDIA
    accumulation_registers: int  # AMD: the AGPRs among them (MFMA accumulators and spill space); 0 on NVIDIA
    scalar_registers: int        # SGPRs (AMD); 0 on NVIDIA
    spills: int | None           # VGPRs spilled (AMD .vgpr_spill_count); None on NVIDIA, whose cubin does not
                                 # say (a stack there is spills or a local array)
    scratch_bytes: int           # per thread: AMD private segment, NVIDIA local-memory stack
    shared_bytes: int            # LDS / shared memory per program (Triton's metadata: the size the launch asks for)
    occupancy: int               # AMD: waves per SIMD (LLVM's, capped by LDS); NVIDIA: programs per SM
    shared_limit: int

    @property
    def over_shared(self) -> bool:
        return self.shared_bytes > self.shared_limit


@dataclass(frozen=True)
class CompileResult:
    launch: Launch
    resources: Resources | None
    error: str = ""              # the compile failure, or why the launch cannot run ("" when it compiles and fits)

    @property
    def failed(self) -> bool:
        return bool(self.error)


def compile_launch(launch: Launch, target: OfflineTarget) -> CompileResult:
    """Compile one captured launch for `target`; a compile error or an LDS / shared-memory overrun is a failure."""
    try:
        compiled = _compile(launch, target)
        resources = (_amd_resources(compiled, target, launch) if target.vendor == "amd"
                     else _nvidia_resources(compiled, target, launch))
    except Exception as exc:  # noqa: BLE001  (any compiler failure is the finding; its message is kept)
        message = " ".join(str(exc).split())
        return CompileResult(launch, None, f"compile failed: {type(exc).__name__}: {message[:400]}")
    if resources.over_shared:
        return CompileResult(launch, resources, f"needs {resources.shared_bytes} B of shared memory, the "
                                                f"{target.arch} limit is {resources.shared_limit} B")
    return CompileResult(launch, resources)


def _compile(launch: Launch, target: OfflineTarget):
    import triton  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415
    options = {k: v for k, v in launch.options.items() if v is not None}
    source = ASTSource
    if getattr(launch.fn, "is_gluon", lambda: False)():       # a Gluon kernel (kernels.triton.moe_mxfp4_gluon)
        from triton.experimental.gluon._runtime import GluonASTSource  # noqa: PLC0415
        source = GluonASTSource
    return triton.compile(source(launch.fn, launch.signature, launch.constexprs, launch.attrs),
                          target=target.triton_target, options=options)


def launch_sass(launch: Launch, target: OfflineTarget) -> str:
    """The SASS of one captured launch compiled for an NVIDIA `target` (cuobjdump --dump-sass), for tests and
    tools that count what a kernel's loop issues; a compile error raises."""
    if target.vendor != "nvidia":
        raise ValueError(f"launch_sass: SASS is NVIDIA's; {target.arch} is {target.vendor}")
    with tempfile.TemporaryDirectory() as directory:
        cubin = Path(directory) / "kernel.cubin"
        cubin.write_bytes(_compile(launch, target).asm["cubin"])
        return subprocess.run([str(_cuobjdump()), "--dump-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout


def _field(text: str, name: str) -> int:
    found = re.search(rf"^\s*-?\s*\.{re.escape(name)}:\s+(\d+)", text, re.MULTILINE)
    if not found:
        raise RuntimeError(f"the AMDGCN metadata has no .{name}")
    return int(found.group(1))


def _amd_resources(compiled, target: OfflineTarget, launch: Launch) -> Resources:
    asm = compiled.asm["amdgcn"]
    occupancy = re.search(r"; Occupancy:\s+(\d+)", asm)
    shared = int(compiled.metadata.shared)
    waves = int(occupancy.group(1)) if occupancy else 0
    if shared:
        # LDS is dynamic here, so LLVM's occupancy does not see it: a CU (4 SIMDs) holds lds // shared workgroups
        workgroups = target.shared_bytes // shared
        waves = min(waves, -(-workgroups * launch.options["num_warps"] // 4)) if workgroups else 0
    return Resources(registers=_field(asm, "vgpr_count"), accumulation_registers=_field(asm, "agpr_count"),
                     scalar_registers=_field(asm, "sgpr_count"), spills=_field(asm, "vgpr_spill_count"),
                     scratch_bytes=_field(asm, "private_segment_fixed_size"), shared_bytes=shared,
                     occupancy=waves, shared_limit=target.shared_bytes)


def _cuobjdump() -> Path:
    import triton.backends.nvidia as nvidia  # noqa: PLC0415 (only where Triton's NVIDIA backend is installed)
    path = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    if not path.exists():
        raise RuntimeError(f"{path} is missing: this Triton install has no bundled cuobjdump")
    return path


def _nvidia_resources(compiled, target: OfflineTarget, launch: Launch) -> Resources:
    with tempfile.TemporaryDirectory() as directory:
        cubin = Path(directory) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(_cuobjdump()), "-res-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
    registers = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    if not registers or not stack:
        raise RuntimeError(f"cuobjdump printed no resource line:\n{usage}")
    regs, stack_bytes = int(registers.group(1)), int(stack.group(1))
    shared = int(compiled.metadata.shared)
    threads = launch.options["num_warps"] * 32
    # programs per SM: 64K registers (allocated per warp in units of 256), 228 KiB shared (1 KiB reserved per
    # program), 64 warps, 32 programs
    per_warp = -(-regs * 32 // 256) * 256
    by_registers = 65536 // (per_warp * launch.options["num_warps"]) if regs else 32
    by_shared = (228 * 1024) // (shared + 1024) if shared else 32
    programs = min(by_registers, by_shared, 64 * 32 // threads, 32)
    return Resources(registers=regs, accumulation_registers=0, scalar_registers=0, spills=None, scratch_bytes=stack_bytes,
                     shared_bytes=shared, occupancy=programs, shared_limit=target.shared_bytes)

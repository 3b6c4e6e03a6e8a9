"""Every kernel launch a backend makes for a model, captured from its op providers and compiled for one target.

`compile_report(target, models, dtypes)` runs each Triton provider the target's backend registers (`rocm` for
gfx942 / gfx950, `cuda` for sm_90 / sm_100) on the cases of `backends.offline_cases` under
`backends.offline.capture`, compiles every distinct launch once, and returns the results grouped by op; `markdown`
prints them as one table per target. Ops the backend serves without a Triton kernel (a vendor library, the torch
reference on the device) are listed with the provider that serves them and compile nothing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from backends.offline import CompileResult, Launch, OfflineTarget, Resources, capture, compile_launch
from backends.offline_cases import ModelShape, op_calls

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "float32"}


@dataclass
class LaunchRow:
    """One distinct compiled launch and every (model, dtype, op call) that makes it."""
    op: str
    result: CompileResult
    uses: list[str] = field(default_factory=list)

    @property
    def launch(self) -> Launch:
        return self.result.launch


@dataclass
class Report:
    target: OfflineTarget
    rows: list[LaunchRow]
    providers: dict[str, str]               # op -> the provider that serves it on this backend
    capture_errors: list[str]               # op calls whose wrapper raised before launching
    seconds: float

    @property
    def failures(self) -> list[str]:
        found = [f"{row.op} {row.launch.kernel} [{row.launch.describe()}]: {row.result.error} (at {row.uses[0]})"
                 for row in self.rows if row.result.failed]
        return found + self.capture_errors


def backend_functions(backend: str) -> tuple[dict[str, object], dict[str, str]]:
    """(op -> the function of its Triton provider, op -> the name of the provider that serves it) for `backend`.
    The serving provider is the one selection would pick on a GPU of the backend's vendor: the highest priority one
    (Triton's kernels rank above vendor libraries and the torch reference on the device)."""
    from k3core.backend import load_backend, providers  # noqa: PLC0415
    from k3core.ops import OP_NAMES  # noqa: PLC0415
    load_backend(backend)
    functions, serving = {}, {}
    for op in OP_NAMES:
        own = [p for p in providers(op) if p.backend == backend]
        serving[op] = own[0].name if own else f"torch.{op} (the CPU reference: no {backend} provider)"
        triton = next((p for p in own if p.name == f"{backend}.triton.{op}"), None)
        if triton is not None and own[0] is triton:
            functions[op] = triton.load()
    return functions, serving


def compile_report(target: OfflineTarget, shapes: list[ModelShape], dtypes: list[torch.dtype],
                   ops: set[str] | None = None, jobs: int = 1) -> Report:
    """Capture every op call of `shapes` x `dtypes` for `target`, then compile each distinct launch once, on `jobs`
    forked processes."""
    started = time.monotonic()
    functions, serving = backend_functions(target.backend)
    if ops:
        functions = {op: fn for op, fn in functions.items() if op in ops}
    by_key: dict[tuple, tuple[str, Launch, list[str]]] = {}
    capture_errors: list[str] = []
    with capture(target) as recorder:
        for shape in shapes:
            for dtype in dtypes:
                for call in op_calls(shape, dtype, functions):
                    use = f"{shape.name} {DTYPE_NAMES.get(dtype, dtype)} {call.label}"
                    recorder.launches.clear()
                    try:
                        call.run()
                    except Exception as exc:  # noqa: BLE001  (a wrapper that refuses the engine's shape is a finding)
                        capture_errors.append(f"{call.op} at {use}: the wrapper raised {type(exc).__name__}: {exc}")
                        continue
                    for _, launch in recorder.launches:
                        by_key.setdefault(launch.key, (call.op, launch, []))[2].append(use)
    pending = list(by_key.values())
    results = _compile_all([launch for _, launch, _ in pending], target, jobs)
    rows = [LaunchRow(op, result, uses) for (op, _, uses), result in zip(pending, results)]
    return Report(target, rows, serving, capture_errors, time.monotonic() - started)


_FORKED: list[Launch] = []          # the launches a forked compile worker reads (JITFunctions do not pickle)


def _compile_forked(index_and_target: tuple[int, OfflineTarget]) -> tuple[Resources | None, str]:
    index, target = index_and_target
    result = compile_launch(_FORKED[index], target)
    return result.resources, result.error


def _compile_all(launches: list[Launch], target: OfflineTarget, jobs: int) -> list[CompileResult]:
    if jobs <= 1 or len(launches) < 2:
        return [compile_launch(launch, target) for launch in launches]
    import multiprocessing  # noqa: PLC0415
    _FORKED[:] = launches
    try:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            found = pool.map(_compile_forked, [(i, target) for i in range(len(launches))], chunksize=1)
    finally:
        _FORKED.clear()
    return [CompileResult(launch, resources, error) for launch, (resources, error) in zip(launches, found)]


def _kib(num_bytes: int) -> str:
    return f"{num_bytes / 1024:.1f}"


def markdown(report: Report) -> str:
    """One table: a row per distinct launch, with what it uses against the target's limits."""
    t = report.target
    amd = t.vendor == "amd"
    lines = [f"## {t.arch}: {t.device}, {t.backend} tables",
             "",
             f"{len(report.rows)} distinct launches, captured and compiled in {report.seconds:.0f} s (less when "
             f"Triton's cache already holds them); limits: {_kib(t.shared_bytes)} KiB {'LDS' if amd else 'shared memory'} per program, "
             f"{t.registers_per_thread} registers per thread. "
             + ("Registers are VGPRs of the unified file (the AGPRs among them in brackets); occupancy is waves per SIMD (LLVM's count, capped by LDS)."
                if amd else "Occupancy is programs per SM (from registers and shared memory); the cubin does not "
                            "say which stack bytes are spills."),
             "",
             f"| op | kernel | config | ints not 16-divisible | registers | {'SGPRs | spills | ' if amd else ''}scratch B | "
             f"{'LDS' if amd else 'shared'} KiB | occupancy | result | launches | first use |",
             f"|---|---|---|---|---:|{'---:|---:|' if amd else ''}---:|---:|---:|---|---:|---|"]
    for row in sorted(report.rows, key=lambda r: (r.op, r.launch.kernel, r.launch.describe())):
        r = row.result.resources
        status = "FAIL: " + row.result.error if row.result.failed else "ok"
        if r is None:
            cells = ["-"] * (6 if amd else 4)
        else:
            registers = f"{r.registers} ({r.accumulation_registers})" if amd else str(r.registers)
            cells = [registers] + ([str(r.scalar_registers), str(r.spills)] if amd else []) + [
                str(r.scratch_bytes), _kib(r.shared_bytes), str(r.occupancy)]
        lines.append(f"| {row.op} | {row.launch.kernel} | {row.launch.describe()} | {row.launch.unaligned_ints()} | "
                     f"{' | '.join(cells)} | "
                     f"{status} | {len(row.uses)} | {row.uses[0]} |")
    lines += ["", "Ops served without a Triton kernel on this backend:", ""]
    compiled_ops = {row.op for row in report.rows}
    for op, provider in report.providers.items():
        if op not in compiled_ops and f".triton.{op}" not in provider:
            lines.append(f"- {op}: {provider}")
    if report.capture_errors:
        lines += ["", "Op calls that raised before any launch:", ""] + [f"- {e}" for e in report.capture_errors]
    return "\n".join(lines) + "\n"


def print_offline_choice(backend: str, arch: str, config, dtype: torch.dtype, tp: int, ep: int) -> int:
    """`python -m k3core.backends --arch`: the provider of every op on `arch` and what its launches use there;
    1 when a launch fails to compile or does not fit."""
    import os  # noqa: PLC0415

    from backends.offline import offline_target  # noqa: PLC0415
    from backends.offline_cases import model_shape  # noqa: PLC0415
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("error: unset TRITON_INTERPRET: --arch compiles the kernels, which the interpreter replaces")
        return 2
    target = offline_target(arch)
    if backend not in ("auto", target.backend):
        print(f"error: {arch} is served by the {target.backend} backend, not {backend}; pass --backend "
              f"{target.backend}")
        return 2
    shape = model_shape(config, tp, ep)
    report = compile_report(target, [shape], [dtype])
    print(f"model: {shape.name}   dtype: {DTYPE_NAMES.get(dtype, dtype)}   offline target: {arch} ({target.device}), "
          f"{target.shared_bytes // 1024} KiB {'LDS' if target.vendor == 'amd' else 'shared memory'}   "
          f"backend: {target.backend}")
    for op, provider in report.providers.items():
        rows = [row for row in report.rows if row.op == op]
        print(f"{op:20} -> {provider}" + ("" if rows or ".triton." not in provider else "   (no launch at these shapes)"))
        for row in sorted(rows, key=lambda r: r.launch.kernel):
            r = row.result.resources
            used = (f"{r.registers} registers, {r.scratch_bytes} B scratch, {r.shared_bytes / 1024:.1f} KiB shared, "
                    f"occupancy {r.occupancy}") if r else "no binary"
            status = f"FAIL: {row.result.error}" if row.result.failed else "ok"
            print(f"    {row.launch.kernel:32} {row.launch.describe()}: {used}: {status}")
    for error in report.capture_errors:
        print(f"    FAIL: {error}")
    print(f"{len(report.rows)} distinct launches compiled in {report.seconds:.0f} s; "
          + (f"{len(report.failures)} cannot run" if report.failures else "every one compiles and fits"))
    return 1 if report.failures else 0

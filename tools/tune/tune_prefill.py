"""Where KDA chunked prefill spends its time, pass by pass, and a sweep of each pass's launch configs.

    python -m tools.tune.tune_prefill [--out DIR] [--passes state]  # on an H200: 3 shapes, 240 s of sweep + set-up
    TRITON_INTERPRET=1 python -m tools.tune.tune_prefill --smoke  # tiny grid on the CPU: checks the plumbing only

kda_prefill is two Triton passes (kernels/triton/kda_prefill.py): `intra` (parallel over chunks and heads) and
`state` (sequential over each sequence's chunks, also writing the outputs). For each of bench/cases_kda's prefill
shapes but the 128K one (32K has the same form), this times the whole op, each pass alone with the table configs,
and fla's chunk_kda where fla is installed, all on the same inputs, for each chunk size asked for. Then each pass is
swept on its own over (num_warps, num_stages), for `state` also the value block, whether each chunk's loads are
issued a step ahead (prefetch) and whether the chunks run as parallel segments (segment_chunks). Every trial first
runs on NaN-filled workspace and outputs, and the op's output and final states are checked against the float64
reference (bench/cases_kda); only a config that compiled and passed is timed (do_bench median, the sweep's short
budget). Configs past the time budget are listed as skipped. Results: tune-prefill-<device>.json and .md in --out
(else $OUT, else bench/results), with the best config of each pass per shape and chunk size (the table is
`_NVIDIA` in kernels/triton/tuning.py)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from collections.abc import Callable

import torch

from bench.cases_kda import (
    HEAD_DIM,
    HEADS,
    PREFILL_SHAPES,
    SMOKE_HEAD_DIM,
    SMOKE_HEADS,
    SMOKE_PREFILL_SHAPES,
    fla_prefill,
    prefill_checks,
    prefill_inputs,
    prefill_reference,
)
from bench.context import fla_unavailable, make_context, require_interpreter, results_dir
from bench.report import environment, poison_allocator
from bench.timing import sweep_timer
from kernels.triton.kda_prefill import PrefillLaunch, kda_prefill, prefetch_unchecked, prepare_kda_prefill
from kernels.triton.tuning import KernelConfig, kernel_config

TIME_BUDGET_S = 240.0
SHAPES = tuple((label, lengths) for label, lengths in PREFILL_SHAPES if sum(lengths) <= 32768)
# (warps, stages) of the intra pass. In bench/results/archive/tune-prefill-chunks-nvidia-h200.md, at 32-token
# chunks 4 warps won everywhere (0.79 ms against 1.35 on 8); 16 warps never won at either chunk size. Tried and
# dropped: the pass as two kernels (0.96 ms), over channel tiles, with a register cap, on 2 warps.
# (warps, stages, two_block): two_block runs 32-token chunks as two 16-token halves (kda_chunk_intra_two_block_kernel).
INTRA_GRID = ((4, 1, False), (4, 2, False), (8, 1, False), (2, 1, True), (4, 1, True), (8, 1, True))
# (block_v, warps, stages, prefetch, segment_chunks) of the state pass, the segmented forms first (a budget cut loses
# the tail; they lost in bench/results/archive/tune-prefill-segments-nvidia-h200.md: 1.95 ms at best against 1.45
# at B=1). Left out after the earlier sweeps (archive/tune-prefill-*): (16, 4, 1), (32, 4, 1) and (32, 8, 1) gave
# WRONG outputs at every shape, 2 warps with 2 stages ran 2-40x slower than the best, and the
# split form (outputs from a parallel kernel) never won: it lost 1.86 against 1.46 ms at B=1, its target.
STATE_GRID = (tuple((block_v, warps, 2, True, segment) for segment in (16, 32, 64)
                    for block_v, warps in ((16, 4), (32, 4)))
              + tuple((block_v, warps, stages, True, 0) for block_v, warps, stages in
                      ((16, 4, 2), (16, 8, 2), (32, 4, 2), (64, 4, 2), (64, 8, 2), (128, 8, 2)))
              + ((16, 4, 2, False, 0), (64, 4, 1, False, 0), (64, 4, 2, False, 0)))
PASSES = ("intra", "state")
SMOKE_INTRA_GRID = ((1, 1, False), (2, 1, False), (1, 1, True))
SMOKE_STATE_GRID = ((8, 1, 1, False, 0), (16, 1, 1, False, 0), (8, 1, 1, True, 0), (8, 1, 1, True, 2))


@dataclasses.dataclass
class Trial:
    shape: str
    kernel: str                  # "intra", "state", "whole op", "whole op, host metadata", "fla"
    config: dict
    chunk: int = 0               # tokens per chunk of the trial (0 for fla, which chooses its own)
    status: str = "ok"           # "ok", "wrong: ...", "error: ...", "skipped: ..."
    ms: float | None = None
    error: float | None = None   # worst relative error of the checks


def _configs(smoke: bool) -> tuple[list[KernelConfig], list[KernelConfig]]:
    intra, state = kernel_config("kda_intra"), kernel_config("kda_state")
    intra_grid = SMOKE_INTRA_GRID if smoke else INTRA_GRID
    state_grid = SMOKE_STATE_GRID if smoke else STATE_GRID
    return ([dataclasses.replace(intra, num_warps=w, num_stages=s, two_block=two) for w, s, two in intra_grid],
            [dataclasses.replace(state, block_v=b, num_warps=w, num_stages=s, prefetch=prefetch,
                                 segment_chunks=segment) for b, w, s, prefetch, segment in state_grid])


def _config_dict(kind: str, config: KernelConfig) -> dict:
    keys = ("num_warps", "num_stages", "solve_precision", "two_block") if kind == "intra" else (
        "block_v", "num_warps", "num_stages", "prefetch", "segment_chunks")
    return {key: getattr(config, key) for key in keys}


def _poison(launch: PrefillLaunch, workspace: bool) -> None:
    tensors = [launch.output, launch.state_tensor]
    if workspace:
        tensors += [launch.w, launch.qg, launch.kd, launch.u0, launch.aqk, launch.decay]
    for tensor in tensors:
        tensor.fill_(float("nan"))


def sweep_shape(ctx, label: str, lengths: tuple[int, ...], heads: int, dim: int, budget_s: float,
                passes: tuple[str, ...], chunk_sizes: tuple[int, ...], log: Callable[[Trial], None]) -> list[Trial]:
    """Set up (inputs, float64 reference), then per chunk size time the whole op and each pass (sweeping the
    passes named), then fla; budget_s counts from the end of the set-up, so slow input generation cannot starve
    the sweep, and is shared evenly by the chunk sizes."""
    x = prefill_inputs(ctx, lengths, heads, dim)
    ref = prefill_reference(ctx, x)
    trials: list[Trial] = []
    started = time.perf_counter()
    for index, chunk in enumerate(chunk_sizes):
        deadline = started + budget_s * (index + 1) / len(chunk_sizes)
        trials += _sweep_chunk(ctx, x, ref, label, chunk, passes, deadline, log)
    if not fla_unavailable(ctx):
        # last and outside the budget: fla autotunes on its first call (about 100 s per shape on an H200)
        anchor = fla_prefill(x)
        trials.append(_attempt(ctx, x, ref, Trial(label, "fla", {}), float("inf"), lambda: anchor()[0][0], anchor,
                               log))
    return trials


def _attempt(ctx, x, ref, trial: Trial, deadline: float, run: Callable[[], torch.Tensor],
             timed: Callable[[], object], log: Callable[[Trial], None], skip: str = "") -> Trial:
    """run() poisons what it writes, runs, and returns the op's output; timed() is what gets timed. A non-empty
    `skip` says why the trial is not run."""
    if skip:
        trial.status = f"skipped: {skip}"
    elif time.perf_counter() > deadline:
        trial.status = "skipped: past the time budget"
    else:
        try:
            checks = prefill_checks(ctx, x, ref, run(), who="fla " if trial.kernel == "fla" else "")
            trial.error = max(c.error for c in checks)
            failed = [c.describe() for c in checks if not c.ok]
            if failed:
                trial.status = "wrong: " + "; ".join(failed)
            else:
                trial.ms = ctx.timer.time(timed).ms
        except Exception as exc:                       # a config that does not compile is a result, not a crash
            trial.status = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            traceback.print_exc(limit=1)
    log(trial)
    return trial


def _sweep_chunk(ctx, x, ref, label: str, chunk: int, passes: tuple[str, ...], deadline: float,
                 log: Callable[[Trial], None]) -> list[Trial]:
    launch, _ = prepare_kda_prefill(*x.args(), chunk_size=chunk)
    trials: list[Trial] = []

    def attempt(kind: str, config: KernelConfig | None, run, timed, skip: str = "") -> None:
        trial = Trial(label, kind, _config_dict(kind, config) if config else {}, chunk=chunk)
        trials.append(_attempt(ctx, x, ref, trial, deadline, run, timed, log, skip))

    # the whole op as callers see it: cu_seqlens and slot_ids on the device (one sync to read them), and on the
    # host (no sync before planning: the engine knows both)
    for kind, args in (("whole op", x.args()), ("whole op, host metadata", x.host_args())):
        def whole(args=args):
            return kda_prefill(*args, chunk_size=chunk)

        def poisoned_whole(whole=whole) -> torch.Tensor:
            x.state.fill_(float("nan"))
            poison_allocator(ctx.device, x.v.numel() * x.v.element_size())
            return whole().output

        attempt(kind, None, poisoned_whole, whole)

    def poisoned(workspace: bool, *steps: Callable[[], object]) -> torch.Tensor:
        _poison(launch, workspace)
        for step in steps:
            step()
        return launch.output

    intra_grid, state_grid = _configs(ctx.smoke)
    for config in [kernel_config("kda_intra")] + (intra_grid if "intra" in passes else []):
        attempt("intra", config, lambda c=config: poisoned(True, lambda: launch.intra(c), launch.state),
                lambda c=config: launch.intra(c))
    launch.intra()                                     # the table config's workspace for the state sweep
    for config in [launch.state_config()] + (state_grid if "state" in passes else []):
        attempt("state", config, lambda c=config: poisoned(False, lambda: launch.state(c)),
                lambda c=config: launch.state(c), _state_skip(config, chunk))
    return trials


def _state_skip(config: KernelConfig, chunk: int) -> str:
    """Why a state config is not tried at this chunk size ('' when it is): the prefetching narrow form past
    32-token chunks gave wrong outputs and illegal memory accesses on the H200 (an illegal access takes the CUDA
    context, and the rest of the sweep, down), and kda_prefill never runs it there (`prefetch_unchecked`)."""
    if prefetch_unchecked(config, chunk):
        return f"prefetch with block_v <= 32 at {chunk}-token chunks (wrong on the H200: kda_prefill)"
    return ""


def summary(trials: list[Trial]) -> list[dict]:
    """One row per (shape, chunk size); fla's time (one per shape) repeated on each."""
    rows = []
    for shape, chunk in dict.fromkeys((t.shape, t.chunk) for t in trials if t.kernel != "fla"):
        mine = [t for t in trials if t.shape == shape and t.chunk == chunk]
        fla = next((t for t in trials if t.shape == shape and t.kernel == "fla"), None)

        def first(kind: str) -> Trial | None:
            return next((t for t in mine if t.kernel == kind), None)

        def best(kind: str) -> Trial | None:
            timed = [t for t in mine if t.kernel == kind and t.ms is not None]
            return min(timed, key=lambda t: t.ms) if timed else None

        row = {"shape": shape, "chunk": chunk, "whole_ms": getattr(first("whole op"), "ms", None),
               "whole_host_ms": getattr(first("whole op, host metadata"), "ms", None),
               "fla_ms": getattr(fla, "ms", None),
               "intra_default_ms": getattr(first("intra"), "ms", None),
               "state_default_ms": getattr(first("state"), "ms", None),
               "intra_best": dataclasses.asdict(best("intra")) if best("intra") else None,
               "state_best": dataclasses.asdict(best("state")) if best("state") else None}
        if row["intra_best"] and row["state_best"]:
            row["best_sum_ms"] = row["intra_best"]["ms"] + row["state_best"]["ms"]
        rows.append(row)
    return rows


def _ms(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def markdown(rows: list[dict], trials: list[Trial], env: dict) -> str:
    shape_text = (f"{SMOKE_HEADS} heads, K = V = {SMOKE_HEAD_DIM}, float32 (smoke)" if env.get("smoke") == "True"
                  else f"{HEADS} heads, K = V = {HEAD_DIM}, bf16 inputs, float32 state")
    lines = [f"# KDA prefill: time per pass and launch-config sweep ({env.get('device')})", "",
             f"torch {env.get('torch')}, triton {env.get('triton')}, fla {env.get('fla')}, commit "
             f"{env.get('commit')}, {env.get('date')}. {shape_text}; every timed config passed the float64 "
             "check first.", "",
             "| shape | chunk | whole op ms | same, host metadata | fla ms | intra ms (table) | state ms (table) | "
             "best intra | best state | best sum ms | fla / best sum |", "|---" * 11 + "|"]
    for r in rows:
        ib, sb = r["intra_best"], r["state_best"]
        ratio = (f"{r['fla_ms'] / r['best_sum_ms']:.2f}x" if r.get("best_sum_ms") and r["fla_ms"] else "-")
        lines.append(f"| {r['shape']} | {r['chunk']} | {_ms(r['whole_ms'])} | {_ms(r.get('whole_host_ms'))} | "
                     f"{_ms(r['fla_ms'])} | "
                     f"{_ms(r['intra_default_ms'])} | "
                     f"{_ms(r['state_default_ms'])} | {_ms(ib and ib['ms'])} {ib and ib['config']} | "
                     f"{_ms(sb and sb['ms'])} {sb and sb['config']} | {_ms(r.get('best_sum_ms'))} | {ratio} |")
    lines += ["", "Every trial (the first intra and state rows of a shape are the table configs):", "",
              "| shape | chunk | kernel | config | ms | worst rel err | status |", "|---|---|---|---|---|---|---|"]
    for t in trials:
        error = "-" if t.error is None else f"{t.error:.1e}"
        lines.append(f"| {t.shape} | {t.chunk or '-'} | {t.kernel} | {t.config} | {_ms(t.ms)} | {error} | {t.status} |")
    return "\n".join(lines) + "\n"


def run(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes and grid")
    parser.add_argument("--out", default=None)
    parser.add_argument("--budget-s", type=float, default=TIME_BUDGET_S,
                        help="sweep seconds, shared evenly by the shapes (their set-up is not counted)")
    parser.add_argument("--chunk-sizes", default=None, help="tokens per chunk to compare, e.g. 64,32 (default: "
                        "the table's, then 64, or 32 when the table's is 64)")
    parser.add_argument("--passes", default=",".join(PASSES), help="which passes to sweep (both are always timed "
                        "with the table configs)")
    args = parser.parse_args(argv)
    passes = tuple(p for p in args.passes.split(",") if p)
    if any(p not in PASSES for p in passes):
        raise SystemExit(f"--passes {args.passes!r}: choose from {', '.join(PASSES)}")
    table_chunk = kernel_config("kda_intra").block_t
    chunk_sizes = tuple(int(c) for c in args.chunk_sizes.split(",")) if args.chunk_sizes else (
        (table_chunk, 16) if args.smoke else (table_chunk, 64 if table_chunk != 64 else 32))
    require_interpreter(args.smoke, "tools.tune.tune_prefill")
    started = time.perf_counter()
    ctx = make_context(args.smoke)
    ctx.timer = sweep_timer(ctx.device)
    heads, dim = (SMOKE_HEADS, SMOKE_HEAD_DIM) if args.smoke else (HEADS, HEAD_DIM)
    shapes = SMOKE_PREFILL_SHAPES if args.smoke else SHAPES
    out_dir = results_dir(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment(ctx.device, args.smoke)
    stem = f"tune-prefill-{'smoke' if args.smoke else env.get('device_slug', 'gpu')}"
    trials: list[Trial] = []

    def log(t: Trial) -> None:
        print(f"{time.perf_counter() - started:5.0f}s {t.shape:>14} c{t.chunk:<3} {t.kernel:>8} {str(t.config):60} "
              f"{_ms(t.ms):>8} ms  {t.status[:100]}", flush=True)

    def write() -> list[dict]:
        rows = summary(trials)
        (out_dir / f"{stem}.json").write_text(json.dumps({"environment": env, "summary": rows,
                                                          "trials": [dataclasses.asdict(t) for t in trials]},
                                                         indent=1))
        (out_dir / f"{stem}.md").write_text(markdown(rows, trials, env))
        return rows

    with torch.inference_mode():
        for label, lengths in shapes:
            trials += sweep_shape(ctx, label, lengths, heads, dim, args.budget_s / len(shapes), passes,
                                  chunk_sizes, log)
            write()
    rows = write()
    print(f"\nwrote {out_dir / stem}.json and .md ({time.perf_counter() - started:.0f} s)")
    print(markdown(rows, [], env).split("Every trial")[0])
    return rows


def main(argv: list[str] | None = None) -> int:
    rows = run(argv)
    return 0 if all(r["intra_best"] and r["state_best"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Sweep the launch parameters of the Triton MoE expert GEMMs (kernels/triton/moe_experts.py, `moe_gemm_config`).

    python -m tools.tune.tune_moe [--out DIR]                  # on an H200: two shapes, about 3 minutes at most
    TRITON_INTERPRET=1 python -m tools.tune.tune_moe --smoke   # tiny grid on the CPU: checks the plumbing only

Shapes: K3 at TP8, one rank holding 112 experts, top-16, latent 3584, expert width 3072, SiTU-GLU, bf16; prefill
(1024 tokens = 16384 routed rows) and decode (64 tokens = 1024 rows). block_m (the row block both GEMMs share, so
one row layout) is swept on the outside; for each block_m the gate/up GEMM (GLU fused) and the down GEMM are swept
on their own over GemmConfig: (block_n, block_k, num_warps, num_stages), the two-half row tiles (sub_blocks),
weight tiles through descriptors (weight_desc) and, for gate/up only, one dot over the gate and up columns together
(fused_gate_up). The kernels have no program-order swizzle (GROUP_M):
programs of one expert's row blocks are already adjacent in launch order, so they share its weight tile in L2.

Every config first runs once on NaN-poisoned memory and is checked against a float32 torch reference of that GEMM
on the same bf16 inputs (every routed row, relative L2 error); only a config that compiled and passed is timed
(`bench.timing`, do_bench median). A config that fails to compile or to match is listed with its reason. The best
block_m is the one whose two best GEMMs sum to the least time. Configs past the time budget are listed as skipped.
Results: tune_moe-<device>.json and .md in --out (else $OUT, else bench/results); the end of the output prints, per
shape, the winner, the current default and the line to paste into `_MOE_GEMM_NVIDIA` in kernels/triton/tuning_ops.py.
"""
from __future__ import annotations

import argparse
import importlib
import itertools
import json
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bench.context import (
    BF16_OUTPUT_TOL,
    FP32_STATE_TOL,
    BenchContext,
    load,
    make_context,
    require_interpreter,
    results_dir,
)
from bench.report import check, environment, poison_allocator

EXPERTS, TOP_K, LATENT, WIDTH = 112, 16, 3584, 3072
SHAPES = {"prefill": 1024, "decode": 64}                      # tokens; routed rows = tokens * TOP_K
SMOKE = {"experts": 5, "top_k": 2, "latent": 32, "width": 16, "shapes": {"prefill": 24, "decode": 3}}
SITU_BETA, SITU_LINEAR_BETA = 4.0, 25.0
BUDGET_S = 150.0     # trials only; start-up, references, whole-op timings and output fit in the rest of 180 s
# gate/up stores bf16 (one output rounding over float32 accumulation of exact bf16 products); down stores float32
# (only the summation order differs from the float32 reference on the same bf16 hidden values)
GATE_UP_TOL, DOWN_TOL = BF16_OUTPUT_TOL, FP32_STATE_TOL
OUTPUT_TOL = 2e-2    # whole op: the bf16 hidden may round differently from the reference's, then the output rounds
RESERVE_S = 30.0     # kept for each later shape: they reuse the compiled kernels, so they mostly just time

BLOCK_MS = (16, 32, 64, 128, 192)                 # 192 only as three 64-row sub-blocks
# (block_n, block_k, num_warps, num_stages, sub_blocks, weight_desc, fused_gate_up): GemmConfig's fields, most
# plausible first (a budget cut loses the least likely configs). The two-half tiles (sub_blocks 2) first: a scratch
# sweep at 1f768cd had them ahead at block_m 128. The fused gate/up tiles (gate/up only) next:
# offline sm_90 compiles give one m64n128 wgmma per sub-block and K step at block_n 64 where the two-dot form issues
# two m64n64 (m64n256 at block_n 128 when a warp group owns 64 whole rows); on the H200 128 + 128 columns on 8 warps
# in two halves won (bench/results/archive/tune_moe-fused-nvidia-h200.md) and is the table's tile since.
TILES = ((64, 64, 4, 3, 2, True, False), (64, 64, 4, 3, 2, True, True), (128, 64, 8, 3, 1, True, True),
         (128, 64, 8, 3, 2, True, True), (128, 64, 4, 3, 1, True, True), (64, 64, 8, 3, 1, True, True),
         (64, 64, 4, 3, 2, False, True), (128, 64, 8, 3, 1, False, True),
         (128, 64, 8, 4, 2, False, False), (128, 64, 8, 3, 2, True, False), (64, 64, 4, 3, 2, False, False),
         (128, 64, 8, 3, 2, False, False), (256, 64, 8, 3, 2, False, False), (256, 64, 8, 3, 2, True, False),
         (128, 32, 8, 4, 2, True, False), (128, 64, 4, 3, 2, True, False), (128, 128, 8, 3, 2, False, False),
         (256, 64, 8, 3, 1, False, False), (256, 64, 8, 3, 1, True, False), (128, 64, 8, 3, 1, True, False),
         (128, 64, 8, 3, 1, False, False), (128, 64, 4, 3, 1, False, False), (128, 64, 4, 4, 1, False, False),
         (64, 64, 4, 4, 1, False, False), (64, 128, 4, 3, 1, False, False), (128, 128, 8, 3, 1, False, False),
         (128, 32, 4, 5, 1, False, False),
         # three 64-row sub-blocks (block_m 192): ~146 rows per expert at K3 prefill fit one row block,
         # so each expert's weights are read once per column block where 128-row blocks read them twice, at the MMA
         # cost of the 192 rows the two-half 128-row blocks compute. Gate/up fused, then down tiles.
         (64, 64, 8, 3, 3, True, True), (64, 64, 16, 3, 3, True, True), (128, 64, 16, 3, 3, True, True),
         (64, 64, 8, 4, 3, True, True), (128, 64, 8, 3, 3, True, False), (128, 64, 16, 3, 3, True, False),
         (256, 64, 16, 3, 3, True, False), (128, 64, 8, 4, 3, True, False), (64, 64, 8, 3, 3, True, False),
         (128, 64, 16, 4, 3, True, True), (128, 32, 16, 4, 3, True, True), (128, 64, 16, 2, 3, True, True),
         (128, 32, 16, 3, 3, True, True), (256, 64, 16, 4, 3, True, False), (256, 32, 16, 4, 3, True, False),
         (256, 64, 16, 2, 3, True, False), (256, 32, 16, 3, 3, True, False))
WIDE_TILES = tuple(itertools.product((64, 128, 256), (32, 64, 128), (4, 8), (3, 4, 5), (1, 2), (False, True),
                                     (False, True)))
SMOKE_BLOCK_MS = (16, 32)
SMOKE_TILES = ((16, 16, 1, 1, 1, False, False), (32, 16, 1, 1, 1, False, False), (16, 16, 1, 1, 2, True, False),
               (32, 16, 1, 1, 1, True, True))
SHARED_MEMORY_BYTES = 232448                                      # sm90 opt-in limit per block, when torch does not say
MAX_ACCUMULATOR_REGS = 128                                        # float32 accumulators per thread before spilling


@dataclass
class Trial:
    gemm: str                      # "gate_up" or "down"
    block_m: int
    tile: tuple                    # GemmConfig's fields
    status: str                    # "ok", "wrong", "error", "skipped"
    ms: float | None = None
    error: float | None = None     # relative L2 error against the reference
    reason: str = ""


@dataclass
class ShapeResult:
    name: str
    tokens: int
    rows: int
    row_class: str
    default: dict
    trials: list[Trial] = field(default_factory=list)
    best: dict | None = None       # {"block_m", "gate_up": tile, "down": tile, "ms"}
    default_ms: float | None = None
    whole_ms: dict[str, float] = field(default_factory=dict)   # whole ops (sort + GEMMs + combine) by label
    grouped_mm_ms: float | None = None          # the two plain torch._grouped_mm GEMMs (the floor), None off sm90
    notes: list[str] = field(default_factory=list)


def _tile(config) -> tuple:
    return tuple(config)


def _sub_block_reason(block_m: int, tile: tuple) -> str:
    rows = block_m // tile[4]                                     # tile[4]: sub_blocks
    if rows < 16:
        return f"sub-blocks of {rows} rows (the dot's smallest tile is 16)"
    if block_m % tile[4] or rows & (rows - 1):
        return f"{block_m} rows do not split into {tile[4]} sub-blocks of a power of two"
    return ""


def fits(gemm: str, block_m: int, tile: tuple, shared_bytes: int, element_size: int) -> str:
    """'' when the config can run, else why not (skipped without compiling; the compiler would refuse or spill)."""
    block_n, block_k, warps, stages = tile[:4]
    if halves := _sub_block_reason(block_m, tile):
        return halves
    # gate/up loads both halves of W13 per K step and keeps two accumulators of block_n columns per sub-block; fused
    # (tile[6]) it is one weight tile and one accumulator of 2 * block_n columns: the same bytes and registers
    weight_tiles = 2 if gemm == "gate_up" else 1
    smem = stages * (block_m * block_k + weight_tiles * block_k * block_n) * element_size
    if smem > shared_bytes:
        return f"needs {smem} bytes of shared memory, the device has {shared_bytes}"
    regs = weight_tiles * block_m * block_n // (32 * warps)
    if regs > MAX_ACCUMULATOR_REGS:
        return f"{regs} float32 accumulators per thread would spill (limit {MAX_ACCUMULATOR_REGS})"
    return ""


class Problem:
    """One shape: routed inputs, the per-pair float32 references of both GEMMs, and the kernels to call."""

    def __init__(self, ctx: BenchContext, experts: int, top_k: int, latent: int, width: int, tokens: int):
        self.ctx, self.experts, self.top_k, self.tokens = ctx, experts, top_k, tokens
        self.x = ctx.randn(tokens, latent)                                              # [T, D]
        self.w13 = ctx.randn(experts, 2 * width, latent, scale=latent ** -0.5)          # [E, 2I, D]
        self.w2 = ctx.randn(experts, latent, width, scale=width ** -0.5)                # [E, D, I]
        route = load("kernels.torch.moe:moe_route")(ctx.randn(tokens, experts, dtype=torch.float32), None, top_k,
                                                      "sigmoid", True, 1.0)
        self.weights, self.expert_ids = route.weights, route.expert_ids                 # [T, k]
        self.down_inputs: dict[int, torch.Tensor] = {}                                  # block_m -> [P_pad, I]
        glu = load("kernels.torch.activation:glu_activation")
        flat = self.expert_ids.reshape(-1)                                              # [P]
        token_of_pair = torch.arange(flat.numel(), device=ctx.device) // top_k
        self.ref_hidden = torch.empty(flat.numel(), width, dtype=torch.float32, device=ctx.device)   # [P, I]
        self.ref_down = torch.empty(flat.numel(), latent, dtype=torch.float32, device=ctx.device)    # [P, D]
        for expert in range(experts):
            pairs = (flat == expert).nonzero().flatten()
            hidden = self.x[token_of_pair[pairs]].float() @ self.w13[expert].float().T              # [n, 2I]
            self.ref_hidden[pairs] = glu(hidden, "situ", SITU_BETA, SITU_LINEAR_BETA)
            # the down GEMM is checked on its own, from the reference hidden rounded as the kernel stores it
            self.ref_down[pairs] = self.ref_hidden[pairs].to(ctx.dtype).float() @ self.w2[expert].float().T

    def blocks(self, block_m: int):
        group = load("kernels.triton.moe_experts:group_pairs_by_expert")
        return group(self.expert_ids, 0, self.experts, block_m)

    def gate_up_call(self, blocks, block_m: int, tile) -> Callable[[], torch.Tensor]:
        gate_up = load("kernels.triton.moe_experts:gate_up")
        return lambda: gate_up(self.x, self.w13, blocks, self.top_k, "situ", SITU_BETA, SITU_LINEAR_BETA, block_m,
                               tile)

    def down_call(self, blocks, block_m: int, tile) -> Callable[[], torch.Tensor]:
        down = load("kernels.triton.moe_experts:down")
        if block_m not in self.down_inputs:
            # reference hidden values in sorted rows, NaN in padding rows (which the kernel must not read)
            hidden = torch.full((blocks.sorted_pairs.numel(), self.ref_hidden.shape[1]), float("nan"),
                                dtype=self.ctx.dtype, device=self.ctx.device)            # [P_pad, I]
            hidden[blocks.row_of_pair] = self.ref_hidden.to(self.ctx.dtype)
            self.down_inputs[block_m] = hidden
        hidden = self.down_inputs[block_m]
        return lambda: down(hidden, self.w2, blocks, block_m, tile)

    def reference_output(self) -> torch.Tensor:
        """y[t] = sum_j weights[t, j] * down[t * k + j], in float32 from the per-pair references."""
        per_pair = self.ref_down.view(self.tokens, self.top_k, -1)                     # [T, k, D]
        return (per_pair * self.weights.float()[:, :, None]).sum(1)                    # [T, D]

    def check(self, gemm: str, out: torch.Tensor, blocks):
        ref = self.ref_hidden if gemm == "gate_up" else self.ref_down
        tolerance = self.ctx.tolerance(GATE_UP_TOL if gemm == "gate_up" else DOWN_TOL)
        return check(out[blocks.row_of_pair], ref, tolerance, f"{gemm}, all {ref.shape[0]} routed rows")


def _measure(ctx: BenchContext, problem: Problem, gemm: str, blocks, block_m: int, tile_values) -> Trial:
    tile_type = load("kernels.triton.tuning_ops:GemmConfig")
    tile = tile_type(*tile_values)
    trial = Trial(gemm, block_m, tuple(tile_values), "error")
    if tile.weight_desc:
        why = load("kernels.triton.moe_experts:weight_desc_unavailable")(
            ctx.device, problem.w13 if gemm == "gate_up" else problem.w2)
        if why:
            trial.status, trial.reason = "skipped", why
            return trial
    try:
        call = (problem.gate_up_call if gemm == "gate_up" else problem.down_call)(blocks, block_m, tile)
        # NaN in the freed block the output most likely reuses: a routed row left unwritten fails the check
        row_bytes = (problem.ref_hidden.shape[1] * problem.x.element_size() if gemm == "gate_up"
                     else problem.ref_down.shape[1] * 4)
        poison_allocator(ctx.device, blocks.sorted_pairs.numel() * row_bytes)
        result = problem.check(gemm, call(), blocks)
    except Exception as exc:  # noqa: BLE001  a config the compiler refuses (resources, tile shape) is a result, not a crash
        first_line = (str(exc).strip().splitlines() or [""])[0]
        trial.reason = f"{type(exc).__name__}: {first_line[:160]}"
        return trial
    trial.error = result.error
    if not result.ok:
        trial.status, trial.reason = "wrong", result.describe()
        return trial
    trial.status, trial.ms = "ok", ctx.timer.time(call).ms
    return trial


def _best_tiles(trials: list[Trial], block_m: int) -> dict[str, Trial]:
    best = {}
    for gemm in ("gate_up", "down"):
        timed = [t for t in trials if t.gemm == gemm and t.block_m == block_m and t.status == "ok"]
        if timed:
            best[gemm] = min(timed, key=lambda t: t.ms)
    return best


def tune_shape(ctx: BenchContext, name: str, dims: dict, tokens: int, block_ms, tiles, deadline: float) -> ShapeResult:
    tuning_ops = importlib.import_module("kernels.triton.tuning_ops")     # after TRITON_INTERPRET is checked
    rows = tokens * dims["top_k"]
    default = tuning_ops.moe_gemm_config(ctx.device, rows)
    row_class = "interpreter" if ctx.smoke else tuning_ops.shape_class(tuning_ops.MOE_GEMM_ROW_CLASSES, rows)
    result = ShapeResult(name, tokens, rows, row_class, {"block_m": default.block_m, "gate_up": _tile(default.gate_up),
                                                         "down": _tile(default.down)})
    problem = Problem(ctx, dims["experts"], dims["top_k"], dims["latent"], dims["width"], tokens)
    shared = SHARED_MEMORY_BYTES
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        shared = int(getattr(props, "shared_memory_per_block_optin", 0) or shared)
    # the current default first (always measured, unless it cannot compile), then the grid
    plan = [(default.block_m, gemm, _tile(getattr(default, gemm))) for gemm in ("gate_up", "down")]
    # tile-major: a budget cut drops the least plausible tiles (the end of the list) at every block_m; a fused
    # gate/up tile (tile[6]) has no down form
    plan += [(block_m, gemm, tile) for tile in tiles for block_m in block_ms for gemm in ("gate_up", "down")
             if (block_m, gemm, tuple(tile)) not in plan and not (gemm == "down" and tile[6])]
    blocks = {}
    for block_m, gemm, tile in plan:
        if time.monotonic() > deadline:
            result.trials.append(Trial(gemm, block_m, tuple(tile), "skipped", reason="time budget spent"))
            continue
        # smoke runs skip only what cannot compile anywhere (their tiny tiles fit any resources)
        why = (fits(gemm, block_m, tile, shared, problem.x.element_size()) if not ctx.smoke
               else _sub_block_reason(block_m, tile))
        if why:
            result.trials.append(Trial(gemm, block_m, tuple(tile), "skipped", reason=why))
            continue
        if block_m not in blocks:
            blocks[block_m] = problem.blocks(block_m)
        trial = _measure(ctx, problem, gemm, blocks[block_m], block_m, tile)
        result.trials.append(trial)
        print(f"  {name} {gemm:<7} block_m={block_m:<3} tile={tile}: {trial.status}"
              f"{f' {trial.ms:.4f} ms' if trial.ms is not None else ''}{f' ({trial.reason})' if trial.reason else ''}",
              flush=True)
    default_trials = {t.gemm: t for t in result.trials if t.status == "ok" and t.block_m == default.block_m
                    and t.tile == result.default[t.gemm]}
    if len(default_trials) == 2:
        result.default_ms = default_trials["gate_up"].ms + default_trials["down"].ms
    candidates = []
    for block_m in sorted({t.block_m for t in result.trials}):
        best = _best_tiles(result.trials, block_m)
        if len(best) == 2:
            candidates.append({"block_m": block_m, "gate_up": best["gate_up"].tile, "down": best["down"].tile,
                               "ms": best["gate_up"].ms + best["down"].ms})
    result.best = min(candidates, key=lambda c: c["ms"]) if candidates else None
    _time_surroundings(ctx, problem, result)
    return result


def _time_surroundings(ctx: BenchContext, problem: Problem, result: ShapeResult) -> None:
    """For scale, not part of the choice: the whole op with the current default, the torch._grouped_mm provider, and
    the plain grouped GEMMs. Each whole op is checked against the reference first and timed only if it passed."""
    ops = [("moe_experts (triton, current default)", "kernels.triton.moe_experts:moe_experts")]
    # torch runs _grouped_mm on the CPU too, so a smoke run checks the provider's plumbing; on a GPU it needs sm90
    grouped_mm = ctx.smoke or (ctx.device.type == "cuda" and torch.cuda.get_device_capability(ctx.device)[0] >= 9)
    if grouped_mm:
        ops.append(("grouped_mm provider", "backends.cuda.grouped_mm:moe_experts"))
    else:
        result.notes.append("torch._grouped_mm not timed: needs a CUDA device of compute capability 9.0+")
    expected = problem.reference_output()
    for label, target in ops:
        op = load(target)

        def whole(op=op):
            return op(problem.x, problem.w13, problem.w2, problem.weights, problem.expert_ids, "situ", SITU_BETA,
                      SITU_LINEAR_BETA)
        try:
            poison_allocator(ctx.device, problem.x.numel() * problem.x.element_size())
            found = check(whole(), expected, ctx.tolerance(OUTPUT_TOL), f"{label} output")
            if found.ok:
                result.whole_ms[label] = ctx.timer.time(whole).ms
            else:
                result.notes.append(f"{label} not timed: {found.describe()}")
        except Exception as exc:  # noqa: BLE001  reported in the notes
            result.notes.append(f"{label} not timed: {type(exc).__name__}: {str(exc)[:160]}")
    if not grouped_mm:
        return
    flat = problem.expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = problem.x[order // problem.top_k].contiguous()                                 # [P, D] sorted by expert
    offs = torch.searchsorted(flat[order], torch.arange(problem.experts, device=ctx.device), right=True)
    offs = offs.to(torch.int32)
    act = problem.ref_hidden[order].to(ctx.dtype)                                         # [P, I]
    up_ms = ctx.timer.time(lambda: torch._grouped_mm(rows, problem.w13.transpose(-2, -1), offs=offs)).ms
    down_ms = ctx.timer.time(lambda: torch._grouped_mm(act, problem.w2.transpose(-2, -1), offs=offs)).ms
    result.grouped_mm_ms = up_ms + down_ms


def paste_line(result: ShapeResult) -> str:
    best = result.best
    if best is None:
        return f"# {result.name}: no config passed"

    def gemm(values):
        extra = "".join(f", {name}={value}" for name, value, default in
                        zip(("sub_blocks", "weight_desc", "fused_gate_up"), values[4:], (1, False, False))
                        if value != default)
        return "GemmConfig(block_n={}, block_k={}, num_warps={}, num_stages={}".format(*values[:4]) + extra + ")"
    return (f'"{result.row_class}": MoeGemmConfig(block_m={best["block_m"]}, gate_up={gemm(best["gate_up"])}, '
            f'down={gemm(best["down"])}),')


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def summary(results: list[ShapeResult]) -> str:
    lines = []
    for r in results:
        ok = sum(t.status == "ok" for t in r.trials)
        lines.append(f"{r.name}: T={r.tokens}, {r.rows} routed rows, class '{r.row_class}'; {ok} of {len(r.trials)} "
                     f"configs timed")
        lines.append(f"  current default block_m={r.default['block_m']} gate_up={r.default['gate_up']} "
                     f"down={r.default['down']}: {_fmt(r.default_ms)} ms (2 GEMMs)")
        if r.best:
            gain = f", {r.default_ms / r.best['ms']:.2f}x the default" if r.default_ms else ""
            lines.append(f"  best block_m={r.best['block_m']} gate_up={r.best['gate_up']} down={r.best['down']}: "
                         f"{r.best['ms']:.4f} ms{gain}")
        lines += [f"  {label}, whole op: {ms:.4f} ms" for label, ms in r.whole_ms.items()]
        lines.append(f"  plain torch._grouped_mm, 2 GEMMs only: {_fmt(r.grouped_mm_ms)} ms")
        lines += [f"  note: {n}" for n in r.notes]
        lines.append(f"  paste: {paste_line(r)}")
    return "\n".join(lines)


def markdown(results: list[ShapeResult], env: dict) -> str:
    lines = [f"# MoE expert GEMM sweep ({env['device']})", "",
             f"torch {env['torch']}, triton {env['triton']}, commit {env['commit']}, {env['date']}.", "",
             "```", summary(results), "```", ""]
    for r in results:
        lines += [f"## {r.name} (T={r.tokens}, {r.rows} rows)", "",
                  "| gemm | block_m | block_n | block_k | warps | stages | sub_blocks | weight_desc | fused_gate_up | "
                  "status | ms | rel err | reason |", "|---" * 13 + "|"]
        for t in sorted(r.trials, key=lambda t: (t.gemm, t.block_m, t.ms if t.ms is not None else float("inf"))):
            err = "-" if t.error is None else f"{t.error:.1e}"
            lines.append(f"| {t.gemm} | {t.block_m} | {' | '.join(map(str, t.tile))} | {t.status} | {_fmt(t.ms)} | "
                         f"{err} | {t.reason[:120]} |")
        lines.append("")
    return "\n".join(lines)


def write(results: list[ShapeResult], env: dict, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"tune_moe-{env['device_slug']}"
    payload = {"environment": env, "shapes": [asdict(r) for r in results]}
    json_path, md_path = stem.with_suffix(".json"), stem.with_suffix(".md")
    json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    md_path.write_text(markdown(results, env))
    return json_path, md_path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.tune.tune_moe", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny grid on the CPU under TRITON_INTERPRET=1")
    parser.add_argument("--out", default="", help="results folder (default $OUT, else bench/results)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="stop timing new configs after this long")
    parser.add_argument("--wide", action="store_true", help=f"{len(WIDE_TILES)} tiles instead of {len(TILES)} "
                        f"(the fused ones for gate/up only; needs a larger --budget-s)")
    parser.add_argument("--only", default="", help=f"comma-separated shapes (default all): {', '.join(SHAPES)}")
    parser.add_argument("--block-ms", default="", help=f"comma-separated row blocks to sweep (default "
                        f"{','.join(map(str, BLOCK_MS))}; the current default's is always measured)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def run(argv: list[str] | None = None) -> list[ShapeResult]:
    args = parse_args(argv)
    start = time.monotonic()
    require_interpreter(args.smoke, "tools.tune.tune_moe")
    ctx = make_context(args.smoke, args.seed)
    full = {"experts": EXPERTS, "top_k": TOP_K, "latent": LATENT, "width": WIDTH, "shapes": SHAPES}
    dims = SMOKE if args.smoke else full
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(dims["shapes"])
    unknown = [n for n in names if n not in dims["shapes"]]
    if unknown:
        raise SystemExit(f"unknown shape(s) {', '.join(unknown)}; choose from: {', '.join(dims['shapes'])}")
    block_ms, tiles = (SMOKE_BLOCK_MS, SMOKE_TILES) if args.smoke else (BLOCK_MS, WIDE_TILES if args.wide else TILES)
    if args.block_ms:
        try:
            block_ms = tuple(int(v) for v in args.block_ms.split(",") if v.strip())
        except ValueError:
            raise SystemExit(f"--block-ms takes comma-separated integers, got {args.block_ms!r}") from None
        if not block_ms or any(b < 16 or b % 16 for b in block_ms):
            raise SystemExit(f"--block-ms: multiples of 16 (the dot's smallest row tile; a tile's sub-blocks must "
                             f"split them into powers of two), got {args.block_ms!r}")
    out_dir = results_dir(args.out)
    env = environment(ctx.device, args.smoke)
    print(f"k3core MoE GEMM sweep: {env['device']}, torch {env['torch']}, triton {env['triton']}, "
          f"commit {env['commit']}, budget {args.budget_s:.0f} s", flush=True)
    results = []
    with torch.inference_mode():
        for i, name in enumerate(names):
            deadline = start + args.budget_s - RESERVE_S * (len(names) - 1 - i)
            try:
                results.append(tune_shape(ctx, name, dims, dims["shapes"][name], block_ms, tiles, deadline))
            except Exception as exc:  # noqa: BLE001  the other shape's results still count
                failed = ShapeResult(name, dims["shapes"][name], dims["shapes"][name] * dims["top_k"], "-", {})
                failed.notes.append(f"shape raised: {traceback.format_exc(limit=3)[-600:]}")
                print(f"{name} raised {type(exc).__name__}: {exc}", flush=True)
                results.append(failed)
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
            write(results, env, out_dir)
    json_path, md_path = write(results, env, out_dir)
    print(f"wrote {json_path} and {md_path} after {time.monotonic() - start:.0f} s")
    print(summary(results))
    return results


def main(argv: list[str] | None = None) -> int:
    results = run(argv)
    return 0 if all(r.best is not None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Tuning sweep of MLA decode and KDA decode on K3's per-GPU shapes: one device call, then paste the winners.

    python -m tools.tune.tune_decode                       # both ops on the GPU -> $OUT (else bench/results)
    python -m tools.tune.tune_decode --only kda
    TRITON_INTERPRET=1 python -m tools.tune.tune_decode --smoke   # tiny grid on the CPU: checks the plumbing only

Every config is first run once and checked against the float64 torch reference (NaN-poisoned outputs); a config
that fails is marked "wrong" and never timed, one that does not compile (OutOfResources, ...) is marked "error".
The rest are timed like bench/kernels.py times decode: one CUDA graph of >= 8 calls cycling through rotated input
sets (>= 3x L2), do_bench median, but with a shorter do_bench budget so the whole sweep (compiles included) stays
under ~4 minutes. Past the time budget the remaining configs are recorded as "skipped". MLA is searched in three
rounds (tile shapes at two programs per SM, then the split multiplier and policy for the three best tiles and the
table's own tiles, then the LSE merges on the three best configs); KDA's grid is small enough to run whole.
Results: tune-decode-<device>.json and .md, with the line to paste per shape class into kernels/triton/tuning_ops.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

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
from bench.timing import measure_ceilings, num_input_sets, sweep_timer
from tools.tune.tune_decode_report import config_source, describe, label, ranked, summary, write
from k3core.ops import KdaGateParams
from kernels.triton.tuning_ops import (
    KDA_DECODE_BATCH_CLASSES,
    MLA_DECODE_BATCH_CLASSES,
    KdaDecodeConfig,
    MlaDecodeConfig,
    kda_decode_config,
    mla_decode_config,
    shape_class,
)

OPS = ("mla", "kda")
TIME_BUDGET_S = 270.0            # the whole sweep after imports (`scripts/gpu.sh tune decode` allows 330 s)
KDA_SHARE = 0.25                 # KDA's share of the budget when both ops run (its grid is small)

MLA_HEADS, MLA_LATENT, MLA_V_DIM, MLA_PAGE = 12, 576, 512, 64
MLA_SCALE = 192 ** -0.5
MLA_SHAPES = ((64, 8192), (1, 131072), (8, 32768))
MLA_REF_REQUESTS = 4             # the float64 reference runs on the first requests of set 0
KDA_HEADS, KDA_DIM, KDA_LOWER_BOUND = 12, 128, -5.0
KDA_BATCHES = (16, 64, 256, 1024)


@dataclass(frozen=True)
class Grid:
    """What the sweep tries (the GPU grid and the --smoke grid differ only in size)."""
    mla_shapes: tuple[tuple[int, int], ...]
    mla_heads: int
    mla_latent: int
    mla_v_dim: int
    mla_page: int
    mla_tiles: tuple[str, ...]
    mla_block_n: tuple[int, ...]
    mla_warps: tuple[int, ...]
    mla_stages: tuple[int, ...]
    mla_programs_per_unit: tuple[int, ...]
    mla_split_policies: tuple[str, ...]
    mla_merges: tuple[tuple[int, int], ...]          # (merge_splits, merge_block_v)
    kda_batches: tuple[int, ...]
    kda_heads: int
    kda_dim: int
    kda_block_v: tuple[int, ...]
    kda_warps: tuple[int, ...]


# The first decode sweeps (bench/results/archive/tune-decode-nvidia-h200.md) never picked "gather" tiles, one
# pipeline stage, 4 stages, block_v 64/128 or 4-8 warps for KDA; this grid leaves them out to make room for the
# "waves" split policy, wider LSE merge steps over narrower value blocks (the B=1 x 128K shape merges 256 splits) and
# block_v 4. KDA decode with programmatic dependent launch (waiting on the previous kernel before its first load)
# gained nothing beyond noise (bench/results/archive/tune-decode-merge-nvidia-h200.md) and was removed.
GPU_GRID = Grid(MLA_SHAPES, MLA_HEADS, MLA_LATENT, MLA_V_DIM, MLA_PAGE, ("page",), (32, 64), (4, 8), (2, 3),
                (1, 2, 4), ("cover", "waves"),
                ((1, 0), (16, 128), (32, 64), (64, 32), (128, 32), (64, 16), (256, 16), (128, 16)),
                KDA_BATCHES, KDA_HEADS, KDA_DIM, (4, 8, 16), (1, 2))
SMOKE_GRID = Grid(((2, 37), (1, 50)), 4, 48, 32, 16, ("page", "gather"), (16,), (1,), (1,), (1, 2),
                  ("cover", "waves"), ((1, 0), (2, 16)), (1, 3), 2, 16, (4, 16), (1,))
ROUND1_PROGRAMS_PER_UNIT, ROUND1_MERGE = 2, (8, 128)
ROUND2_KEEP = 3
ROUND3_KEEP = 3                  # the merge round tries every merge on this many of the best configs so far


@dataclass
class Trial:
    op: str
    shape: str
    shape_class: str
    config: dict
    round: str                   # "default", "tiles", "splits", "merge", "all"
    status: str = "ok"           # "ok", "wrong: ...", "error: ...", "skipped: ..."
    ms: float | None = None
    tbps: float | None = None
    pct_copy: float | None = None
    timing: str = ""


class Sweep:
    """Runs trials until the deadline and keeps them all, printing one line per trial."""

    def __init__(self, ctx: BenchContext, copy_tbps: float, started: float):
        self.ctx, self.copy_tbps, self.started = ctx, copy_tbps, started
        self.trials: list[Trial] = []
        # GiB-sized caches are drawn on the device: the CPU generator of BenchContext.randn would take seconds of the
        # budget (the sweep compares configs on the same inputs; it need not reproduce bench/kernels.py's values)
        self.generator = torch.Generator(device=ctx.device).manual_seed(0)

    def randn(self, *shape: int, scale: float = 1.0, dtype: torch.dtype | None = None) -> torch.Tensor:
        values = torch.randn(*shape, generator=self.generator, dtype=torch.float32, device=self.ctx.device)
        return (values * scale).to(dtype or self.ctx.dtype)

    def run(self, trial: Trial, deadline: float, num_bytes: float, call_for: Callable[[], list[Callable]],
            verify: Callable[[Callable], str]) -> Trial:
        """verify(first call) returns '' when the output matched the reference, else what was wrong."""
        if time.perf_counter() > deadline:
            trial.status = "skipped: time budget spent"
        else:
            try:
                calls = call_for()
                wrong = verify(calls[0])
                if wrong:
                    trial.status = f"wrong: {wrong}"
                else:
                    timing = self.ctx.timer.time_graph(calls)
                    trial.ms, trial.timing = timing.ms, timing.method
                    trial.tbps = num_bytes / (timing.ms * 1e-3) / 1e12
                    trial.pct_copy = 100.0 * trial.tbps / self.copy_tbps
            except Exception as exc:  # noqa: BLE001  (OutOfResources etc. are results of the sweep)
                trial.status = f"error: {type(exc).__name__}: {str(exc)[:160]}"
                if self.ctx.device.type == "cuda":
                    torch.cuda.synchronize(self.ctx.device)
        self.trials.append(trial)
        speed = (f"{trial.ms:.4f} ms {trial.tbps:.2f} TB/s {trial.pct_copy:5.1f}% copy" if trial.ms is not None
                 else trial.status)
        print(f"[{time.perf_counter() - self.started:6.1f}s] {trial.op} {trial.shape} {trial.round:8s} "
              f"{label(trial.config)}: {speed}", flush=True)
        return trial


def _out_of_time(sweep: Sweep, deadline: float, op: str, shape: str, klass: str) -> bool:
    """Past the deadline a shape's inputs are not even built: one skipped trial says so."""
    if time.perf_counter() <= deadline:
        return False
    sweep.trials.append(Trial(op, shape, klass, {}, "all", status="skipped: time budget spent"))
    print(f"{op} {shape}: skipped (time budget spent)", flush=True)
    return True


def _verdict(checks) -> str:
    return "; ".join(c.describe() for c in checks if not c.ok)


# ----------------------------------------------------------------------------------------------------- MLA decode
def sweep_mla(sweep: Sweep, grid: Grid, deadline: float) -> None:
    for batch, seq_len in grid.mla_shapes:
        _sweep_mla_shape(sweep, grid, deadline, batch, seq_len)
        if sweep.ctx.device.type == "cuda":
            torch.cuda.empty_cache()


def _sweep_mla_shape(sweep: Sweep, grid: Grid, deadline: float, batch: int, seq_len: int) -> None:
    ctx = sweep.ctx
    shape, klass = f"B={batch} L={seq_len}", shape_class(MLA_DECODE_BATCH_CLASSES, batch)
    if _out_of_time(sweep, deadline, "mla_decode", shape, klass):
        return
    kernel = load("kernels.triton.mla_decode:mla_decode")      # looked up per shape: tests patch the module
    reference = load("kernels.torch.mla:mla_decode")
    latent, v_dim, page = grid.mla_latent, grid.mla_v_dim, grid.mla_page
    scale = MLA_SCALE if not ctx.smoke else latent ** -0.5
    pages_per_seq = -(-seq_len // page)
    kv_bytes = batch * seq_len * latent * ctx.dtype.itemsize
    num_sets = num_input_sets(kv_bytes, ctx.device, ctx.smoke)
    num_pages = num_sets * batch * pages_per_seq + 5
    kv_cache = sweep.randn(num_pages, page, latent)                            # [pages, page, D_latent]
    order = torch.randperm(num_pages, generator=ctx.generator)[:num_sets * batch * pages_per_seq]
    tables = order.view(num_sets, batch, pages_per_seq).to(device=ctx.device, dtype=torch.int32)  # scattered
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=ctx.device)
    queries = [sweep.randn(batch, grid.mla_heads, latent) for _ in range(num_sets)]   # [B, H, D_latent]
    checked = batch if ctx.smoke else min(batch, MLA_REF_REQUESTS)
    ref = reference(queries[0][:checked].double(), kv_cache, tables[0][:checked], seq_lens[:checked], scale,
                    v_dim)

    def verify(call):
        poison_allocator(ctx.device, batch * grid.mla_heads * v_dim * 4 * 4)
        result = call()
        tol = ctx.tolerance(BF16_OUTPUT_TOL)
        return _verdict([check(result.output[:checked], ref.output, tol, "output", full=result.output),
                         check(result.lse[:checked], ref.lse, ctx.tolerance(FP32_STATE_TOL), "lse",
                               full=result.lse)])

    def attempt(config: MlaDecodeConfig, round_name: str) -> Trial:
        def calls():
            return [lambda q=q, table=table: kernel(q, kv_cache, table, seq_lens, scale, v_dim, config)
                    for q, table in zip(queries, tables)]
        return sweep.run(Trial("mla_decode", shape, klass, config._asdict(), round_name), deadline, kv_bytes,
                         calls, verify)

    print(f"mla_decode {shape}: {num_sets} input set(s), {kv_bytes / 1e6:.0f} MB of KV per call", flush=True)
    attempt(mla_decode_config(ctx.device, grid.mla_heads, batch, page), "default")
    merge_splits, merge_block_v = ROUND1_MERGE
    tiles = [attempt(MlaDecodeConfig(16, block_n, warps, stages, ROUND1_PROGRAMS_PER_UNIT, variant, merge_splits,
                                     merge_block_v), "tiles")
             for variant, block_n, warps, stages in itertools.product(grid.mla_tiles, grid.mla_block_n,
                                                                      grid.mla_warps, grid.mla_stages)
             if variant == "gather" or page % block_n == 0]
    # round 2 takes the best tiles of round 1 and the tiles the table holds for every batch class: a tile that loses at
    # round 1's split count can win at another (B=64's table tile, one program per SM, was never tried on B=1 at 1)
    leaders = [MlaDecodeConfig(**t.config) for t in ranked(tiles)[:ROUND2_KEEP]]
    incumbents = [mla_decode_config(ctx.device, grid.mla_heads, first, page)._replace(
        programs_per_unit=ROUND1_PROGRAMS_PER_UNIT, merge_splits=ROUND1_MERGE[0], merge_block_v=ROUND1_MERGE[1],
        split_policy="cover") for first in _class_first_batches()]
    best_tiles = list(dict.fromkeys(leaders + incumbents))
    splits = [attempt(config._replace(programs_per_unit=programs, split_policy=policy), "splits")
              for config in best_tiles for programs in grid.mla_programs_per_unit
              for policy in grid.mla_split_policies
              if (programs, policy) != (ROUND1_PROGRAMS_PER_UNIT, config.split_policy)]
    # the merge's cost depends on the split count (B=1 x 128K: 0.101 ms with one split per step, 0.056 with 64), so
    # the merges are tried on several configs, not only on the one that won with the round-1 merge
    for trial in ranked(tiles + splits)[:ROUND3_KEEP]:
        leader = MlaDecodeConfig(**trial.config)
        for merge_splits, merge_block_v in grid.mla_merges:
            if (merge_splits, merge_block_v) != (leader.merge_splits, leader.merge_block_v):
                attempt(leader._replace(merge_splits=merge_splits, merge_block_v=merge_block_v), "merge")


def _class_first_batches() -> list[int]:
    """The smallest batch of every MLA decode batch class (1, 5, 33)."""
    firsts, previous = [], 0
    for bound, _ in MLA_DECODE_BATCH_CLASSES:
        firsts.append(previous + 1)
        previous = bound or previous
    return firsts


# ----------------------------------------------------------------------------------------------------- KDA decode
def sweep_kda(sweep: Sweep, grid: Grid, deadline: float) -> None:
    ctx = sweep.ctx
    gate = KdaGateParams(sweep.randn(grid.kda_heads, scale=0.5, dtype=torch.float32),
                         sweep.randn(grid.kda_heads * grid.kda_dim, scale=0.5, dtype=torch.float32), "lower_bound",
                         KDA_LOWER_BOUND)
    for num_seqs in grid.kda_batches:
        _sweep_kda_shape(sweep, grid, deadline, gate, num_seqs)
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()


def _sweep_kda_shape(sweep: Sweep, grid: Grid, deadline: float, gate: KdaGateParams, num_seqs: int) -> None:
    ctx = sweep.ctx
    shape, klass = f"N={num_seqs}", shape_class(KDA_DECODE_BATCH_CLASSES, num_seqs)
    if _out_of_time(sweep, deadline, "kda_decode", shape, klass):
        return
    kernel = load("kernels.triton.kda_decode:kda_decode")      # looked up per shape: tests patch the module
    reference = load("kernels.torch.kda:kda_decode")
    heads, dim = grid.kda_heads, grid.kda_dim
    scale = dim ** -0.5
    gate64 = gate._replace(A_log=gate.A_log.double(), dt_bias=gate.dt_bias.double())
    state_bytes = num_seqs * heads * dim * dim * 4 * 2                       # fp32 state read + written
    num_sets = num_input_sets(state_bytes, ctx.device, ctx.smoke)
    num_slots = num_sets * num_seqs + 3
    pool = sweep.randn(num_slots, heads, dim, dim, scale=0.05, dtype=torch.float32)   # [slots, H, V, K]
    saved = pool.clone()
    order = torch.randperm(num_slots, generator=ctx.generator)[:num_sets * num_seqs]
    slot_sets = order.view(num_sets, num_seqs).to(ctx.device)                # distinct slots in every set
    sets = [[sweep.randn(num_seqs, heads, dim) for _ in range(4)] + [sweep.randn(num_seqs, heads)]
            for _ in range(num_sets)]                                        # q, k, v, f [N, H, D], beta [N, H]
    expected_state = saved[slot_sets[0]].double()
    ref_out = reference(*(t.double() for t in sets[0]), gate64, expected_state,
                        torch.arange(num_seqs, device=ctx.device), scale)
    untouched = torch.ones(num_slots, dtype=torch.bool, device=ctx.device)
    untouched[slot_sets[0]] = False

    def verify(call):
        pool.copy_(saved)
        poison_allocator(ctx.device, num_seqs * heads * dim * 4)
        out = call()
        checks = [check(out, ref_out, ctx.tolerance(BF16_OUTPUT_TOL), "output"),
                  check(pool[slot_sets[0]], expected_state, ctx.tolerance(FP32_STATE_TOL), "addressed slots"),
                  check(pool[untouched], saved[untouched], 0.0, "other slots (must be untouched)")]
        pool.copy_(saved)
        return _verdict(checks)

    def attempt(config: KdaDecodeConfig, round_name: str) -> Trial:
        def calls():
            return [lambda s=s, slots=slots: kernel(*s[:4], s[4], gate, pool, slots, scale, config)
                    for s, slots in zip(sets, slot_sets)]
        return sweep.run(Trial("kda_decode", shape, klass, config._asdict(), round_name), deadline, state_bytes,
                         calls, verify)

    print(f"kda_decode {shape}: {num_sets} input set(s), {state_bytes / 1e6:.1f} MB of state traffic per call",
          flush=True)
    attempt(kda_decode_config(ctx.device, num_seqs), "default")
    for block_v, warps in itertools.product(grid.kda_block_v, grid.kda_warps):
        attempt(KdaDecodeConfig(block_v=block_v, num_warps=warps), "all")


def _parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    try:
        shapes = tuple((int(b), int(n)) for b, n in (item.lower().split("x") for item in text.split(",") if item))
    except ValueError:
        shapes = ()
    if not shapes or any(b < 1 or n < 1 for b, n in shapes):
        raise SystemExit(f"--mla-shapes {text!r}: give batch x context pairs such as 1x131072,64x8192")
    return shapes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.tune.tune_decode", description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="mla,kda", help=f"comma-separated ops: {', '.join(OPS)}")
    parser.add_argument("--smoke", action="store_true", help="tiny grid on the CPU under TRITON_INTERPRET=1")
    parser.add_argument("--out", default="", help="results folder (default $OUT, else bench/results)")
    parser.add_argument("--budget-s", type=float, default=TIME_BUDGET_S, help="stop starting trials after this")
    parser.add_argument("--mla-shapes", default="", help="MLA shapes to sweep as BxL,... (default: all of the grid's)")
    return parser.parse_args(argv)


def run(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    ops = [op.strip() for op in args.only.split(",") if op.strip()]
    if not ops or any(op not in OPS for op in ops):
        raise SystemExit(f"--only {args.only!r}: choose from {', '.join(OPS)}")
    require_interpreter(args.smoke, "tools.tune.tune_decode")
    started = time.perf_counter()
    ctx = make_context(args.smoke)
    ctx.timer = sweep_timer(ctx.device)
    grid = SMOKE_GRID if args.smoke else GPU_GRID
    if args.mla_shapes:
        grid = dataclasses.replace(grid, mla_shapes=_parse_shapes(args.mla_shapes))
    out_dir = results_dir(args.out)
    env = environment(ctx.device, args.smoke)
    with torch.inference_mode():
        copy_tbps = measure_ceilings(ctx.timer, ctx.dtype, args.smoke).copy_tbps
        print(f"decode tuning sweep on {env['device']}: copy {copy_tbps:.2f} TB/s, budget {args.budget_s:.0f} s",
              flush=True)
        sweep = Sweep(ctx, copy_tbps, started)
        end = started + args.budget_s
        if "kda" in ops:
            kda_end = started + KDA_SHARE * args.budget_s if "mla" in ops else end
            sweep_kda(sweep, grid, kda_end)
            write(out_dir, sweep.trials, env, copy_tbps)                # a timeout later still leaves these
        if "mla" in ops:
            sweep_mla(sweep, grid, end)
    json_path, md_path = write(out_dir, sweep.trials, env, copy_tbps)
    rows = summary(sweep.trials)
    print(f"\nwrote {json_path} and {md_path} ({time.perf_counter() - started:.0f} s)")
    for row in rows:
        best = row["best"]
        print(f"{row['op']} {row['shape']} [{row['shape_class']}]: default {describe(row['default'])}; best "
              f"{describe(best)}" + (f" with {config_source(row['op'], best['config'])}" if best else ""))
    return rows


def main(argv: list[str] | None = None) -> int:
    rows = run(argv)
    return 0 if all(row["best"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

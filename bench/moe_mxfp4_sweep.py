"""Checked sweep of the MXFP4 expert kernels' tiles at K3's per-GPU shapes, against the bf16 Triton experts.

    python -m bench.moe_mxfp4_sweep --out /tmp/out                         # on the GPU (bash scripts/gpu.sh mxfp4)
    TRITON_INTERPRET=1 python -m bench.moe_mxfp4_sweep --smoke --out /tmp/x  # plumbing check on the CPU

One process: the experts (112 local, latent 3584, width 3072, top-16; bf16 weights quantised to MXFP4, the bf16
op holding their exact dequantised values) are built once; for each case (decode at 1, 4, 16, 64 tokens, prefill
at 256, 512 and 1024 tokens = 4096 (the mid class), 8192 and 16384 routed rows) every tile of its row class
(`moe_mxfp4.MXFP4_ROW_CLASSES`) runs the whole `moe_experts_mxfp4` op with that tile and is checked against the
float64 reference (`kernels.torch.moe_mxfp4`, computed on the GPU in float64: exact decode, no overflow) on the
case's own inputs, called a second time for the same output bit for bit, and run once on the conformance case's
extreme scales (`ExtremesCheck`); a tile that fails a check (or does not compile or launch) is never timed. A
tile whose fault ends the CUDA context (an illegal address, a trap) stops the sweep with what it finished written
and the tile named, instead of failing every later call. Checked tiles are timed as the bench times them
(`bench.timing`, CUDA events, do_bench median with the sweeps' budget; decode inside a CUDA graph), as is the
bf16 op (`kernels.triton.moe_experts`, its tuned default) on the same inputs.

Printed last: per case the tiles by time with the speed-up over bf16 and the packed bytes' fraction of copy
bandwidth, then per row class the tile with the best geometric-mean time over the class's cases, as a `paste:`
line for `MXFP4_TILES_NVIDIA` in kernels/triton/moe_mxfp4_tiles.py. `--out DIR` gets moe-mxfp4-sweep-<device>.json
and the winners as a tiles file, moe-mxfp4-winners-<device>.json (`K3CORE_MXFP4_TILES=` that file runs the op with
them before they are pasted: `kernels.triton.moe_mxfp4_tuned`), both rewritten after every case so that a run cut
short keeps what it finished.

`--tiles FILE` replaces the candidates: a JSON object from row class to a list of `Mxfp4Tile` fields by name
(absent fields take their defaults), each optionally with "tail": the fields of the tail blocks' tile (two block
heights, `moe_blocks.split_tail_pairs`), or to one such tile (a winners file); only the cases of the classes it
names run. `--tiles A.json,B.json` sweeps several files' candidates in one process (one device call), each class's
lists joined in order with repeats dropped. `--tokens 1,512` picks the cases.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from bench.context import load, make_context, require_interpreter, results_dir
from bench.moe_mxfp4_bench import K3_SHAPE, SMOKE_SHAPE, expert_weights
from bench.report import device_slug
from bench.timing import measure_ceilings, sweep_timer
from k3core.model.mxfp4 import max_scale_of
from k3core.provenance import commit_under_test, tuning_overrides

DECODE_TOKENS, PREFILL_TOKENS = (1, 4, 16, 64), (256, 512, 1024)   # 256: the mid class (37 rows per expert)
SMOKE_TOKENS = (3, 40)                     # 1.5 and 20 rows per expert: the decode and the mid class
# relative to the largest reference output: bf16 x and hidden (2^-9 each) with float32 accumulation, bf16 output;
# the bench's bound (bench/moe_mxfp4_bench.py GPU_TOL), where both kernels measured 2.4e-3 to 3.6e-3 on the H200
GPU_TOL, SMOKE_TOL = 2e-2, 1e-4
ACT = ("situ", 4.0, 25.0)


class Candidate(NamedTuple):
    """A tile to sweep and, for two block heights, the tail blocks' tile."""
    tile: tuple                 # an Mxfp4Tile
    tail: tuple | None = None


def _tiles() -> dict[str, list]:
    """The candidates of each row class, after the H200 sweep at ab06aa5 (/tmp/briefs/mxfp4_sweep.log): the dot
    tiles within ~10% of that run's best (swap-AB with bf16 pair math, split x or neither; the x W^T kernel only as
    the prefill baseline; one `tl.dot_scaled` tile per phase so that its numerics stay checked on sm_90, where it
    is never the default), the losers (0.2-0.75x of the best) dropped, and the gemv tiles
    (`kernels.triton.moe_mxfp4_gemv`): one row per block for decode, 2-16 for decode_batch, some with the next K
    step's words prefetched. Every tile compiles for sm_90 without spilling (backends.offline), except
    (128, 64, 128, 8, 3, split) whose gate/up kernel spills 16 bytes (a tall-M candidate kept on purpose) and
    (128, 64, 128, 4, 3, split, asm_decode), 40 bytes at 255 registers (the prefill winner since a9a24dd); left
    out for spilling: (64, 128, 64, 4, 3, split) 616 bytes, and with prefetch (1, 64, 256, 4, 3) and
    (1, 32, 256, 2, 3)."""
    tile = load("kernels.triton.moe_mxfp4:Mxfp4Tile")
    swap, split, scaled = dict(swap=True), dict(swap=True, split_x=True), dict(swap=True, scaled=True)
    half, gemv, ahead = dict(swap=True, half_math=True), dict(gemv=True), dict(gemv=True, prefetch=True)
    asm = dict(swap=True, asm_decode=True)            # the PTX pair decode: checked and timed here first
    dots = [tile(16, 64, 128, 4, 3, **half), tile(16, 64, 128, 4, 4, **half), tile(16, 64, 128, 4, 3, **split),
            tile(16, 64, 128, 4, 3, **swap), tile(16, 64, 128, 4, 3, **asm), tile(16, 64, 128, 4, 4, **asm),
            tile(16, 32, 128, 4, 3, **asm)]
    decode = dots + [tile(16, 128, 128, 4, 3, **scaled),
                     tile(1, 64, 128, 4, 3, **gemv), tile(1, 64, 128, 4, 4, **gemv), tile(1, 64, 128, 4, 2, **gemv),
                     tile(1, 64, 256, 4, 3, **gemv), tile(1, 128, 128, 8, 3, **gemv), tile(1, 32, 256, 2, 3, **gemv),
                     tile(2, 64, 128, 4, 3, **gemv), tile(1, 64, 128, 4, 3, **ahead), tile(1, 128, 128, 8, 3, **ahead)]
    decode_batch = dots + [tile(2, 64, 128, 4, 3, **gemv), tile(4, 32, 128, 4, 3, **gemv),
                           tile(4, 64, 64, 4, 3, **gemv), tile(8, 32, 64, 4, 2, **gemv),
                           tile(8, 16, 128, 4, 2, **gemv), tile(16, 16, 64, 4, 2, **gemv),
                           tile(2, 64, 128, 4, 3, **ahead), tile(4, 32, 128, 4, 3, **ahead),
                           tile(8, 32, 64, 4, 2, **ahead)]
    prefill = [tile(64, 64, 128, 4, 3, **split), tile(64, 64, 128, 4, 4, **split), tile(32, 64, 128, 4, 3, **split),
               tile(128, 64, 128, 8, 3, **split), tile(64, 64, 128, 4, 3, **swap), tile(64, 64, 128, 4, 3, **half),
               tile(64, 64, 128, 4, 3), tile(128, 64, 64, 8, 3, **scaled),
               # one warpgroup over 128 token rows: each decoded weight tile feeds twice the MMA work of the
               # 64-row tiles (with 8 warps both warpgroups decode the same weight tile); no spills at K step 64
               tile(128, 64, 64, 4, 3, **split), tile(128, 64, 64, 4, 4, **split), tile(128, 64, 64, 4, 3, **half),
               tile(128, 64, 128, 4, 3, **split), tile(128, 64, 64, 4, 3, split_x=True, **asm),
               tile(128, 64, 64, 4, 4, split_x=True, **asm), tile(128, 64, 128, 4, 3, split_x=True, **asm),
               tile(64, 64, 128, 4, 3, split_x=True, **asm)]
    classes = {"decode_thin": decode, "decode": decode, "decode_batch": decode_batch, "mid": prefill,
               "prefill": prefill}
    return {name: [Candidate(t) for t in tiles] for name, tiles in classes.items()}


def _smoke_tiles() -> dict[str, list]:
    tile = load("kernels.triton.moe_mxfp4:Mxfp4Tile")
    tiles = [tile(16, 32, 64, 1, 1), tile(16, 32, 64, 1, 1, swap=True), tile(16, 32, 64, 1, 1, True, True),
             tile(1, 32, 64, 1, 1, gemv=True)]
    return {name: [Candidate(t) for t in tiles] for name in ("decode_thin", "decode", "decode_batch", "mid", "prefill")}


def tiles_from(paths: str) -> dict[str, list]:
    """`--tiles FILE[,FILE...]`'s candidates by row class (see the module docstring), refused by name when
    malformed; several files' lists joined per class in order, a candidate met twice kept once."""
    out: dict[str, list] = {}
    for path in paths.split(","):
        for name, candidates in _tiles_file(path).items():
            kept = out.setdefault(name, [])
            kept += [c for i, c in enumerate(candidates) if c not in kept and c not in candidates[:i]]
    return out


def _tiles_file(path: str) -> dict[str, list]:
    """One `--tiles` file's candidates by row class."""
    classes = [name for _, name in load("kernels.triton.moe_mxfp4:MXFP4_ROW_CLASSES")]
    try:
        spec = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SystemExit(f"--tiles {path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise SystemExit(f"--tiles {path}: not JSON ({exc})") from None
    if not isinstance(spec, dict) or not spec:
        raise SystemExit(f"--tiles {path}: expected a JSON object from row class ({', '.join(classes)}) to a list "
                         "of tiles")
    entry_tiles = load("kernels.triton.moe_mxfp4_tuned:entry_tiles")
    out = {}
    for name, entries in spec.items():
        if name not in classes:
            raise SystemExit(f"--tiles {path}: unknown row class {name!r}; choose from {', '.join(classes)}")
        out[name] = []
        for entry in [entries] if isinstance(entries, dict) else entries:      # one tile: a winners file's entry
            try:              # unchecked: a tile the rules refuse becomes its row's error, as a failed compile does
                out[name].append(Candidate(*entry_tiles(entry, f"--tiles {path}: {name} entry {entry}", False)))
            except ValueError as exc:
                raise SystemExit(str(exc)) from None
    return out


@dataclass
class Result:
    case: str                   # "decode T=4"
    row_class: str
    tokens: int
    tile: list                  # Mxfp4Tile fields, in order
    status: str                 # "ok" | "check failed" | "extremes failed" | "error"
    error: float | None         # max |op - float64| / max |float64|
    ms: float | None
    speedup: float | None       # bf16 ms / this ms
    copy_fraction: float | None  # packed bytes read (codes + scales of the touched experts, x in, y out) / time
    note: str = ""
    tail: list | None = None    # the tail blocks' tile (two block heights), Mxfp4Tile fields in order


class ExtremesCheck:
    """Each tile once on the conformance case's extreme scales (bytes 0, 254 and 255 with x of 2^-126 against the
    254 block: `conformance.cases.build_moe_experts_mxfp4`, extremes=True) at dims that are not all multiples of
    the K step, against the float64 reference on the same rounded inputs, with the op's conformance tolerance."""

    def __init__(self, ctx, whole_steps: bool = False):
        build = load("conformance.cases:build_moe_experts_mxfp4")
        self.tolerance = load("conformance.tolerances:tolerance")("moe_experts_mxfp4", "out", ctx.dtype)
        # top_k and the activation as in the timed cases, so that the check reuses their compiled kernels;
        # whole_steps: D and I multiples of 256, for the tiles that take nothing else (gluon); wgmma tiles take
        # D = I = 384, three 128-column steps each (the odd-step tail of their two-step loop)
        dims = dict(T=8, D=64, I=64, E=8, top_k=4) if ctx.smoke else dict(T=48, D=384, I=384, E=16, top_k=16)
        if whole_steps and not ctx.smoke:
            dims.update(D=512, I=256)
        call = build(dict(dims, activation="situ", extremes=True), torch.Generator().manual_seed(7))
        args = call.args
        self.x = args["x"].to(device=ctx.device, dtype=ctx.dtype)
        self.weights = args["weights"].to(device=ctx.device, dtype=torch.float32)   # pinned float32 (the case's)
        self.rest = [args[k].to(ctx.device) for k in ("w13_packed", "w13_scale", "w2_packed", "w2_scale")]
        self.ids = args["expert_ids"].to(ctx.device)
        self.max_scale = args["max_scale"]                      # 255: these scales cannot fold
        reference = load("kernels.torch.moe_mxfp4:moe_experts_mxfp4")
        self.want = reference(self.x.double(), *self.rest, self.weights.double(), self.ids, *ACT).cpu()
        self.done: dict[Candidate, float] = {}

    def worst(self, op, candidate: Candidate) -> float:
        """max |op - reference| / (atol + rtol |reference|): <= 1 passes."""
        if candidate not in self.done:
            got = op(self.x, *self.rest, self.weights, self.ids, *ACT, tile=candidate.tile,
                     tail_tile=candidate.tail, max_scale=self.max_scale).double().cpu()
            bound = self.tolerance.atol + self.tolerance.rtol * self.want.abs()
            self.done[candidate] = (float(((got - self.want).abs() / bound).max()) if torch.isfinite(got).all()
                                    else math.inf)
        return self.done[candidate]


def _is_decode(row_class: str) -> bool:
    """decode_thin, decode and decode_batch: timed inside a CUDA graph, and the sweep's "decode" phase."""
    return row_class.startswith("decode")


class DeviceLost(Exception):
    """A tile's fault ended the process's CUDA context: what the case finished (`results`, `bf16_ms`) and why."""

    def __init__(self, results: list, bf16_ms: float, why: str):
        super().__init__(why)
        self.results, self.bf16_ms = results, bf16_ms


def _device_lost(device: torch.device) -> str:
    """'' while the device still runs work, else why not: a kernel fault (an illegal address, a trap) ends the
    CUDA context, and every later call of the process would fail too."""
    if device.type != "cuda":
        return ""
    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).item()
    except Exception as exc:  # noqa: BLE001  (any failure here means the context is gone)
        return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    return ""


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    if not torch.isfinite(got).all():
        return math.inf
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def run_case(ctx, shape: dict, tokens: int, tiles: list, row_class: str, packed: dict, copy_tbps: float,
             timer, extremes: dict[bool, ExtremesCheck]) -> tuple[list[Result], float]:
    mxfp4_op = load("kernels.triton.moe_mxfp4:moe_experts_mxfp4")
    bf16_op = load("kernels.triton.moe_experts:moe_experts")
    reference = load("kernels.torch.moe_mxfp4:moe_experts_mxfp4")
    experts, latent, width, top_k = shape["experts"], shape["latent"], shape["width"], shape["top_k"]
    x = ctx.randn(tokens, latent)
    expert_ids = torch.rand(tokens, experts, generator=ctx.generator).topk(top_k, dim=-1).indices.to(ctx.device)
    weights = torch.rand(tokens, top_k, generator=ctx.generator).to(ctx.device)
    (w13, w13_scale), (w2, w2_scale) = packed["w13"], packed["w2"]
    want = reference(x.double(), w13, w13_scale, w2, w2_scale, weights.double(), expert_ids, *ACT)
    bound = max_scale_of(w13_scale, w2_scale)                   # as the model passes it (folds: <= 128)
    decode = _is_decode(row_class)
    tolerance = SMOKE_TOL if ctx.smoke else GPU_TOL

    def timed(fn):
        return timer.time_graph([fn]) if decode else timer.time(fn)

    bf16 = lambda: bf16_op(x, packed["w13_dense"], packed["w2_dense"], weights, expert_ids, *ACT)  # noqa: E731
    bf16_error = _relative_error(bf16(), want)
    bf16_ms = timed(bf16).ms
    touched = int(torch.unique(expert_ids).numel())
    values = touched * 3 * latent * width
    packed_bytes = values // 2 + values // 32 + tokens * latent * x.element_size() * 2
    label = f"{'decode' if decode else 'prefill'} T={tokens}"
    print(f"{label}: {tokens * top_k} routed rows, {touched} experts, bf16 {bf16_ms:.4f} ms "
          f"(error {bf16_error:.1e})", flush=True)
    results = []
    for candidate in tiles:
        tile, tail = candidate
        name = f"{tuple(tile)}" + (f" + tail {tuple(tail)}" if tail is not None else "")
        extra = dict(tail=list(tail) if tail is not None else None)

        def call(tile=tile, tail=tail):
            return mxfp4_op(x, w13, w13_scale, w2, w2_scale, weights, expert_ids, *ACT, tile=tile, tail_tile=tail,
                            max_scale=bound)
        started = time.perf_counter()
        try:
            first = call()
            error = _relative_error(first, want)
            # bit for bit again: deterministic, and nothing a call leaves behind (a stream tile's counters) changes
            # the next one
            repeated = torch.equal(call(), first)
            if tile.stream:
                load("kernels.triton.moe_mxfp4_stream:check_invariants")(x.device)   # the counters are zero again
            extreme = extremes[candidate.tile.gluon].worst(mxfp4_op, candidate)
        except Exception as exc:  # noqa: BLE001  (a tile that cannot compile or launch is a finding, not a crash)
            results.append(Result(label, row_class, tokens, list(tile), "error", None, None, None, None,
                                  f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}", **extra))
            print(f"  {name}: error {results[-1].note}", flush=True)
            lost = _device_lost(x.device)
            if lost:
                raise DeviceLost(results, bf16_ms, f"{name} ({label}) ended the CUDA context ({lost})") from exc
            continue
        if not error <= tolerance:
            results.append(Result(label, row_class, tokens, list(tile), "check failed", error, None, None, None,
                                  f"error {error:.2e} > {tolerance:.0e}: not timed", **extra))
            print(f"  {name}: CHECK FAILED ({error:.2e}), not timed", flush=True)
            continue
        if not repeated:
            results.append(Result(label, row_class, tokens, list(tile), "repeat differs", error, None, None, None,
                                  "a second call's output differs from the first: not timed", **extra))
            print(f"  {name}: REPEAT DIFFERS, not timed", flush=True)
            continue
        if not extreme <= 1.0:
            results.append(Result(label, row_class, tokens, list(tile), "extremes failed", error, None, None, None,
                                  f"extreme scales at {extreme:.2f}x the conformance bound: not timed", **extra))
            print(f"  {name}: EXTREMES CHECK FAILED ({extreme:.2f}x the bound), not timed", flush=True)
            continue
        ms = timed(call).ms
        fraction = packed_bytes / (ms * 1e-3) / (copy_tbps * 1e12)
        results.append(Result(label, row_class, tokens, list(tile), "ok", error, ms, bf16_ms / ms, fraction,
                              f"extremes {extreme:.2f}x bound; first call + checks "
                              f"{time.perf_counter() - started:.1f} s", **extra))
        print(f"  {name}: {ms:.4f} ms, {bf16_ms / ms:.2f}x bf16, {fraction:.1%} of copy, error {error:.1e}",
              flush=True)
    return results, bf16_ms


def _winners(results: list[Result]) -> dict[str, tuple[list, float, int, list | None]]:
    """Per row class: the tile (with its tail tile, if any) with the best geometric-mean time over the class's
    cases, among those timed in all of them -> (tile, geometric-mean ms, cases, tail tile or None)."""
    by_class: dict[str, dict[tuple, list[float]]] = {}
    cases: dict[str, set] = {}
    for r in results:
        cases.setdefault(r.row_class, set()).add(r.case)
        if r.status == "ok":
            key = (tuple(r.tile), tuple(r.tail) if r.tail else None)
            by_class.setdefault(r.row_class, {}).setdefault(key, []).append(r.ms)
    winners = {}
    for row_class, tiles in by_class.items():
        full = {t: ms for t, ms in tiles.items() if len(ms) == len(cases[row_class])}
        if full:
            best = min(full, key=lambda t: sum(math.log(m) for m in full[t]))
            winners[row_class] = (list(best[0]), math.exp(sum(math.log(m) for m in full[best]) / len(full[best])),
                                  len(full[best]), list(best[1]) if best[1] else None)
    return winners


def winners_file(winners: dict) -> dict:
    """`_winners` as a tiles file (`kernels.triton.moe_mxfp4_tuned`): row class -> the winning tile's fields by
    name, with "tail" where it has one."""
    tile_type = load("kernels.triton.moe_mxfp4:Mxfp4Tile")
    return {row_class: dict(tile_type(*tile)._asdict(), **({"tail": tile_type(*tail)._asdict()} if tail else {}))
            for row_class, (tile, _, _, tail) in winners.items()}


def _constructor(tile) -> str:
    """'Mxfp4Tile(block_m=..., ...)' with every field by name, as the tables spell them."""
    return "Mxfp4Tile(" + ", ".join(f"{k}={v}" for k, v in tile._asdict().items()) + ")"


def summary(results: list[Result], bf16: dict[str, float]) -> str:
    tile_type = load("kernels.triton.moe_mxfp4:Mxfp4Tile")
    fields = ", ".join(["m", "n", "k", "warps", "stages", *tile_type._fields[5:]])
    lines = [f"| case | tile ({fields}) | ms | vs bf16 | packed of copy | error |",
             "|---|---|---|---|---|---|"]
    for case in dict.fromkeys(r.case for r in results):
        rows = sorted((r for r in results if r.case == case), key=lambda r: (r.ms is None, r.ms or 0))
        lines.append(f"| {case} | bf16 moe_experts | {bf16[case]:.4f} | 1.00x | | |")
        for r in rows:
            name = f"{tuple(r.tile)}" + (f" + tail {tuple(r.tail)}" if r.tail else "")
            if r.status == "ok":
                lines.append(f"| {case} | {name} | {r.ms:.4f} | {r.speedup:.2f}x | {r.copy_fraction:.1%} "
                             f"| {r.error:.1e} |")
            else:
                lines.append(f"| {case} | {name} | {r.status} | | | {r.note} |")
    lines.append("")
    for row_class, (tile, ms, count, tail) in _winners(results).items():
        lines.append(f"{row_class}: best over {count} case(s), geometric mean {ms:.4f} ms")
        lines.append(f'  paste: "{row_class}": {_constructor(tile_type(*tile))},')
        if tail:
            lines.append(f'  paste into MXFP4_TAIL_TILES_NVIDIA: "{row_class}": {_constructor(tile_type(*tail))},')
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Result]:
    parser = argparse.ArgumentParser(prog="python -m bench.moe_mxfp4_sweep", description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (needs TRITON_INTERPRET=1)")
    parser.add_argument("--out", default=None, help="directory for the JSON results")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--phases", default="decode,prefill", help="decode, prefill or both (comma-separated)")
    parser.add_argument("--tiles", default=None, help="JSON file(s), comma-separated, of candidates by row class "
                        "(replaces the built-in lists; only those classes' cases run)")
    parser.add_argument("--tokens", default=None, help="comma-separated token counts (default: the built-in cases)")
    args = parser.parse_args(argv)
    require_interpreter(args.smoke, "bench.moe_mxfp4_sweep")
    started = time.perf_counter()
    ctx = make_context(args.smoke, seed=args.seed)
    timer = ctx.timer if args.smoke else sweep_timer(ctx.device)
    shape = SMOKE_SHAPE if args.smoke else K3_SHAPE
    row_class = load("kernels.triton.moe_mxfp4:mxfp4_row_class")
    tiles = tiles_from(args.tiles) if args.tiles else _smoke_tiles() if args.smoke else _tiles()
    phases = set(args.phases.split(","))
    try:
        cases = ([int(t) for t in args.tokens.split(",")] if args.tokens else
                 SMOKE_TOKENS if args.smoke else DECODE_TOKENS + PREFILL_TOKENS)
    except ValueError:
        raise SystemExit(f"--tokens: expected comma-separated integers, got {args.tokens!r}") from None
    if any(t < 1 for t in cases):
        raise SystemExit(f"--tokens: every count must be at least 1, got {args.tokens!r}")
    tokens = [t for t in cases if row_class(t * shape["top_k"], shape["experts"]) in tiles and
              ("decode" if _is_decode(row_class(t * shape["top_k"], shape["experts"])) else "prefill") in phases]
    ceilings = measure_ceilings(timer, ctx.dtype, args.smoke)
    packed = expert_weights(ctx, shape)
    extremes = {False: ExtremesCheck(ctx), True: ExtremesCheck(ctx, whole_steps=True)}
    print(f"experts built in {time.perf_counter() - started:.1f} s; copy {ceilings.copy_tbps:.2f} TB/s", flush=True)
    import triton
    device = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu (interpreter)"
    meta = dict(device=device, torch=torch.__version__, triton=triton.__version__, commit=commit_under_test(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), shape=shape,
                smoke=args.smoke, copy_tbps=ceilings.copy_tbps, tolerance=SMOKE_TOL if args.smoke else GPU_TOL,
                **tuning_overrides())
    out = results_dir(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "smoke" if args.smoke else device_slug(ctx.device, smoke=False)
    path, winners_path = out / f"moe-mxfp4-sweep-{stem}.json", out / f"moe-mxfp4-winners-{stem}.json"
    results: list[Result] = []
    bf16: dict[str, float] = {}
    lost = None
    for t in tokens:
        cls = row_class(t * shape["top_k"], shape["experts"])
        try:
            case_results, bf16_ms = run_case(ctx, shape, t, tiles[cls], cls, packed, ceilings.copy_tbps, timer,
                                             extremes)
        except DeviceLost as exc:
            case_results, bf16_ms, lost = exc.results, exc.bf16_ms, str(exc)
            meta["aborted"] = f"{lost}: the tiles after it and the cases after this one did not run"
        results += case_results
        bf16[case_results[0].case] = bf16_ms
        winners = _winners(results)
        path.write_text(json.dumps({"meta": meta, "bf16_ms": bf16, "results": [asdict(r) for r in results],
                                    "winners": winners}, indent=2))
        if winners:                             # no file while no tile has passed: nothing to adopt
            winners_path.write_text(json.dumps(winners_file(winners), indent=1) + "\n")
        if lost:
            break
    print(f"\nsweep took {time.perf_counter() - started:.0f} s; wrote {path} and the winners to {winners_path} "
          f"(K3CORE_MXFP4_TILES={winners_path} runs the op with them)\n")
    print(summary(results, bf16))
    if lost:
        raise SystemExit(f"sweep stopped: {meta['aborted']}. Sweep the rest in a new process without that tile.")
    return results


if __name__ == "__main__":
    main()

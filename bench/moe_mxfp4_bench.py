"""MXFP4 expert GEMMs (`moe_experts_mxfp4`, W4A16) against the bf16 expert GEMMs (`moe_experts`) at K3's per-GPU shapes.

    python -m bench.moe_mxfp4_bench --out bench/results            # on a GPU
    TRITON_INTERPRET=1 python -m bench.moe_mxfp4_bench --smoke --out /tmp/x    # plumbing check on the CPU

Shapes: 112 local experts (896 / EP8), latent width 3584, expert width 3072, top-16; decode at 1-64 tokens and
prefill at 8192 and 16384 routed rows. Both ops get the same experts: bf16 weights quantised to MXFP4, the bf16 op
holding their exact dequantised values, so both compute the same function and differ only in what they read.
Every row checks both ops against the float64 reference (`kernels.torch.moe_mxfp4`, on up to 64 tokens) first; a
row whose check fails prints no speed-up. Reported: time per call, bytes read (the experts the routing touches:
packed codes + scales, or bf16, plus activations in and out), their rate as a fraction of the measured copy
bandwidth, and the speed-up of MXFP4 over bf16. On a GPU each decode row also ranks both ops' kernels by time
(torch.profiler) against the graph-timed call: the launches and the GPU's idle share of a call, which the per-kernel
Nsight profiles do not show. Results go to `--out` as moe-mxfp4-<device>.json and .md with device, versions,
commit and date.
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.context import BenchContext, load, make_context, require_interpreter, results_dir
from bench.report import device_slug
from bench.timing import measure_ceilings
from k3core.model.mxfp4 import max_scale_of
from k3core.provenance import commit_under_test, tuning_overrides
from tools.tune.kernel_profile import markdown as kernel_profile_markdown
from tools.tune.kernel_profile import profile_kernels

K3_SHAPE = dict(experts=112, latent=3584, width=3072, top_k=16)
SMOKE_SHAPE = dict(experts=8, latent=64, width=64, top_k=4)
DECODE_TOKENS, SMOKE_DECODE_TOKENS = (1, 4, 16, 64), (1, 3)
PREFILL_ROWS, SMOKE_PREFILL_ROWS = (8192, 16384), (32,)
CHECK_TOKENS = 64
# bf16 run: products of bf16 inputs in float32, the expert hidden rounded to bf16 between the GEMMs, the output
# rounded to bf16 (2^-9 each), relative to the largest output; smoke runs are float32 throughout
GPU_TOL, SMOKE_TOL = 2e-2, 1e-4


@dataclass
class Row:
    phase: str                  # "decode" | "prefill"
    tokens: int
    routed_rows: int
    experts_touched: int
    mxfp4_error: float          # max |op - float64| / max |float64| on the checked tokens
    bf16_error: float
    tolerance: float
    correct: bool
    mxfp4_ms: float
    bf16_ms: float
    mxfp4_bytes: int
    bf16_bytes: int
    mxfp4_copy_fraction: float  # (bytes / time) / copy bandwidth
    bf16_copy_fraction: float
    speedup: float | None       # bf16_ms / mxfp4_ms; None when the correctness check failed
    timing: str
    tile: str = ""              # the MXFP4 launch shape the op chose (`moe_mxfp4.mxfp4_tile`), its set options
    # decode on a GPU: each op's kernels ranked by time under torch.profiler against its graph-timed call
    # (`tools.tune.kernel_profile`: the busy share says how much of the call the GPU sat between kernels), or
    # why no profile was taken
    profiles: dict | None = None


def expert_weights(ctx: BenchContext, shape: dict) -> dict:
    """The experts of every case, built once, expert by expert on the device (the quantiser's temporaries for all
    112 K3 experts at once would not fit): w13/w2 as (codes, scales) and their exact bf16 values. The 3.7G values
    are drawn on the device from a seed the context's generator gives (drawn on the CPU they took 30-45 s of every
    GPU process: moe-mxfp4-*-nvidia-h200.txt), so the seed still fixes them on a given device."""
    experts, latent, width = shape["experts"], shape["latent"], shape["width"]
    quantize = load("k3core.model.mxfp4:quantize_mxfp4")
    dequantize = load("k3core.model.mxfp4:dequantize_mxfp4")
    seed = int(torch.randint(2 ** 62, (1,), generator=ctx.generator))
    generator = torch.Generator(device=ctx.device).manual_seed(seed)
    packed = {}
    for name, rows, cols in (("w13", 2 * width, latent), ("w2", latent, width)):
        codes = torch.empty(experts, rows, cols // 2, dtype=torch.uint8, device=ctx.device)
        scale = torch.empty(experts, rows, cols // 32, dtype=torch.uint8, device=ctx.device)
        dense = torch.empty(experts, rows, cols, dtype=ctx.dtype, device=ctx.device)
        for expert in range(experts):
            values = torch.randn(rows, cols, generator=generator, device=ctx.device) * cols ** -0.5
            codes[expert], scale[expert] = quantize(values)
            dense[expert] = dequantize(codes[expert], scale[expert]).to(ctx.dtype)
        packed[name], packed[name + "_dense"] = (codes, scale), dense
    return packed


def _problem(ctx: BenchContext, shape: dict, tokens: int, packed: dict):
    experts, latent, top_k = shape["experts"], shape["latent"], shape["top_k"]
    x = ctx.randn(tokens, latent)
    scores = torch.rand(tokens, experts, generator=ctx.generator)
    expert_ids = scores.topk(top_k, dim=-1).indices.to(ctx.device)          # distinct experts per token
    weights = torch.rand(tokens, top_k, generator=ctx.generator).to(ctx.device)
    return x, packed, weights, expert_ids


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double().cpu() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def run_case(ctx: BenchContext, shape: dict, phase: str, tokens: int, copy_tbps: float, packed: dict) -> Row:
    x, packed, weights, expert_ids = _problem(ctx, shape, tokens, packed)
    mxfp4_op = load("kernels.triton.moe_mxfp4:moe_experts_mxfp4")
    bf16_op = load("kernels.triton.moe_experts:moe_experts")
    reference = load("kernels.torch.moe_mxfp4:moe_experts_mxfp4")
    (w13_codes, w13_scale), (w2_codes, w2_scale) = packed["w13"], packed["w2"]
    act = ("situ", 4.0, 25.0)
    bound = max_scale_of(w13_scale, w2_scale)                   # measured once, as the model does at load

    def mxfp4(rows=slice(None)):
        return mxfp4_op(x[rows], w13_codes, w13_scale, w2_codes, w2_scale, weights[rows], expert_ids[rows], *act,
                        max_scale=bound)

    def bf16(rows=slice(None)):
        return bf16_op(x[rows], packed["w13_dense"], packed["w2_dense"], weights[rows], expert_ids[rows], *act)

    # the timed call itself, checked on its first and last tokens: the last pairs of each expert are the ones
    # that run in tail blocks when the op uses two block heights (moe_blocks.split_tail_pairs)
    ends = torch.cat([torch.arange(min(tokens, CHECK_TOKENS // 2)),
                      torch.arange(max(0, tokens - CHECK_TOKENS // 2), tokens)])
    checked = torch.unique(ends).to(x.device)
    want = reference(x[checked].double().cpu(), w13_codes.cpu(), w13_scale.cpu(), w2_codes.cpu(), w2_scale.cpu(),
                     weights[checked].double().cpu(), expert_ids[checked].cpu(), *act)
    mxfp4_error, bf16_error = _relative_error(mxfp4()[checked], want), _relative_error(bf16()[checked], want)
    tolerance = SMOKE_TOL if ctx.smoke else GPU_TOL
    correct = mxfp4_error <= tolerance and bf16_error <= tolerance
    timer = ctx.timer
    mxfp4_timing = timer.time_graph([mxfp4]) if phase == "decode" else timer.time(mxfp4)
    bf16_timing = timer.time_graph([bf16]) if phase == "decode" else timer.time(bf16)
    touched = int(torch.unique(expert_ids).numel())
    latent, width = shape["latent"], shape["width"]
    values = touched * 3 * latent * width                                   # w1, w3, w2 of each touched expert
    io = tokens * latent * x.element_size() * 2                             # x in, y out
    mxfp4_bytes = values // 2 + values // 32 + io
    bf16_bytes = values * packed["w13_dense"].element_size() + io

    def fraction(num_bytes: int, ms: float) -> float:
        return num_bytes / (ms * 1e-3) / (copy_tbps * 1e12)

    profiles = None
    if phase == "decode" and ctx.device.type == "cuda":
        profiles = {name: _profile(fn, ctx.device, timing.ms)
                    for name, fn, timing in (("mxfp4", mxfp4, mxfp4_timing), ("bf16", bf16, bf16_timing))}
    return Row(phase, tokens, tokens * shape["top_k"], touched, mxfp4_error, bf16_error, tolerance, correct,
               mxfp4_timing.ms, bf16_timing.ms, mxfp4_bytes, bf16_bytes, fraction(mxfp4_bytes, mxfp4_timing.ms),
               fraction(bf16_bytes, bf16_timing.ms), bf16_timing.ms / mxfp4_timing.ms if correct else None,
               mxfp4_timing.method, _tile_label(x, tokens * shape["top_k"], shape["experts"], bound), profiles)


def _profile(fn, device: torch.device, call_ms: float) -> dict:
    """One op's kernels over 20 eager calls, ranked, against its graph-timed call; a profiler failure is recorded,
    not raised (the timings above stand without it)."""
    try:
        return profile_kernels(fn, device, steps=20, step_ms=call_ms, top=8)
    except Exception as exc:  # noqa: BLE001  (no CUPTI, say: the row keeps its timings)
        return {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"}


def _tile_label(x: torch.Tensor, pairs: int, experts: int, max_scale: int | None = None) -> str:
    """'16x64x128 w4 s3 swap asm_decode scale_fold': block m (block_m+tail_m with a tail part) x n x k, warps,
    stages and the options that are on (scale_fold: the swap kernels fold their decode constant under this
    `max_scale`), then ' + tail ...' with the tail blocks' tile where the op runs two block heights
    (`mxfp4_tail_tile`)."""
    tile = load("kernels.triton.moe_mxfp4:mxfp4_tile")(x.device, pairs, experts, x.element_size(), x.dtype)
    tail = load("kernels.triton.moe_mxfp4:mxfp4_tail_tile")(x.device, tile, pairs, experts, x.dtype)
    fold = load("kernels.triton.moe_mxfp4:scale_fold")(max_scale)

    def label(t) -> str:
        flags = [name for name, value in t._asdict().items() if value is True]
        flags += [f"{name}={t._asdict()[name]}" for name in ("maxnreg", "down_block_n") if t._asdict().get(name)]
        if t.swap and not t.scaled and fold:
            flags.append("scale_fold")
        rows = f"{t.block_m}+{t.tail_m}" if t.tail_m else f"{t.block_m}"
        return " ".join([f"{rows}x{t.block_n}x{t.block_k} w{t.num_warps} s{t.num_stages}", *flags])
    return label(tile) + (f" + tail {label(tail)}" if tail is not None else "")


def _markdown(meta: dict, rows: list[Row]) -> str:
    lines = [f"# moe_experts_mxfp4 vs moe_experts (bf16) on {meta['device']}", "",
             f"commit {meta['commit']}, {meta['date']}, torch {meta['torch']}, triton {meta['triton']}; shapes "
             f"{meta['shape']}; copy ceiling {meta['copy_tbps']:.2f} TB/s (read + write)", "",
             *[f"Tiles not the commit's: {name}={o['path']} in place of {o['replaces']}: {json.dumps(o['content'])}\n"
               for name, o in meta.get("tuning_overrides", {}).items()],
             "| phase | tokens | routed rows | experts | mxfp4 ms | bf16 ms | speed-up | mxfp4 of copy | bf16 of copy "
             "| check (mxfp4 / bf16 error, tol) | mxfp4 tile |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        speedup = f"{r.speedup:.2f}x" if r.speedup is not None else "refused: check failed"
        lines.append(f"| {r.phase} | {r.tokens} | {r.routed_rows} | {r.experts_touched} | {r.mxfp4_ms:.4f} | "
                     f"{r.bf16_ms:.4f} | {speedup} | {r.mxfp4_copy_fraction:.1%} | {r.bf16_copy_fraction:.1%} | "
                     f"{'ok' if r.correct else 'FAILED'} ({r.mxfp4_error:.1e} / {r.bf16_error:.1e}, "
                     f"{r.tolerance:.0e}) | {r.tile} |")
    for r in rows:
        for name, profile in (r.profiles or {}).items():
            title = f"{r.phase} {r.tokens} token(s), {name}"
            lines += [""] + ([f"{title}: no profile ({profile['error']})."] if "error" in profile else
                             kernel_profile_markdown(profile, title))
    if meta["smoke"]:
        lines += ["", "Smoke run on the CPU under the Triton interpreter: the times are not measurements."]
    return "\n".join(lines) + "\n"


def _token_counts(text: str) -> tuple[int, ...]:
    """'1,32,48' -> (1, 32, 48): positive token counts, refused by name otherwise."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens takes comma-separated token counts, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--tokens takes token counts of at least 1, got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(prog="python -m bench.moe_mxfp4_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (needs TRITON_INTERPRET=1)")
    parser.add_argument("--out", default=None, help="directory for the JSON and markdown results")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokens", type=_token_counts, default=None,
                        help=f"decode token counts, comma-separated (default {','.join(map(str, DECODE_TOKENS))}; "
                             f"smoke {','.join(map(str, SMOKE_DECODE_TOKENS))})")
    parser.add_argument("--no-prefill", action="store_true", help="only the decode cases")
    args = parser.parse_args(argv)
    require_interpreter(args.smoke, "bench.moe_mxfp4_bench")
    ctx = make_context(args.smoke, seed=args.seed)
    shape = SMOKE_SHAPE if args.smoke else K3_SHAPE
    ceilings = measure_ceilings(ctx.timer, ctx.dtype, args.smoke)
    decode = args.tokens or (SMOKE_DECODE_TOKENS if args.smoke else DECODE_TOKENS)
    prefill = () if args.no_prefill else SMOKE_PREFILL_ROWS if args.smoke else PREFILL_ROWS
    cases = [("decode", t) for t in decode] + [("prefill", rows // shape["top_k"]) for rows in prefill]
    packed = expert_weights(ctx, shape)
    rows = [run_case(ctx, shape, phase, tokens, ceilings.copy_tbps, packed) for phase, tokens in cases]
    import triton
    device = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu (interpreter)"
    meta = dict(device=device, torch=torch.__version__, triton=triton.__version__, commit=commit_under_test(),
                date=datetime.date.today().isoformat(), shape=shape, smoke=args.smoke, dtype=str(ctx.dtype),
                copy_tbps=ceilings.copy_tbps, **tuning_overrides())   # a winners file in place of the table
    out = results_dir(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "moe-mxfp4-" + ("smoke" if args.smoke else device_slug(ctx.device, smoke=False))
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2))
    text = _markdown(meta, rows)
    (out / f"{stem}.md").write_text(text)
    print(text)
    return rows


if __name__ == "__main__":
    main()

"""MXFP4 expert weights in fragment order (`kernels.triton.moe_mxfp4_fragments`) against the checkpoint-order swap
kernels (`kernels.triton.moe_mxfp4`) and the bf16 experts, at K3's per-GPU shapes, in one process.

    python -m bench.moe_mxfp4_layout --out bench/results              # on a GPU
    TRITON_INTERPRET=1 python -m bench.moe_mxfp4_layout --smoke --out /tmp/x    # plumbing check on the CPU

The experts are `bench.moe_mxfp4_bench`'s (bf16 weights quantised to MXFP4, the bf16 op holding their exact values);
the fragment-order copy is packed from the same codes on the device. Every variant runs the whole op on each case
and is checked on the timed call's first and last tokens against the float64 reference (as the op bench checks);
a variant whose check fails is not timed. Decode (1-64 tokens) is timed inside a CUDA graph, prefill (512 and 1024
tokens = 8192 and 16384 routed rows) as plain calls (`bench.timing`). Printed and written to
moe-mxfp4-layout-<device>.json / .md: per case each variant's time, its speed-up over the bf16 experts and its
packed bytes' fraction of the copy bandwidth measured in the same run.
"""
from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch

from bench.context import load, make_context, require_interpreter, results_dir
from bench.moe_mxfp4_bench import (CHECK_TOKENS, GPU_TOL, K3_SHAPE, SMOKE_SHAPE, SMOKE_TOL, _commit,
                                   _relative_error, expert_weights)
from bench.timing import measure_ceilings
from k3core.model.mxfp4 import max_scale_of

DECODE_TOKENS, PREFILL_TOKENS = (1, 4, 16, 64), (512, 1024)
SMOKE_DECODE, SMOKE_PREFILL = (1, 3), (8,)
ACT = ("situ", 4.0, 25.0)


def _variants(phase: str) -> dict[str, tuple[str, object]]:
    """name -> (kind, tile): kind "swap" runs moe_experts_mxfp4 (tile None: its own choice; else a change to it),
    "fragments" runs moe_experts_fragments with that FragmentTile."""
    frag = load("kernels.triton.moe_mxfp4_fragments:FragmentTile")
    if phase == "decode":
        return {"swap": ("swap", None), "swap maxnreg 128": ("swap", {"maxnreg": 128}),
                "fragments s3": ("fragments", frag(16, 3)), "fragments s3 r96": ("fragments", frag(16, 3, 96)),
                "fragments s2": ("fragments", frag(16, 2)), "fragments s4": ("fragments", frag(16, 4))}
    return {"swap": ("swap", None), "fragments m64 s2": ("fragments", frag(64, 2)),
            "fragments m64 s3": ("fragments", frag(64, 3)), "fragments m128 s2": ("fragments", frag(128, 2)),
            "fragments m32 s3": ("fragments", frag(32, 3))}


def run_case(ctx, shape: dict, phase: str, tokens: int, copy_tbps: float, packed: dict, fragments) -> dict:
    experts, latent, width, top_k = shape["experts"], shape["latent"], shape["width"], shape["top_k"]
    x = ctx.randn(tokens, latent)
    expert_ids = torch.rand(tokens, experts, generator=ctx.generator).topk(top_k, dim=-1).indices.to(ctx.device)
    weights = torch.rand(tokens, top_k, generator=ctx.generator).to(ctx.device)
    (w13_codes, w13_scale), (w2_codes, w2_scale) = packed["w13"], packed["w2"]
    bound = max_scale_of(w13_scale, w2_scale)
    swap_op = load("kernels.triton.moe_mxfp4:moe_experts_mxfp4")
    pick = load("kernels.triton.moe_mxfp4:mxfp4_tile")
    frag_op = load("kernels.triton.moe_mxfp4_fragments:moe_experts_fragments")
    bf16_op = load("kernels.triton.moe_experts:moe_experts")
    reference = load("kernels.torch.moe_mxfp4:moe_experts_mxfp4")

    def make(kind: str, tile):
        if kind == "swap":
            chosen = None if tile is None else pick(x.device, tokens * top_k, experts, x.element_size(),
                                                    x.dtype)._replace(**tile)
            return lambda: swap_op(x, w13_codes, w13_scale, w2_codes, w2_scale, weights, expert_ids, *ACT,
                                   max_scale=bound, tile=chosen)
        return lambda: frag_op(x, *fragments, weights, expert_ids, *ACT, max_scale=bound, tile=tile)

    ends = torch.cat([torch.arange(min(tokens, CHECK_TOKENS // 2)),
                      torch.arange(max(0, tokens - CHECK_TOKENS // 2), tokens)])
    checked = torch.unique(ends).to(x.device)
    want = reference(x[checked].double().cpu(), w13_codes.cpu(), w13_scale.cpu(), w2_codes.cpu(), w2_scale.cpu(),
                     weights[checked].double().cpu(), expert_ids[checked].cpu(), *ACT)
    tolerance = SMOKE_TOL if ctx.smoke else GPU_TOL
    time_it = ctx.timer.time_graph if phase == "decode" else ctx.timer.time

    def bf16():
        return bf16_op(x, packed["w13_dense"], packed["w2_dense"], weights, expert_ids, *ACT)

    bf16_error = _relative_error(bf16()[checked], want)
    bf16_ms = time_it([bf16]).ms if phase == "decode" else time_it(bf16).ms
    touched = int(torch.unique(expert_ids).numel())
    values = touched * 3 * latent * width
    packed_bytes = values // 2 + values // 32 + tokens * latent * x.element_size() * 2
    rows = {}
    for name, (kind, tile) in _variants(phase).items():
        fn = make(kind, tile)
        try:
            error = _relative_error(fn()[checked], want)
        except Exception as exc:  # noqa: BLE001  (a variant that cannot compile or launch is reported, not fatal)
            rows[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            continue
        row = {"check_error": error, "tolerance": tolerance, "correct": error <= tolerance}
        if row["correct"]:
            ms = time_it([fn]).ms if phase == "decode" else time_it(fn).ms
            row.update(ms=ms, speedup_vs_bf16=bf16_ms / ms,
                       copy_fraction=packed_bytes / (ms * 1e-3) / (copy_tbps * 1e12))
        rows[name] = row
    return {"phase": phase, "tokens": tokens, "routed_rows": tokens * top_k, "experts_touched": touched,
            "bf16_ms": bf16_ms, "bf16_error": bf16_error, "variants": rows}


def _markdown(meta: dict, cases: list[dict]) -> str:
    lines = [f"# MXFP4 experts: fragment order vs checkpoint order vs bf16 on {meta['device']}", "",
             f"commit {meta['commit']}, {meta['date']}, torch {meta['torch']}, triton {meta['triton']}; shapes "
             f"{meta['shape']}; copy ceiling {meta['copy_tbps']:.2f} TB/s", "",
             "| phase | tokens | variant | ms | vs bf16 | of copy | check error |", "|---|---|---|---|---|---|---|"]
    for case in cases:
        lines.append(f"| {case['phase']} | {case['tokens']} | bf16 experts | {case['bf16_ms']:.4f} | 1.00x | | "
                     f"{case['bf16_error']:.1e} |")
        for name, row in case["variants"].items():
            if "error" in row:
                lines.append(f"| {case['phase']} | {case['tokens']} | {name} | failed: {row['error'][:80]} | | | |")
            elif not row["correct"]:
                lines.append(f"| {case['phase']} | {case['tokens']} | {name} | not timed: check failed | | | "
                             f"{row['check_error']:.1e} |")
            else:
                lines.append(f"| {case['phase']} | {case['tokens']} | {name} | {row['ms']:.4f} | "
                             f"{row['speedup_vs_bf16']:.2f}x | {row['copy_fraction']:.1%} | {row['check_error']:.1e} |")
    if meta["smoke"]:
        lines += ["", "Smoke run on the CPU under the Triton interpreter: the times are not measurements."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m bench.moe_mxfp4_layout", description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (needs TRITON_INTERPRET=1)")
    parser.add_argument("--out", default=None, help="directory for the JSON and markdown results")
    parser.add_argument("--tokens", default=None, help="comma-separated token counts (default: all cases)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    require_interpreter(args.smoke, "bench.moe_mxfp4_layout")
    ctx = make_context(args.smoke, seed=args.seed)
    shape = SMOKE_SHAPE if args.smoke else K3_SHAPE
    ceilings = measure_ceilings(ctx.timer, ctx.dtype, args.smoke)
    cases = [("decode", t) for t in (SMOKE_DECODE if args.smoke else DECODE_TOKENS)]
    cases += [("prefill", t) for t in (SMOKE_PREFILL if args.smoke else PREFILL_TOKENS)]
    if args.tokens:
        wanted = {int(t) for t in args.tokens.split(",")}
        cases = [c for c in cases if c[1] in wanted]
    packed = expert_weights(ctx, shape)
    pack = load("kernels.triton.moe_mxfp4_fragments:pack_expert_weights")
    fragments = pack(*packed["w13"], *packed["w2"])
    import triton
    device = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu (interpreter)"
    meta = dict(device=device, torch=torch.__version__, triton=triton.__version__, commit=_commit(),
                date=datetime.date.today().isoformat(), shape=shape, smoke=args.smoke, copy_tbps=ceilings.copy_tbps)
    out = results_dir(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "moe-mxfp4-layout-" + device.lower().replace(" ", "-").replace("(", "").replace(")", "")
    results = []
    for phase, tokens in cases:
        results.append(run_case(ctx, shape, phase, tokens, ceilings.copy_tbps, packed, fragments))
        (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "cases": results}, indent=1))
        (out / f"{stem}.md").write_text(_markdown(meta, results))
        print(_markdown(meta, results[-1:]).split("\n", 5)[-1], flush=True)
    print(_markdown(meta, results))
    return results


if __name__ == "__main__":
    main()

"""Kernel benchmark: every k3core kernel against its anchor, in one process, on the same inputs.

    python -m bench.kernels                          # all cases on the GPU -> bench/results/kernels-<device>.*
    python -m bench.kernels --only kda_prefill,mla_decode
    TRITON_INTERPRET=1 python -m bench.kernels --smoke   # tiny float32 shapes on the CPU: checks the plumbing

Each case checks correctness first (our output against a float64 reference of the op, NaN-poisoned outputs) and
only then times; a row that fails says FAILED and carries no time and no ratio. Results go to $OUT when it is set
(the device machine), else to bench/results/. See bench/README.md for what every column means.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from bench.context import BenchContext, make_context
from bench.report import Check, Row, environment, short_table, write_results
from bench.timing import measure_ceilings

CaseFn = Callable[[BenchContext], list[Row]]


def _cases() -> dict[str, CaseFn]:
    from bench.cases_attn_res import attn_res_rows  # noqa: PLC0415  (cases import triton kernels lazily)
    from bench.cases_kda import kda_decode_rows, kda_prefill_rows  # noqa: PLC0415
    from bench.cases_mla import mla_decode_rows, mla_prefill_rows  # noqa: PLC0415
    from bench.cases_moe import moe_rows  # noqa: PLC0415
    return {"kda_prefill": kda_prefill_rows, "kda_decode": kda_decode_rows, "mla_decode": mla_decode_rows,
            "mla_prefill": mla_prefill_rows, "moe": moe_rows, "attn_res": attn_res_rows}


CASE_NAMES = ("kda_prefill", "kda_decode", "mla_decode", "mla_prefill", "moe", "attn_res")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help=f"comma-separated cases (default all): {', '.join(CASE_NAMES)}")
    parser.add_argument("--smoke", action="store_true", help="tiny float32 shapes on the CPU under TRITON_INTERPRET=1")
    parser.add_argument("--out", default="", help="results folder (default $OUT, else bench/results)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="time ours and the anchor alternately this many times (KDA prefill and decode rows) "
                             "and report the medians and the spread of the speed-ups")
    return parser.parse_args(argv)


def selected(only: str) -> list[str]:
    names = [n.strip() for n in only.split(",") if n.strip()] or list(CASE_NAMES)
    unknown = [n for n in names if n not in CASE_NAMES]
    if unknown:
        raise SystemExit(f"unknown case(s) {', '.join(unknown)}; choose from: {', '.join(CASE_NAMES)}")
    return names


def crashed_row(name: str, exc: BaseException) -> Row:
    """A case that raised still gets a row, FAILED with the exception, so the table never silently drops it."""
    row = Row(name, "-", "(case raised)", "-", notes=traceback.format_exc(limit=3).replace("\n", " | ")[-600:])
    row.checks.append(Check(float("inf"), 0.0, f"case raised {type(exc).__name__}: {str(exc)[:200]}"))
    return row


def run(argv: list[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    names = selected(args.only)
    if args.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--smoke runs Triton kernels on the CPU and needs TRITON_INTERPRET=1 set before Python "
                         "starts: run `TRITON_INTERPRET=1 python -m bench.kernels --smoke`")
    ctx = make_context(args.smoke, args.seed, args.repeats)
    out_dir = Path(args.out or os.environ.get("OUT") or Path(__file__).parent / "results")
    env = environment(ctx.device, args.smoke)
    print(f"k3core kernel benchmark: {env['device']}, torch {env['torch']}, triton {env['triton']}, "
          f"fla {env['fla']}, commit {env['commit']}", flush=True)
    cases = _cases()
    rows: list[Row] = []
    with torch.inference_mode():
        ceilings = measure_ceilings(ctx.timer, ctx.dtype, args.smoke)
        print(f"ceilings: copy {ceilings.copy_tbps:.2f} TB/s, matmul {ceilings.matmul_tflops:.1f} TFLOP/s", flush=True)
        for name in names:
            try:
                new_rows = cases[name](ctx)
            except Exception as exc:  # one broken case must not hide the others' results
                new_rows = [crashed_row(name, exc)]
            for row in new_rows:
                print(f"  {row.case} {row.shape} {row.provider}: {row.status}; {row.anchor_status}", flush=True)
            rows += new_rows
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
            write_results(rows, env, ceilings, out_dir)    # after every case: a timeout still leaves results
    json_path, md_path = write_results(rows, env, ceilings, out_dir)
    print(f"wrote {json_path} and {md_path}")
    print(short_table(rows, ceilings))
    return rows


def main(argv: list[str] | None = None) -> int:
    rows = run(argv)
    return 0 if all(row.passed for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

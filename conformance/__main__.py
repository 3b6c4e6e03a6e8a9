"""`python -m conformance --backend cuda [--report PATH] [--dtype bf16,fp32] [--quick] [--seed N] [--op NAME]`

Runs every provider of the backend (not only the one selection would choose) on every case, against the float64
CPU oracle, prints a table (op, provider, cases passed, worst error against its tolerance) and writes PATH.json
and PATH.md. A provider that cannot run here is listed as skipped with its reason, never as passed. The seed
is printed; pass it back with --seed to replay a failure. Exit status 1 when any case failed or raised.
"""
from __future__ import annotations

import argparse
import random
import sys

import torch

from conformance.cases import cases_for
from conformance.report import summarise, table, write
from conformance.runner import CaseResult, backend_providers, default_device, run_case
from k3core.backend import resolve_backend
from k3core.ops import OP_NAMES

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def interpreted_on_cpu(provider_name: str, device: torch.device) -> bool:
    """Triton under TRITON_INTERPRET=1 runs numpy per program: only the quick cases are affordable."""
    return ".triton." in provider_name and device.type == "cpu"


def run_suite(backend: str, dtypes: list[torch.dtype], quick: bool, seed: int, op: str | None = None,
              device: torch.device | None = None, progress: bool = False) -> list[CaseResult]:
    device = device or default_device(backend)
    results = []
    for op_name in ([op] if op else OP_NAMES):
        for provider in backend_providers(backend, op_name):
            size = "quick" if quick or interpreted_on_cpu(provider.name, device) else "full"
            for case in cases_for(size, op_name):
                for dtype in dtypes:
                    result = run_case(case, provider, dtype, device, seed)
                    results.append(result)
                    if progress and result.status != "skipped":
                        print(f"  {result.status:<7} {provider.name} {case.case_id} {result.dtype} "
                              f"({result.seconds:.2f}s) {result.reason}", file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance", description=__doc__.split("\n\n")[1])
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "cuda", "rocm"])
    parser.add_argument("--dtype", default="bf16,fp32", help=f"comma-separated, from: {', '.join(DTYPES)}")
    parser.add_argument("--quick", action="store_true", help="small shapes only (what CI runs interpreted)")
    parser.add_argument("--seed", type=int, default=None, help="replay a run (default: a fresh random seed)")
    parser.add_argument("--op", choices=OP_NAMES, default=None)
    parser.add_argument("--report", default=None, help="write PATH.json and PATH.md (default conformance-<backend>)")
    parser.add_argument("--verbose", action="store_true", help="print each case as it finishes")
    args = parser.parse_args(argv)
    try:
        dtypes = [DTYPES[name.strip()] for name in args.dtype.split(",")]
    except KeyError as exc:
        parser.error(f"unknown dtype {exc.args[0]!r}; choose from: {', '.join(DTYPES)}")
    backend = resolve_backend(args.backend)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    device = default_device(backend)
    print(f"conformance: backend {backend}, device {device}, seed {seed} (replay with --seed {seed})")
    results = run_suite(backend, dtypes, args.quick, seed, args.op, device, progress=args.verbose)
    print(table(summarise(results)))
    json_path, md_path = write(results, args.report or f"conformance-{backend}",
                               {"backend": backend, "seed": str(seed), "quick": str(args.quick)})
    print(f"wrote {json_path} and {md_path}")
    return 1 if any(r.status in ("failed", "error") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Summarise `triton-jit` lines (kernels.triton.jit_watch.print_compiles) of a log: the compiles after a marker
line, by kernel, with their specialisations.

    python -m tools.jit_misses LOG [--after "engine process ready"]    (marker lines end in "at <monotonic>")
"""
from __future__ import annotations

import argparse
import re
from collections import defaultdict


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.jit_misses")
    parser.add_argument("log")
    parser.add_argument("--after", default="engine process ready", help="the marker line's text before \" at\"")
    args = parser.parse_args(argv)
    marks, compiles = [], []
    for line in open(args.log, errors="replace"):
        if line.startswith("triton-jit "):
            _, when, kernel, spec = line.rstrip("\n").split(" ", 3)
            compiles.append((float(when), kernel, spec))
        else:
            found = re.search(r"(.*) at (\d+\.\d+)$", line.strip())
            if found:
                marks.append((float(found.group(2)), found.group(1)))
    start = next((t for t, name in marks if name.startswith(args.after)), None)
    print(f"{len(compiles)} compiles in all; marks: {marks}")
    if start is None:
        return 1
    late = [c for c in compiles if c[0] > start]
    print(f"{len(late)} compiles after {args.after!r}")
    phases = [m for m in marks if m[0] >= start]
    for when, name in phases:
        print(f"  {name}: {sum(1 for c in late if c[0] >= when)} compiles from here on")
    by_kernel = defaultdict(list)
    for when, kernel, spec in late:
        by_kernel[kernel].append((when - start, spec))
    for kernel, items in sorted(by_kernel.items(), key=lambda kv: -len(kv[1])):
        print(f"{len(items):4d} {kernel}")
        for when, spec in items[:3]:
            print(f"       +{when:7.2f}s {spec[:400]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

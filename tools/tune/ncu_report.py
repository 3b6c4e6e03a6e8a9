"""Short text from Nsight Compute exports (`scripts/gpu.sh tune ncu`): where each profiled kernel's warps stall.

    ncu --import r.ncu-rep --page raw --csv | python -m tools.tune.ncu_report stalls
    ncu --import r.ncu-rep --page source --csv --print-source sass | python -m tools.tune.ncu_report source

`stalls` prints, per kernel, its duration and the stall reasons that cost the most cycles per issued
instruction (WarpStateStats); `source` prints the SASS lines with the most warp-stall samples, and their share of
the instructions executed (SourceCounters).
Both read CSV from stdin and keep going past rows they do not understand: the profiler's column set changes
between versions, and a half-read profile is still worth more than none.
"""
from __future__ import annotations

import csv
import sys
from collections.abc import Iterable

STALL_PREFIX = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"
SAMPLES_COLUMN = "Warp Stall Sampling (All Samples)"
EXECUTED_COLUMN = "Instructions Executed"


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def stall_table(rows: list[list[str]], top: int = 8) -> list[str]:
    """rows: the raw page (a header of metric names, a row of units, then one row per kernel)."""
    if len(rows) < 3:
        return ["(no kernel rows in the raw page)"]
    header, units = rows[0], rows[1]
    col = {name: i for i, name in enumerate(header)}
    # the raw page picks one unit per column (usecond, msecond, ...) and names it in the units row
    duration_unit = units[col["gpu__time_duration.sum"]] if "gpu__time_duration.sum" in col else ""
    lines = []
    for row in rows[2:]:
        if len(row) != len(header):
            continue
        name = row[col["Kernel Name"]] if "Kernel Name" in col else "?"
        duration = row[col["gpu__time_duration.sum"]] if "gpu__time_duration.sum" in col else "?"
        stalls = []
        for metric, i in col.items():
            if metric.startswith(STALL_PREFIX) and metric.endswith(STALL_SUFFIX):
                value = _number(row[i])
                if value is not None:
                    stalls.append((value, metric[len(STALL_PREFIX):-len(STALL_SUFFIX)]))
        stalls.sort(reverse=True)
        total = sum(v for v, _ in stalls)
        shown = ", ".join(f"{reason} {value:.2f}" for value, reason in stalls[:top])
        lines.append(f"{name[:60]}: {duration} {duration_unit}; stall cycles per issued instruction {total:.2f}: "
                     f"{shown}")
    return lines or ["(no row matched the header)"]


def source_tables(lines: Iterable[str], top: int = 25) -> list[str]:
    """The source page: one table per kernel, each starting with a header row that names SAMPLES_COLUMN."""
    out: list[str] = []
    tables: list[tuple[list[str], list[list[str]]]] = []
    for row in csv.reader(lines):
        if SAMPLES_COLUMN in row:
            tables.append((row, []))
        elif tables and len(row) == len(tables[-1][0]):
            tables[-1][1].append(row)
    if not tables:
        return ["(no source table with a '" + SAMPLES_COLUMN + "' column)"]
    for n, (header, body) in enumerate(tables):
        samples = header.index(SAMPLES_COLUMN)
        text = header.index("Source") if "Source" in header else 1
        executed = header.index(EXECUTED_COLUMN) if EXECUTED_COLUMN in header else None
        scored = [(_number(r[samples]) or 0.0, 0.0 if executed is None else _number(r[executed]) or 0.0,
                   r[text].strip()) for r in body]
        total = sum(s for s, _, _ in scored) or 1.0
        total_executed = sum(e for _, e, _ in scored) or 1.0
        out.append(f"kernel table {n}: {len(body)} source lines, {total:.0f} stall samples; the top {top} "
                   "(share of stall samples, share of instructions executed):")
        for score, count, line in sorted(scored, reverse=True)[:top]:
            out.append(f"  {100 * score / total:5.1f}% {100 * count / total_executed:5.1f}%  {line[:110]}")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv not in (["stalls"], ["source"]):
        print("usage: python -m tools.tune.ncu_report stalls|source < export.csv", file=sys.stderr)
        return 2
    text = sys.stdin.read().splitlines()
    if argv == ["stalls"]:
        result = stall_table(list(csv.reader(line for line in text if line.startswith('"'))))
    else:
        result = source_tables(text)
    print("\n".join(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

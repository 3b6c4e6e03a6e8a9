"""Summaries of conformance results: a terminal table, JSON (every check) and Markdown (for a pull request)."""
from __future__ import annotations

import dataclasses
import json
import platform
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

import torch

from conformance.runner import CaseResult
from k3core.provenance import commit_under_test, tuning_overrides


@dataclasses.dataclass
class Row:
    op: str
    provider: str
    dtype: str
    passed: int
    failed: int
    errors: int
    skipped: int
    worst: float                 # worst error / tolerance bound over the cases that ran
    worst_case: str
    skip_reason: str


def summarise(results: list[CaseResult]) -> list[Row]:
    groups: dict[tuple[str, str, str], list[CaseResult]] = defaultdict(list)
    for r in results:
        groups[(r.op, r.provider, r.dtype)].append(r)
    rows = []
    for (op, provider, dtype), group in groups.items():
        ran = [r for r in group if r.status != "skipped"]
        worst = max(ran, key=lambda r: r.worst, default=None)
        rows.append(Row(op, provider, dtype, sum(r.status == "passed" for r in group),
                        sum(r.status == "failed" for r in group), sum(r.status == "error" for r in group),
                        sum(r.status == "skipped" for r in group), worst.worst if worst else 0.0,
                        worst.case if worst else "", next((r.reason for r in group if r.status == "skipped"), "")))
    return rows


def _worst_text(row: Row) -> str:
    if row.passed + row.failed + row.errors == 0:
        return "-"
    return "inf" if row.worst == float("inf") else f"{row.worst:.3f}"


def table(rows: list[Row]) -> str:
    header = f"{'op':<20} {'provider':<34} {'dtype':<9} {'passed':>9} {'worst/tol':>10}  notes"
    lines = [header, "-" * len(header)]
    for row in rows:
        ran = row.passed + row.failed + row.errors
        notes = []
        if row.failed or row.errors:
            notes.append(f"{row.failed} failed, {row.errors} errors (worst: {row.worst_case})")
        if row.skipped:
            notes.append(f"{row.skipped} skipped: {row.skip_reason}")
        lines.append(f"{row.op:<20} {row.provider:<34} {row.dtype:<9} {f'{row.passed}/{ran}':>9} "
                     f"{_worst_text(row):>10}  {'; '.join(notes)}")
    return "\n".join(lines)


def environment() -> dict[str, str]:
    from backends.common import device_facts  # noqa: PLC0415
    facts = device_facts()
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
            "python": platform.python_version(), "device": facts.describe() if facts else "CPU only",
            "commit": commit_under_test(), **tuning_overrides()}


def write(results: list[CaseResult], path: str | Path, header: dict[str, str]) -> tuple[Path, Path]:
    """Writes PATH.json (every check of every case) and PATH.md (the summary table); returns both paths."""
    base = Path(path)
    base = base.with_suffix("") if base.suffix in (".json", ".md") else base
    base.parent.mkdir(parents=True, exist_ok=True)
    info = {**environment(), **header}
    json_path, md_path = base.with_suffix(".json"), base.with_suffix(".md")
    payload = {"environment": info, "results": [dataclasses.asdict(r) for r in results]}
    json_path.write_text(json.dumps(payload, indent=1, default=str))
    rows = summarise(results)
    md = ["# k3core conformance report", "", *(f"- {k}: {v}" for k, v in info.items()), "",
          "| op | provider | dtype | passed | worst error / tolerance | notes |", "|---|---|---|---|---|---|"]
    for row in rows:
        ran = row.passed + row.failed + row.errors
        note = (f"{row.failed} failed, {row.errors} errors ({row.worst_case})" if row.failed or row.errors else "")
        if row.skipped:
            note += f" {row.skipped} skipped: {row.skip_reason}"
        md.append(f"| {row.op} | {row.provider} | {row.dtype} | {row.passed}/{ran} | {_worst_text(row)} | "
                  f"{note.strip()} |")
    md_path.write_text("\n".join(md) + "\n")
    return json_path, md_path

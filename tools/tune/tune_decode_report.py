"""The decode tuning sweep's report (`tools.tune.tune_decode`): per-shape summary, Markdown table with the configs to
paste into kernels/triton/tuning_ops.py, and the JSON + Markdown files."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tools.tune.tune_decode import Trial


def label(config: dict) -> str:
    return " ".join(f"{key}={value}" for key, value in config.items())


def ranked(trials: list[Trial]) -> list[Trial]:
    return sorted((t for t in trials if t.ms is not None), key=lambda t: t.ms)


def summary(trials: list[Trial]) -> list[dict]:
    """Per shape: the default's number and the fastest correct config."""
    rows = []
    for (op, shape) in dict.fromkeys((t.op, t.shape) for t in trials):
        mine = [t for t in trials if (t.op, t.shape) == (op, shape)]
        default = next((t for t in mine if t.round == "default"), None)
        fastest = ranked(mine)
        counts = {kind: sum(t.status.startswith(kind) for t in mine) for kind in ("ok", "wrong", "error", "skipped")}
        rows.append({"op": op, "shape": shape, "shape_class": mine[0].shape_class, "counts": counts,
                     "default": asdict(default) if default else None,
                     "best": asdict(fastest[0]) if fastest else None})
    return rows


def config_source(op: str, config: dict) -> str:
    name = "MlaDecodeConfig" if op == "mla_decode" else "KdaDecodeConfig"
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in config.items())})"


def describe(trial: dict | None) -> str:
    if not trial or trial["ms"] is None:
        return "-" if not trial else trial["status"]
    return f"{trial['ms']:.4f} ms, {trial['tbps']:.2f} TB/s, {trial['pct_copy']:.1f}% of copy"


def markdown(rows: list[dict], trials: list[Trial], env: dict, copy_tbps: float) -> str:
    lines = [f"# Decode tuning sweep ({env['device']})", "",
             (f"torch {env['torch']}, triton {env['triton']}, commit {env['commit']}, {env['date']}; copy ceiling "
             f"{copy_tbps:.2f} TB/s measured in this run."), "",
             "| op | shape | class | default | best | best config | ok/wrong/error/skipped |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        c = row["counts"]
        best_config = label(row["best"]["config"]) if row["best"] else "-"
        lines.append(f"| {row['op']} | {row['shape']} | {row['shape_class']} | {describe(row['default'])} | "
                     f"{describe(row['best'])} | {best_config} | {c['ok']}/{c['wrong']}/{c['error']}/{c['skipped']} |")
    lines += ["", ("Paste into kernels/triton/tuning_ops.py (`_MLA_DECODE_NVIDIA` / `_KDA_DECODE_NVIDIA`); where two "
              "shapes share a class, take the config that is best on both:"), "", "```"]
    lines += [f'"{row["shape_class"]}": {config_source(row["op"], row["best"]["config"])},  # {row["shape"]}'
              for row in rows if row["best"]]
    lines += ["```", "", "## Every trial", "", "| op | shape | round | config | ms | % copy | status |",
              "|---|---|---|---|---|---|---|"]
    for t in trials:
        ms = f"{t.ms:.4f}" if t.ms is not None else "-"
        pct = f"{t.pct_copy:.1f}" if t.pct_copy is not None else "-"
        lines.append(f"| {t.op} | {t.shape} | {t.round} | {label(t.config)} | {ms} | {pct} | "
                     f"{t.status.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def write(out_dir: Path, trials: list[Trial], env: dict, copy_tbps: float) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = summary(trials)
    stem = f"tune-decode-{env['device_slug']}"
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(json.dumps({"environment": env, "copy_tbps": copy_tbps, "summary": rows,
                                         "trials": [asdict(t) for t in trials]}, indent=1))
    md_path.write_text(markdown(rows, trials, env, copy_tbps))
    return json_path, md_path

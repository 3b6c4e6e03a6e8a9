"""Rows of the kernel benchmark, the correctness gate that guards every ratio, and the JSON / Markdown output.

The gate: a row's speed is reported only when our output matched a float64/float32 reference within the row's
stated tolerance (and every element was written: a NaN anywhere fails); a ratio also needs the anchor to have
run and passed the same check. A failed row keeps its error and says FAILED; its times are dropped.
"""
from __future__ import annotations

import datetime
import json
import math
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bench.timing import Ceilings
from k3core.provenance import commit_under_test, tuning_overrides


@dataclass(frozen=True)
class Check:
    error: float                 # ||out - ref|| / ||ref|| on the checked slice (inf when a NaN/inf was found)
    tolerance: float
    what: str                    # which tensor, which slice

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance          # NaN/inf errors compare False: they never pass

    def describe(self) -> str:
        return f"{self.what}: rel err {self.error:.2e} (tol {self.tolerance:.0e})"


def check(out: torch.Tensor, ref: torch.Tensor, tolerance: float, what: str, full: torch.Tensor | None = None) -> Check:
    """Relative L2 error of `out` against `ref` in float64; `full` (the whole output, when `out` is a slice of
    it) must be finite everywhere: an unwritten element of a NaN-poisoned output shows up here."""
    for tensor in (out, full if full is not None else out):
        if not bool(torch.isfinite(tensor).all()):
            return Check(math.inf, tolerance, f"{what} (non-finite values: unwritten or overflowed)")
    out64 = out.detach().to(torch.float64)
    ref64 = ref.detach().to(device=out.device, dtype=torch.float64)
    if out64.shape != ref64.shape:
        return Check(math.inf, tolerance, f"{what} (shape {tuple(out64.shape)} != reference {tuple(ref64.shape)})")
    denominator = float(torch.linalg.vector_norm(ref64))
    error = float(torch.linalg.vector_norm(out64 - ref64)) / max(denominator, 1e-300)
    return Check(error, tolerance, what)


def poison_allocator(device: torch.device, num_bytes: int) -> None:
    """Fill a freed block of the caching allocator with NaN so that the kernel's own `torch.empty` output most likely
    reuses it: an element the kernel forgets to write then reads as NaN and fails `check`. Best effort on the CPU."""
    if device.type != "cuda" or num_bytes <= 0:
        return
    block = torch.empty(num_bytes // 4 + 1, dtype=torch.float32, device=device)
    block.fill_(float("nan"))
    del block


@dataclass
class Row:
    case: str                      # "kda_prefill"
    shape: str                     # "B=1 T=32768"
    provider: str                  # what of ours was timed
    anchor: str                    # what it is compared against
    flops: float = 0.0             # per call (the useful work, a stated estimate for KDA)
    bytes: float = 0.0             # per call, the fewest bytes the op must move
    checks: list[Check] = field(default_factory=list)
    anchor_checks: list[Check] = field(default_factory=list)
    ours_ms: float | None = None
    anchor_ms: float | None = None
    anchor_unavailable: str = ""   # why the anchor did not run (never faked)
    timing: str = ""
    notes: str = ""

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    @property
    def anchor_passed(self) -> bool:
        return not self.anchor_unavailable and bool(self.anchor_checks) and all(c.ok for c in self.anchor_checks)

    @property
    def status(self) -> str:
        if not self.checks:
            return "FAILED: no correctness check ran"
        if not self.passed:
            return "FAILED: " + "; ".join(c.describe() for c in self.checks if not c.ok)
        return "ok"

    @property
    def anchor_status(self) -> str:
        if self.anchor_unavailable:
            return f"anchor unavailable: {self.anchor_unavailable}"
        if not self.anchor_checks:
            return "anchor FAILED: no correctness check ran"
        if not self.anchor_passed:
            return "anchor FAILED: " + "; ".join(c.describe() for c in self.anchor_checks if not c.ok)
        return "ok"

    def ratio(self) -> float | None:
        """anchor time / our time (> 1: ours is faster); None unless both sides passed their checks."""
        if not (self.passed and self.anchor_passed) or not self.ours_ms or not self.anchor_ms:
            return None
        return self.anchor_ms / self.ours_ms

    def rates(self, ceilings: Ceilings) -> dict[str, float | None]:
        if not self.passed or not self.ours_ms:
            return {"tflops": None, "tbps": None, "matmul_fraction": None, "copy_fraction": None,
                    "roofline_fraction": None}
        seconds = self.ours_ms * 1e-3
        tflops = self.flops / seconds / 1e12
        tbps = self.bytes / seconds / 1e12
        floor_s = max(self.flops / (ceilings.matmul_tflops * 1e12), self.bytes / (ceilings.copy_tbps * 1e12))
        return {"tflops": tflops, "tbps": tbps, "matmul_fraction": tflops / ceilings.matmul_tflops,
                "copy_fraction": tbps / ceilings.copy_tbps, "roofline_fraction": floor_s / seconds}

    def to_json(self, ceilings: Ceilings) -> dict:
        data = asdict(self)
        data["checks"] = [_check_json(c) for c in self.checks]
        data["anchor_checks"] = [_check_json(c) for c in self.anchor_checks]
        if not self.passed:
            data["ours_ms"] = None                   # a wrong kernel's time is not a result
        data.update(status=self.status, anchor_status=self.anchor_status, ratio=self.ratio(), **self.rates(ceilings))
        return data


def _check_json(c: Check) -> dict:
    """Strict JSON has no Infinity: a non-finite error (NaN found, case raised) is written as the string "inf"."""
    return {"what": c.what, "error": c.error if math.isfinite(c.error) else "inf", "tolerance": c.tolerance,
            "ok": c.ok}


def environment(device: torch.device, smoke: bool) -> dict[str, str]:
    import triton  # noqa: PLC0415
    try:
        import fla  # type: ignore[import-not-found]  # noqa: PLC0415
        fla_version = getattr(fla, "__version__", "installed")
    except Exception:
        fla_version = "not installed"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (TRITON_INTERPRET=1 smoke run)"
    return {"device": name, "device_slug": device_slug(device, smoke), "torch": torch.__version__,
            "triton": triton.__version__, "fla": fla_version, "cuda": str(torch.version.cuda),
            "python": platform.python_version(), "commit": commit_under_test(), "smoke": str(smoke),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **tuning_overrides()}


def device_slug(device: torch.device, smoke: bool) -> str:
    if device.type != "cuda":
        return "cpu-smoke" if smoke else "cpu"
    name = torch.cuda.get_device_name(device).lower().replace("nvidia ", "nvidia-")
    return "".join(ch if ch.isalnum() or ch == "-" else "-" for ch in name).strip("-")


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(rows: list[Row], env: dict[str, str], ceilings: Ceilings) -> str:
    lines = [f"# k3core kernel benchmark ({env['device']})", "",
             f"torch {env['torch']}, triton {env['triton']}, fla {env['fla']}, CUDA {env['cuda']}, "
             f"commit {env['commit']}, {env['date']}.", "",
             f"Ceilings measured in this run: copy {ceilings.copy_tbps:.2f} TB/s (read + write of "
             f"{ceilings.copy_bytes / 2**30:.2f} GiB), matmul {ceilings.matmul_tflops:.0f} TFLOP/s "
             f"({ceilings.matmul_n}^3).", "",
             "| case | shape | ours | anchor | ours ms | anchor ms | speed-up (anchor/ours) | TFLOP/s | TB/s | "
             "% copy | % matmul | % roofline | max rel err | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        rates = row.rates(ceilings)
        worst = max((c.error for c in row.checks), default=math.inf)
        status = row.status if not row.passed else (row.anchor_status if row.anchor_status != "ok" else "ok")
        ours_ms = row.ours_ms if row.passed else None
        lines.append(
            f"| {row.case} | {row.shape} | {row.provider} | {row.anchor} | {_fmt(ours_ms, '.4f')} | "
            f"{_fmt(row.anchor_ms, '.4f')} | {_fmt(row.ratio(), '.2f')} | {_fmt(rates['tflops'], '.1f')} | "
            f"{_fmt(rates['tbps'], '.2f')} | {_fmt(_pct(rates['copy_fraction']), '.1f')} | "
            f"{_fmt(_pct(rates['matmul_fraction']), '.1f')} | {_fmt(_pct(rates['roofline_fraction']), '.1f')} | "
            f"{worst:.1e} | {status} |")
    lines += ["", "Timing and notes per row:", ""]
    lines += [f"- {row.case} {row.shape} ({row.provider}): {row.timing}. {row.notes}".rstrip() for row in rows]
    return "\n".join(lines) + "\n"


def _pct(value: float | None) -> float | None:
    return None if value is None else 100.0 * value


def short_table(rows: list[Row], ceilings: Ceilings) -> str:
    """The few columns printed last, so the end of the device call's output carries the answer."""
    out = [f"ceilings: copy {ceilings.copy_tbps:.2f} TB/s, matmul {ceilings.matmul_tflops:.0f} TFLOP/s",
           f"{'case':<13} {'shape':<18} {'ours':<22} {'ms':>9} {'anchor ms':>10} {'x':>6} {'%roof':>6}  status"]
    for row in rows:
        rates = row.rates(ceilings)
        status = row.status if not row.passed else row.anchor_status
        out.append(f"{row.case:<13} {row.shape:<18} {row.provider[:22]:<22} "
                   f"{_fmt(row.ours_ms if row.passed else None, '9.4f'):>9} {_fmt(row.anchor_ms, '10.4f'):>10} "
                   f"{_fmt(row.ratio(), '6.2f'):>6} {_fmt(_pct(rates['roofline_fraction']), '6.1f'):>6}  "
                   f"{status[:110]}")
    return "\n".join(out)


def write_results(rows: list[Row], env: dict[str, str], ceilings: Ceilings, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"kernels-{env['device_slug']}"
    payload = {"environment": env, "ceilings": asdict(ceilings), "rows": [r.to_json(ceilings) for r in rows]}
    json_path, md_path = stem.with_suffix(".json"), stem.with_suffix(".md")
    json_path.write_text(json.dumps(payload, indent=2, default=str, allow_nan=False) + "\n")
    md_path.write_text(markdown(rows, env, ceilings))
    return json_path, md_path

"""scripts/gpu.sh, the one GPU entry script: every subcommand names modules that exist (a module moved without its
caller would first fail on a device call), an unknown subcommand is refused with the usage, and the tuning tools
still run as `python -m tools.tune.<module>`."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu.sh"

SUBCOMMANDS = [
    ["conformance"],
    ["conformance", "kda_decode,mla_decode"],
    ["graphs"],
    ["kernels", "--only", "moe"],
    ["model"],
    ["serving"],
    ["serve-bench"],
    ["parallel"],
    ["tune", "prefill"],
    ["tune", "decode"],
    ["tune", "moe"],
    ["tune", "ncu", "kda_decode_64"],
    ["mxfp4", "--tiles", "bench/sweeps/stream.json", "--tokens", "1,4"],
    ["mxfp4-bench"],
    ["mxfp4-adopt", "--tiles", "bench/sweeps/staged.json", "--tokens", "1,64"],
]


def _dry_run(args: list[str], tmp_path, **extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, DRY_RUN="1", OUT=str(tmp_path), PYTHON=sys.executable, **extra)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("args", SUBCOMMANDS, ids=lambda a: "-".join(a))
def test_every_subcommand_runs_modules_that_exist(args, tmp_path):
    done = _dry_run(args, tmp_path)
    assert done.returncode == 0, done.stderr
    modules = re.findall(r" -m ([A-Za-z_][\w.]*)", done.stdout)
    assert modules, f"`gpu.sh {' '.join(args)}` printed no python -m command:\n{done.stdout}"
    for module in modules:
        if module == "pytest":
            continue
        assert importlib.util.find_spec(module) is not None, f"`gpu.sh {' '.join(args)}` runs missing {module}"
    test_paths = re.findall(r"(tests/\S+\.py)", done.stdout)
    assert all((ROOT / path).exists() for path in test_paths), test_paths


def test_the_conformance_subcommand_limits_ops_when_asked(tmp_path):
    done = _dry_run(["conformance", "kda_decode,mla_decode"], tmp_path)
    assert re.findall(r"--op (\S+)", done.stdout) == ["kda_decode", "mla_decode"]
    assert "conformance.model_check" in done.stdout
    assert "--expert-format mxfp4" in done.stdout                      # the whole model from packed experts too
    assert "--op" not in _dry_run(["conformance"], tmp_path).stdout


def test_an_unknown_subcommand_is_refused_with_the_usage(tmp_path):
    done = _dry_run(["next"], tmp_path)
    assert done.returncode == 2
    assert "bash scripts/gpu.sh conformance" in done.stderr and "bash scripts/gpu.sh tune" in done.stderr
    done = _dry_run(["tune", "sweep"], tmp_path)
    assert done.returncode == 2 and "prefill, decode, moe or ncu" in done.stderr


def test_tuning_tools_run_as_modules_of_tools_tune():
    done = subprocess.run([sys.executable, "-m", "tools.tune.ncu_report", "nonsense"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "python -m tools.tune.ncu_report" in done.stderr
    for name in ("tune_prefill", "tune_decode", "tune_decode_report", "tune_moe", "ncu_targets", "kernel_profile"):
        assert importlib.util.find_spec(f"tools.tune.{name}") is not None
        assert not (ROOT / "bench" / f"{name}.py").exists(), f"bench/{name}.py is back beside tools/tune/{name}.py"


def test_the_mxfp4_subcommand_skips_its_conformance_when_asked(tmp_path):
    """A second sweep in one device call (another --tiles file) need not rerun the conformance cases."""
    args = ["mxfp4", "--tiles", "bench/sweeps/stream.json"]
    assert "-m conformance" in _dry_run(args, tmp_path).stdout
    skipped = _dry_run(args, tmp_path, CONFORMANCE="0").stdout
    assert "-m conformance" not in skipped and "bench.moe_mxfp4_sweep" in skipped and "stream.json" in skipped


def test_the_mxfp4_bench_subcommand_runs_the_op_and_the_model_bench_unless_asked(tmp_path):
    """One call gives the issue's two MXFP4 benchmarks (the expert op at K3's shapes, k3-mini's decode)."""
    both = _dry_run(["mxfp4-bench"], tmp_path).stdout
    assert "bench.moe_mxfp4_bench" in both and "bench.moe_mxfp4_model" in both
    alone = _dry_run(["mxfp4-bench"], tmp_path, MODEL_BENCH="0").stdout
    assert "bench.moe_mxfp4_bench" in alone and "bench.moe_mxfp4_model" not in alone


FAKE_PYTHON = """#!/usr/bin/env bash
# records the tiles file each command ran with; as the sweep, writes a winners file when WRITE_WINNERS is set
echo "${K3CORE_MXFP4_TILES:-unset} | $*" >> "$CALLS"
case "$*" in *bench.moe_mxfp4_sweep*) [ -n "${WRITE_WINNERS:-}" ] && echo '{}' > "$OUT/moe-mxfp4-winners-x.json";; esac
exit 0
"""


@pytest.mark.parametrize("sweep_wrote_winners", [True, False])
def test_mxfp4_adopt_runs_conformance_and_benches_with_the_sweeps_winners(tmp_path, sweep_wrote_winners):
    """One device call: the sweep, then the op's conformance and both benches with K3CORE_MXFP4_TILES naming the
    winners file this sweep wrote (a stale one in $OUT is removed first); no winners, nothing adopted."""
    fake, calls, out = tmp_path / "python", tmp_path / "calls.txt", tmp_path / "out"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    out.mkdir()
    (out / "moe-mxfp4-winners-stale.json").write_text("{}")
    env = dict(os.environ, OUT=str(out), PYTHON=str(fake), CALLS=str(calls), K3CORE_COMMIT="abc",
               PATH=f"{tmp_path}:{os.environ['PATH']}")
    env.pop("K3CORE_MXFP4_TILES", None)
    if sweep_wrote_winners:
        env["WRITE_WINNERS"] = "1"
    done = subprocess.run(["bash", str(SCRIPT), "mxfp4-adopt", "--tokens", "64"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    lines = [line.split(" | ") for line in calls.read_text().splitlines() if " -m " in line]
    ran = {next(p for p in args.split() if "." in p or p == "conformance"): tiles for tiles, args in lines}
    assert ran["bench.moe_mxfp4_sweep"] == "unset"
    if sweep_wrote_winners:
        assert done.returncode == 0, done.stdout + done.stderr
        winners = str(out / "moe-mxfp4-winners-x.json")
        assert ran["conformance"] == ran["bench.moe_mxfp4_bench"] == ran["bench.moe_mxfp4_model"] == winners
        assert not (out / "moe-mxfp4-winners-stale.json").exists()
    else:
        assert done.returncode != 0 and "nothing to adopt" in done.stdout
        assert set(ran) == {"bench.moe_mxfp4_sweep"}

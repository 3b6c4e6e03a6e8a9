"""bench.kernel_resources compiles the KDA prefill kernels for sm_90 on the CPU (Triton's bundled ptxas) and reads
their registers and spills: the numbers behind issue 6's KDA prefill miss, without a GPU. Runs in a subprocess
because conftest.py sets TRITON_INTERPRET=1, under which @triton.jit gives interpreter stand-ins."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "bench.kernel_resources", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_reports_registers_and_stack_of_the_state_pass():
    result = _run("--kernels", "kda_state", "--chunks", "64")
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("kda_state ")]
    assert len(rows) == 3                            # the three kda_state rows of DEFAULT_CONFIGS
    usage = {}
    for row in rows:
        registers, stack, shared = map(int, row[-3:])
        assert 0 < registers <= 255 and shared > 0
        usage[" ".join(row[1:-3])] = stack
    # the facts bench/README.md cites (Triton 3.6.0's ptxas, pinned): the state pass spills nothing on 8 warps at
    # block_v 16 and spills at block_v 64 on 4 warps
    assert usage["chunk=64 num_warps=8 num_stages=2 block_v=16"] == 0, usage
    assert usage["chunk=64 num_warps=4 num_stages=2 block_v=64"] > 0, usage


def test_refuses_to_run_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-m", "bench.kernel_resources"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "unset TRITON_INTERPRET" in result.stderr

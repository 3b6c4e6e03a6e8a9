#!/usr/bin/env bash
# Set up a virtual environment (CPU torch) and run the whole test suite. The README's test command.
# With arguments, they go to one pytest run as they are (e.g. `bash scripts/test.sh tests/test_engine.py -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build on a CPU machine.
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/pip install -q --disable-pip-version-check -e ".[test]"
export TRITON_INTERPRET=1
if [ $# -gt 0 ]; then
    exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
fi
# The whole suite in two runs. First every test not marked serial on two xdist workers (one torch thread each), a
# test file at a time so that module fixtures are built once, the gloo rank tests one at a time (tests/conftest.py).
# Then the tests marked serial (wall-clock bounds: heartbeats, read timeouts) alone on the machine, as before.
status=0
.venv/bin/python -m pytest -p no:cacheprovider -n 2 --dist loadfile -m "not serial" || status=$?
.venv/bin/python -m pytest -p no:cacheprovider -m serial || status=$((status ? status : $?))
exit "$status"

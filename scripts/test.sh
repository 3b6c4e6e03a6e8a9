#!/usr/bin/env bash
# Set up a virtual environment (CPU torch) and run the whole test suite. The README's test command.
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
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"

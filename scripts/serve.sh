#!/usr/bin/env bash
# Start the OpenAI-compatible server: `scripts/serve.sh [--model PATH|PRESET] [--port 30000] ...`
# (flags: `scripts/serve.sh --help`, docs/serving.md). Creates .venv with CPU torch the first time.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
    # torch first and pinned: an unpinned torch would pull a multi-GB CUDA build on a CPU machine.
    .venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
fi
if ! .venv/bin/python -c "import k3core, fastapi, uvicorn" 2>/dev/null; then
    .venv/bin/pip install -q --disable-pip-version-check -e ".[serve]"
fi
exec .venv/bin/python -m k3core.serve "$@"

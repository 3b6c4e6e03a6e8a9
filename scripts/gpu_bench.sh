#!/usr/bin/env bash
# The one device call for the kernel benchmark (issue 6): installs the fla-core anchor wheel, runs every case of
# `python -m bench.kernels` (anchor and k3core in one process, correctness gate first), prints the short table last
# and leaves kernels-<device>.json/.md plus the full log in $OUT. Budget: about 8 minutes of one H200.
#   usage (from the repository root): bash scripts/gpu_bench.sh [--only kda_prefill,mla_decode]
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
LIMIT=${LIMIT:-450}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
if ls .whl/fla_core-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/fla_core-*.whl \
        && export PYTHONPATH=/tmp/site:$PYTHONPATH || echo "fla wheel install failed: fla rows will say anchor unavailable"
else
    echo "no .whl/fla_core-*.whl in the tree: fla rows will say anchor unavailable"
fi
# a commit given by the caller is taken as is: the device copy's .git can be older than the tree it carries
if [ -z "${K3CORE_COMMIT:-}" ]; then
    K3CORE_COMMIT=$(git rev-parse HEAD 2>/dev/null || echo unknown)
    if [ "$K3CORE_COMMIT" != unknown ] && [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
        K3CORE_COMMIT="$K3CORE_COMMIT+dirty"
    fi
fi
export K3CORE_COMMIT
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout "$LIMIT" python3 -m bench.kernels --out "$OUT" "$@" > "$OUT/bench_kernels.log" 2>&1
STATUS=$?
grep -E "^(k3core kernel|ceilings|  )" "$OUT/bench_kernels.log" | cut -c1-220
# anything else the run printed (warnings, a traceback outside the cases), shortened
grep -vE "^(k3core kernel|ceilings|  |wrote |case |[a-z_]+ +[A-Z])" "$OUT/bench_kernels.log" | tail -n 15 | cut -c1-220
echo "bench.kernels exit $STATUS (124 = hit the ${LIMIT}s limit; results of finished cases are still in \$OUT)"
# the table last, so the end of the call's output carries it
sed -n '/^wrote /,$p' "$OUT/bench_kernels.log" | tail -n 40
[ "$STATUS" = 124 ] && ls "$OUT"/kernels-*.md >/dev/null 2>&1 && tail -n 30 "$OUT"/kernels-*.md
exit 0

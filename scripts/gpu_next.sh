#!/usr/bin/env bash
# The device calls owed after the 2026-11-29 (third) session, one nvidia-h200 each (issue 6):
#   K3CORE_COMMIT=<sha> bash scripts/gpu_next.sh tune    # ~8 min: bench.tune_prefill, chunk 64 and 32, split and
#                                                        #   one-kernel intra pass, state blocks; fla in-process
#   K3CORE_COMMIT=<sha> bash scripts/gpu_next.sh check   # ~5 min: conformance of the ops changed since e509fd0
#                                                        #   (kda_prefill, short_conv_prefill, mla_prefill; bf16 and
#                                                        #   fp32) and the whole-model check (the model now passes
#                                                        #   cu_seqlens on the host)
# Extra arguments after `tune` go to bench.tune_prefill (e.g. --chunk-sizes 32 --budget-s 150).
# carry [".whl"] for `tune` (the fla-core anchor; without it the sweep skips fla and its ~100 s autotune per shape). Reports land in $OUT; keep them to eight files or fewer.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
case "${1:-}" in
  tune)
    if ls .whl/fla_core-*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/fla_core-*.whl \
            && export PYTHONPATH=/tmp/site:$PYTHONPATH
    fi
    timeout "${LIMIT:-560}" python3 -m bench.tune_prefill --out "$OUT" "${@:2}" > "$OUT/tune.log" 2>&1
    echo "tune_prefill exit $? (124 = hit the limit; finished shapes are in \$OUT)"
    grep -v "^ *File\|^Traceback\|^    \|skipped" "$OUT/tune.log" | tail -n 40 | cut -c1-220
    ;;
  check)
    for op in kda_prefill short_conv_prefill mla_prefill; do
        timeout "${LIMIT:-150}" python3 -m conformance --backend cuda --op "$op" --dtype bf16,fp32 \
            --report "$OUT/conformance-cuda-h200-$op" > "$OUT/conf-$op.log" 2>&1
        echo "conformance $op exit $?"; grep -E "^$op " "$OUT/conf-$op.log"; rm -f "$OUT/conf-$op.log"
    done
    timeout "${LIMIT:-150}" python3 -m conformance.model_check --backend cuda --device cuda \
        --dtype float32,bfloat16 --report "$OUT/model-cuda-h200" > "$OUT/model.log" 2>&1
    echo "model_check exit $?"; tail -n 3 "$OUT/model.log"; rm -f "$OUT/model.log"
    ;;
  *)
    echo "usage: bash scripts/gpu_next.sh tune|check" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Device calls for issue 6, one nvidia-h200 each. Nothing is owed after the 2026-11-30 tenth session: every op's
# conformance ran at 2360226, moe_experts and the whole-model check at 4a0594b (the last kernel change: 192-row MoE
# tiles), and every kernel row at 845d045 with the MoE rows again at 4a0594b (bench/README.md).
#   K3CORE_COMMIT=<sha> bash scripts/gpu_next.sh check     # ~4.5 min: conformance of every op and the whole-model
#                                                          #   check (12+ files: run it as two calls); `check
#                                                          #   kda_decode,mla_decode` for some ops (+ the model check)
# Other subcommands:
#   K3CORE_COMMIT=<sha> bash scripts/gpu_next.sh moe ...   # bench.tune_moe (MoE expert GEMM tiles and forms;
#                                                          #   e.g. --budget-s 300)
#   K3CORE_COMMIT=<sha> bash scripts/gpu_next.sh model     # ~1.5 min: k3-mini whole-model bench with its profile
#   K3CORE_COMMIT=<sha> bash scripts/gpu_next.sh tune ...  # bench.tune_prefill (KDA prefill passes and configs)
#   K3CORE_COMMIT=<sha> bash scripts/gpu_next.sh decode ... # ~2 min: bench.tune_decode (MLA / KDA decode tables;
#                                                          #   --only mla --mla-shapes 1x131072 for one shape)
# and `bash scripts/gpu_bench.sh` (~5 min, carry .whl) for every kernel row at one commit.
# Extra arguments after `tune` go to bench.tune_prefill (e.g. --chunk-sizes 32 --budget-s 150).
# carry [".whl"] for `tune` (the fla-core anchor; without it the sweep skips fla and its ~100 s autotune per shape).
# Reports land in $OUT; the device tool returns about eight files, so keep them few.
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
  decode)
    timeout "${LIMIT:-330}" python3 -m bench.tune_decode --out "$OUT" "${@:2}" > "$OUT/tune_decode.log" 2>&1
    echo "tune_decode exit $?"; grep -E "^(mla|kda)_decode .*\[" "$OUT/tune_decode.log" | cut -c1-260
    ;;
  moe)
    timeout "${LIMIT:-400}" python3 -m bench.tune_moe --out "$OUT" "${@:2}" > "$OUT/tune_moe.log" 2>&1
    echo "tune_moe exit $?"; grep -vE "^  (prefill|decode) " "$OUT/tune_moe.log" | tail -n 30 | cut -c1-260
    ;;
  model)
    timeout "${LIMIT:-300}" python3 -m bench.model_bench --model k3-mini --out "$OUT" > "$OUT/model_bench.log" 2>&1
    echo "model_bench exit $?"; grep -E "^\[" "$OUT/model_bench.log" | tail -n 12; rm -f "$OUT/model_bench.log"
    ;;
  check)
    ops=${2:-kda_prefill,kda_decode,mla_decode,moe_experts,short_conv_prefill,mla_prefill}
    for op in ${ops//,/ }; do
        timeout "${LIMIT:-150}" python3 -m conformance --backend cuda --op "$op" --dtype bf16,fp32 \
            --report "$OUT/conformance-cuda-h200-$op" > "$OUT/conf-$op.log" 2>&1
        echo "conformance $op exit $?"; grep -E "^$op " "$OUT/conf-$op.log"; rm -f "$OUT/conf-$op.log"
    done
    timeout "${LIMIT:-150}" python3 -m conformance.model_check --backend cuda --device cuda \
        --dtype float32,bfloat16 --report "$OUT/model-cuda-h200" > "$OUT/model.log" 2>&1
    echo "model_check exit $?"; tail -n 3 "$OUT/model.log"; rm -f "$OUT/model.log"
    ;;
  *)
    echo "usage: bash scripts/gpu_next.sh tune|decode|moe|check|model" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# The GPU runs behind conformance/results/ and bench/results/, one subcommand each, from the repository root:
#
#   bash scripts/gpu.sh conformance [OPS]     every cuda provider (bf16, fp32) against the float64 references and the
#                                             whole model against the torch backend, also from a K3-format
#                                             checkpoint with MXFP4 experts, and tests/test_mxfp4_stream_gpu.py; OPS
#                                             (comma-separated, e.g. kda_decode,mla_decode) limits the op level
#   bash scripts/gpu.sh graphs                the engine's CUDA-graph decode against eager (tests/test_engine_graphs.py)
#   bash scripts/gpu.sh kernels [ARGS]        python -m bench.kernels: every kernel against its anchor (--only CASES,
#                                             --repeats N); installs the fla-core anchor from .whl/ when it is there
#   bash scripts/gpu.sh model [ARGS]          python -m bench.model_bench --model k3-mini (BS=1 decode vs its memory
#                                             floor, 8K prefill, 64 x 8K decode, cuda vs torch backend)
#   bash scripts/gpu.sh serving [ARGS]        python -m bench.serving: the model's decode/prefill ceilings, engine
#                                             steps (GPU-busy share), a lone 8K prompt cache on/off, offline
#                                             LLM.generate and the HTTP server on one workload, as ratios
#   bash scripts/gpu.sh serve-bench [ARGS]    starts python -m k3core.serve on the GPU, runs python -m bench.serve_bench
#                                             on the random and shared-prefix datasets (ARGS go to the server; MODEL
#                                             and BACKEND override k3-mini and cuda)
#   bash scripts/gpu.sh parallel [ARGS]       python -m bench.parallel_bench on 2 GPUs (--sections, --plans)
#   bash scripts/gpu.sh tune prefill|decode|moe [ARGS]   python -m tools.tune.tune_<what>: checked config sweeps
#   bash scripts/gpu.sh tune ncu [TARGET ...] Nsight Compute on one call per kernel (tools.tune.ncu_targets)
#   bash scripts/gpu.sh mxfp4 [ARGS]          the moe_experts_mxfp4 conformance cases (bf16, fp32; CONFORMANCE=0
#                                             skips them), then python -m bench.moe_mxfp4_sweep: every MXFP4 expert
#                                             tile checked and timed at K3's shapes against the bf16 experts
#                                             (--phases decode,prefill, --tiles FILE[,FILE], --tokens N,...)
#   bash scripts/gpu.sh mxfp4-bench [ARGS]    python -m bench.moe_mxfp4_bench (the MXFP4 expert op with its tuned tiles
#                                             against the bf16 experts at K3's shapes, kernel profiles per case), then
#                                             python -m bench.moe_mxfp4_model (k3-mini graph decode, MXFP4 against
#                                             bf16 experts and the memory floor; MODEL_BENCH=0 skips it)
#   bash scripts/gpu.sh mxfp4-adopt [ARGS]    in one call: the sweep (ARGS as for mxfp4; LIMIT_SWEEP), then with its
#                                             winners file as K3CORE_MXFP4_TILES the op's conformance (bf16, fp32;
#                                             LIMIT_CONFORMANCE) and mxfp4-bench (LIMIT, LIMIT_MODEL), each result
#                                             recording the file it ran with
#
# Results land in $OUT (default /tmp/out). LIMIT overrides a subcommand's time limit in seconds. K3CORE_COMMIT names
# the commit stored in the results when the copy's .git is not the tree's own. DRY_RUN=1 prints the commands
# instead of running them.
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # never NVLink multicast
OUT=${OUT:-/tmp/out}
DRY_RUN=${DRY_RUN:-0}
PY=${PYTHON:-python3}
GPU=gpu        # the card in report names (h100, h200, ...); environment() reads it from nvidia-smi

usage() {
    sed -n '2,/^set -u/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
}

# run LIMIT LOG CMD...: CMD under `timeout LIMIT` with its output in $OUT/LOG; prints the exit status
run() {
    local limit=$1 log=$2; shift 2
    if [ "$DRY_RUN" = 1 ]; then echo "timeout $limit $*"; return 0; fi
    timeout "$limit" "$@" > "$OUT/$log" 2>&1
    local status=$?
    echo "$* -> exit $status (124 = hit the ${limit}s limit; finished parts are in \$OUT)"
    return $status
}

environment() {
    [ "$DRY_RUN" = 1 ] && return 0
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
    GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | tr '[:upper:]' '[:lower:]' \
          | grep -oE 'gb300|gb200|b300|b200|h200|h100|a100|l40s' | head -n 1)
    GPU=${GPU:-gpu}
    "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'gpus', torch.cuda.device_count())"
    if [ -z "${K3CORE_COMMIT:-}" ]; then
        K3CORE_COMMIT=$(git rev-parse HEAD 2>/dev/null || echo unknown)
        if [ "$K3CORE_COMMIT" != unknown ] && [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
            K3CORE_COMMIT="$K3CORE_COMMIT+dirty"
        fi
    fi
    export K3CORE_COMMIT
    echo "commit $K3CORE_COMMIT"
    if [ -n "${K3CORE_MXFP4_TILES:-}" ]; then
        echo "K3CORE_MXFP4_TILES=$K3CORE_MXFP4_TILES (replaces MXFP4_TILES_NVIDIA)"
    fi
}

# the fla-core anchor, from a wheel carried in .whl/ (the device machine has no package index)
install_fla() {
    [ "$DRY_RUN" = 1 ] && return 0
    if ls .whl/fla_core-*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/fla_core-*.whl \
            && export PYTHONPATH=/tmp/site:$PYTHONPATH || echo "fla wheel install failed: fla rows say anchor unavailable"
    else
        echo "no .whl/fla_core-*.whl in the tree: fla rows say anchor unavailable"
    fi
}

conformance() {
    local ops=${1:-}
    if [ -z "$ops" ]; then
        run "${LIMIT:-420}" conformance.log "$PY" -m conformance --backend cuda --dtype bf16,fp32 --verbose \
            --report "$OUT/conformance-cuda-$GPU" &
    else
        ( for op in ${ops//,/ }; do
              run "${LIMIT:-150}" "conformance-$op.log" "$PY" -m conformance --backend cuda --op "$op" \
                  --dtype bf16,fp32 --report "$OUT/conformance-cuda-$GPU-$op"
          done ) &
    fi
    local ops_job=$!
    run "${LIMIT:-420}" model_check.log "$PY" -m conformance.model_check --backend cuda --device cuda \
        --dtype float32,bfloat16 --report "$OUT/model-cuda-$GPU"
    run "${LIMIT:-420}" model_check_mxfp4.log "$PY" -m conformance.model_check --backend cuda --device cuda \
        --dtype float32,bfloat16 --expert-format mxfp4 --report "$OUT/model-mxfp4-cuda-$GPU"
    # the Gluon MXFP4 pair's folded combine against the separate one, bit for bit, eager and graph-replayed
    run "${LIMIT:-150}" mxfp4_stream_gpu.log "$PY" -m pytest -q -p no:cacheprovider tests/test_mxfp4_stream_gpu.py -rs
    wait $ops_job
    [ "$DRY_RUN" = 1 ] && return 0
    tail -n 40 "$OUT"/conformance*.log | cut -c1-220
    tail -n 8 "$OUT/model_check.log" "$OUT/model_check_mxfp4.log"
    tail -n 3 "$OUT/mxfp4_stream_gpu.log"
}

kernels() {
    install_fla
    run "${LIMIT:-450}" bench_kernels.log "$PY" -m bench.kernels --out "$OUT" "$@"
    [ "$DRY_RUN" = 1 ] && return 0
    grep -vE "^(k3core kernel|ceilings|  |wrote |case |[a-z_]+ +[A-Z])" "$OUT/bench_kernels.log" | tail -n 15 | cut -c1-220
    ls "$OUT"/kernels-*.md >/dev/null 2>&1 && tail -n 30 "$OUT"/kernels-*.md
}

model() {
    run "${LIMIT:-300}" model_bench.log "$PY" -m bench.model_bench --model k3-mini --out "$OUT" "$@"
    [ "$DRY_RUN" = 1 ] && return 0
    grep -E "^\[" "$OUT/model_bench.log" | tail -n 12
}

serving() {
    run "${LIMIT:-580}" serving.log "$PY" -m bench.serving --out "$OUT" "$@"
    [ "$DRY_RUN" = 1 ] && return 0
    tail -n 40 "$OUT/serving.log" | cut -c1-260
}

serve_bench() {
    local port=${PORT:-30200} url
    url=http://127.0.0.1:$port
    local server=("$PY" -m k3core.serve --model "${MODEL:-k3-mini}" --backend "${BACKEND:-cuda}" --port "$port" "$@")
    local client=("$PY" -m bench.serve_bench --url "$url" --num-prompts 64 --max-concurrency 16)
    if [ "$DRY_RUN" = 1 ]; then
        echo "${server[*]}"
        echo "timeout 300 ${client[*]} --dataset random --input-len 256 --output-len 64"
        echo "timeout 300 ${client[*]} --dataset shared-prefix --num-groups 4 --prefix-len 1024 --question-len 32"
        return 0
    fi
    # its own process group, so that stopping it also stops any process the server started (the engine)
    setsid "${server[@]}" > "$OUT/server.log" 2>&1 &
    local server_pid=$!
    for _ in $(seq 1 180); do
        curl -sf "$url/health" >/dev/null 2>&1 && break
        kill -0 $server_pid 2>/dev/null || { echo "the server exited:"; tail -n 20 "$OUT/server.log"; return 1; }
        sleep 1
    done
    run 300 serve_random.log "${client[@]}" --dataset random --input-len 256 --output-len 64 \
        --output "$OUT/serve_bench_random.json"
    run 300 serve_shared.log "${client[@]}" --dataset shared-prefix --num-groups 4 --prefix-len 1024 \
        --question-len 32 --output "$OUT/serve_bench_shared_prefix_cache_on.json"
    kill -TERM -- -"$server_pid" 2>/dev/null || kill -TERM "$server_pid"; wait "$server_pid" 2>/dev/null
    tail -n 12 "$OUT/serve_random.log" "$OUT/serve_shared.log"
}

parallel() {
    run "${LIMIT:-420}" parallel.log "$PY" -m bench.parallel_bench --out "$OUT" "$@"
    [ "$DRY_RUN" = 1 ] && return 0
    grep -E "^(correctness|speed) |Error|Traceback" "$OUT/parallel.log" | tail -n 30 | cut -c1-260
    ls "$OUT"/parallel-*.md >/dev/null 2>&1 && cat "$OUT"/parallel-*.md
}

mxfp4() {
    if [ "${CONFORMANCE:-1}" != 0 ]; then
        run "${LIMIT_CONFORMANCE:-120}" conformance-moe_experts_mxfp4.log "$PY" -m conformance --backend cuda \
            --op moe_experts_mxfp4 --dtype bf16,fp32 --report "$OUT/conformance-cuda-$GPU-moe_experts_mxfp4"
    fi
    run "${LIMIT:-330}" mxfp4_sweep.log "$PY" -m bench.moe_mxfp4_sweep --out "$OUT" "$@"
    [ "$DRY_RUN" = 1 ] && return 0
    [ "${CONFORMANCE:-1}" != 0 ] && tail -n 6 "$OUT/conformance-moe_experts_mxfp4.log" | cut -c1-220
    grep -E "Traceback|Error:|CHECK FAILED|\): error " "$OUT/mxfp4_sweep.log" | head -n 10 | cut -c1-220
    sed -n '/^sweep took/,$p' "$OUT/mxfp4_sweep.log" | cut -c1-220
}

mxfp4_adopt() {
    [ "$DRY_RUN" = 1 ] || rm -f "$OUT"/moe-mxfp4-winners-*.json          # only this sweep's winners are adopted
    CONFORMANCE=0 LIMIT=${LIMIT_SWEEP:-240} mxfp4 "$@"
    local winners
    winners=$(ls "$OUT"/moe-mxfp4-winners-*.json 2>/dev/null | head -n 1)
    if [ "$DRY_RUN" = 1 ]; then
        winners="$OUT/moe-mxfp4-winners-<device>.json"
    elif [ -z "$winners" ]; then
        echo "mxfp4-adopt: the sweep wrote no winners file; nothing to adopt"
        return 1
    fi
    export K3CORE_MXFP4_TILES=$winners
    echo "K3CORE_MXFP4_TILES=$winners"
    [ "$DRY_RUN" = 1 ] || cat "$winners"
    run "${LIMIT_CONFORMANCE:-120}" conformance-moe_experts_mxfp4-adopt.log "$PY" -m conformance --backend cuda \
        --op moe_experts_mxfp4 --dtype bf16,fp32 --report "$OUT/conformance-cuda-$GPU-moe_experts_mxfp4-adopt"
    [ "$DRY_RUN" = 1 ] || tail -n 6 "$OUT/conformance-moe_experts_mxfp4-adopt.log" | cut -c1-220
    LIMIT=${LIMIT:-150} LIMIT_MODEL=${LIMIT_MODEL:-200} mxfp4_bench
}

mxfp4_bench() {
    run "${LIMIT:-240}" mxfp4_bench.log "$PY" -m bench.moe_mxfp4_bench --out "$OUT" "$@"
    if [ "${MODEL_BENCH:-1}" != 0 ]; then
        run "${LIMIT_MODEL:-240}" mxfp4_model.log "$PY" -m bench.moe_mxfp4_model --out "$OUT"
    fi
    [ "$DRY_RUN" = 1 ] && return 0
    grep -hE "Traceback|Error:|refused" "$OUT/mxfp4_bench.log" "$OUT"/mxfp4_model.log 2>/dev/null | head -n 10 \
        | cut -c1-220
    for md in "$OUT"/moe-mxfp4-*.md; do
        [ -e "$md" ] || continue
        sed -n '1,14p' "$md" | cut -c1-200
    done
}

graphs() {
    run "${LIMIT:-300}" graphs.log "$PY" -m pytest -q -p no:cacheprovider tests/test_engine_graphs.py -k on_the_gpu -rs
    [ "$DRY_RUN" = 1 ] && return 0
    tail -n 5 "$OUT/graphs.log"
}

ncu() {
    local targets=("$@")
    [ ${#targets[@]} -gt 0 ] || targets=(kda_prefill_b1 kda_prefill_8x4k kda_decode_64 mla_decode_b1 mla_decode_b64)
    local ncu_bin sections="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats"
    sections="$sections --section MemoryWorkloadAnalysis --section SchedulerStats --section SourceCounters"
    ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -n 1)
    [ -n "$ncu_bin" ] || ncu_bin=ncu
    for t in "${targets[@]}"; do
        # shellcheck disable=SC2086
        run "${LIMIT:-150}" "ncu-$t.log" "$ncu_bin" --clock-control none --nvtx --nvtx-include "profile/" $sections \
            --import-source yes -f -o "/tmp/ncu-$t" "$PY" -m tools.tune.ncu_targets "$t"
        [ "$DRY_RUN" = 1 ] && continue
        # the .ncu-rep files stay on the machine: the text pages below are what comes back
        { echo "## $t: stall reasons"
          "$ncu_bin" --import "/tmp/ncu-$t.ncu-rep" --page raw --csv | "$PY" -m tools.tune.ncu_report stalls
          echo; echo "## $t: hottest SASS lines"
          "$ncu_bin" --import "/tmp/ncu-$t.ncu-rep" --page source --csv --print-source sass \
              | "$PY" -m tools.tune.ncu_report source
          echo; echo "## $t: details"; "$ncu_bin" --import "/tmp/ncu-$t.ncu-rep" --page details
        } > "$OUT/ncu-$t.txt" 2>&1
        rm -f "$OUT/ncu-$t.log"
        head -n 12 "$OUT/ncu-$t.txt" | cut -c1-250
    done
}

tune() {
    local what=${1:-}
    shift || true
    case "$what" in
        prefill) install_fla
                 run "${LIMIT:-560}" tune_prefill.log "$PY" -m tools.tune.tune_prefill --out "$OUT" "$@" ;;
        decode)  run "${LIMIT:-330}" tune_decode.log "$PY" -m tools.tune.tune_decode --out "$OUT" "$@" ;;
        moe)     run "${LIMIT:-400}" tune_moe.log "$PY" -m tools.tune.tune_moe --out "$OUT" "$@" ;;
        ncu)     ncu "$@"; return ;;
        *)       echo "bash scripts/gpu.sh tune: give prefill, decode, moe or ncu" >&2; return 2 ;;
    esac
    [ "$DRY_RUN" = 1 ] || tail -n 30 "$OUT/tune_$what.log" | cut -c1-260
}

command=${1:-}
[ $# -gt 0 ] && shift
case "$command" in
    conformance|graphs|kernels|model|serving|parallel|tune|mxfp4)
        mkdir -p "$OUT"; environment; "$command" "$@" ;;
    serve-bench)
        mkdir -p "$OUT"; environment; serve_bench "$@" ;;
    mxfp4-bench)
        mkdir -p "$OUT"; environment; mxfp4_bench "$@" ;;
    mxfp4-adopt)
        mkdir -p "$OUT"; environment; mxfp4_adopt "$@" ;;
    -h|--help|help)
        usage ;;
    *)
        usage >&2; exit 2 ;;
esac

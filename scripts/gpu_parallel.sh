#!/usr/bin/env bash
# The device call for issue 8 on a 2-GPU machine: NCCL correctness of every 2-rank plan against one GPU, then
# k3-mini prefill/decode speed on 1 GPU, tp2, pp2 and tp2+dcp2. Reports land in $OUT. Budget: about 6 minutes.
#   usage (from the repository root): bash scripts/gpu_parallel.sh [--sections correctness] [--plans tp2,pp2]
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # never NVLink multicast here
OUT=${OUT:-/tmp/out}
LIMIT=${LIMIT:-420}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -5
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
timeout "$LIMIT" python3 -m bench.parallel_bench --out "$OUT" "$@" > "$OUT/parallel.log" 2>&1
STATUS=$?
grep -vE "^\|" "$OUT/parallel.log" | grep -E "Error|error|Traceback" | tail -n 20 | cut -c1-300
echo "bench.parallel_bench exit $STATUS (124 = hit the ${LIMIT}s limit; finished sections are in \$OUT)"
grep -E "^(correctness|speed) " "$OUT/parallel.log" | cut -c1-260
ls "$OUT"/parallel-*.md >/dev/null 2>&1 && cat "$OUT"/parallel-*.md
exit 0

#!/usr/bin/env bash
# One device call: op-level conformance of every cuda provider (bf16, fp32) and the whole model on the cuda
# backend against the torch references, run side by side (nothing here is timed). Reports land in $OUT.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
LIMIT=${LIMIT:-420}   # Triton compiles every kernel from a cold cache first: 140 s was not enough
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout "$LIMIT" python3 -m conformance --backend cuda --dtype bf16,fp32 --verbose --report "$OUT/conformance-cuda-h200" \
    > "$OUT/conformance.log" 2>&1 &
A=$!
timeout "$LIMIT" python3 -m conformance.model_check --backend cuda --device cuda --dtype float32,bfloat16 \
    --report "$OUT/model-cuda-h200" > "$OUT/model.log" 2>&1 &
B=$!
wait $A; echo "conformance exit $?"
wait $B; echo "model_check exit $?"
tail -40 "$OUT/conformance.log"
tail -8 "$OUT/model.log"

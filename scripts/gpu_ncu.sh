#!/usr/bin/env bash
# Nsight Compute on one call of each issue-6 kernel (bench.ncu_targets), one nvidia-h200 call (~3-4 min):
#   bash scripts/gpu_ncu.sh [target ...]      # default: the targets still missed after the fifth session
# Writes $OUT/ncu-<target>.txt: the details page (speed of light, occupancy, launch, memory, warp state), the
# stall reasons per kernel and the SASS lines with the most stall samples (ncu's "cuda" source page, the Triton
# Python lines, came back without a sampling column on 2026-11-30, so it is not asked for). The .ncu-rep files stay in
# /tmp on the device (the device tool returns about eight files). --clock-control none: leave the clocks as the
# machine sets them.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(kda_prefill_b1 kda_prefill_8x4k kda_decode_64 mla_decode_b1 mla_decode_b64)
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -n 1)
[ -n "$NCU" ] || { echo "no ncu on this machine" >&2; exit 1; }
sections="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats"
sections="$sections --section MemoryWorkloadAnalysis --section SchedulerStats --section SourceCounters"
for t in "${targets[@]}"; do
    rep=/tmp/ncu-$t
    # shellcheck disable=SC2086
    timeout "${LIMIT:-150}" "$NCU" --clock-control none --nvtx --nvtx-include "profile/" $sections \
        --import-source yes -f -o "$rep" python3 -m bench.ncu_targets "$t" > "/tmp/ncu-$t.log" 2>&1
    echo "ncu $t exit $?"
    txt=$OUT/ncu-$t.txt
    { echo "## $t: stall reasons"
      "$NCU" --import "$rep.ncu-rep" --page raw --csv | python3 -m bench.ncu_report stalls
      echo; echo "## $t: hottest SASS lines"
      "$NCU" --import "$rep.ncu-rep" --page source --csv --print-source sass | python3 -m bench.ncu_report source
      echo; echo "## $t: details"
      "$NCU" --import "$rep.ncu-rep" --page details
      echo; echo "## $t: profiler log (tail)"; tail -n 15 "/tmp/ncu-$t.log"; } > "$txt" 2>&1
    sed -n '1,/^## .*hottest/p' "$txt" | head -n 12 | cut -c1-250
done

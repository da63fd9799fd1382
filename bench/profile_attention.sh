#!/usr/bin/env bash
# Nsight Compute over bench/profile_attention.py (one tilepy and one cuDNN attention launch per
# target shape): speed of light, pipe utilisation, warp stall reasons. Clocks left alone
# (--clock-control none, as the device notes ask). Usage: bench/profile_attention.sh OUTDIR
# [profile_attention.py args]; NCU_EXTRA="--section SourceCounters" adds per-instruction stalls
# (exported as ncu_attention_source.csv). PROFILE=gemm_ws profiles bench/profile_gemm_ws.py
# instead (files ncu_gemm_ws.*), with the memory workload section too.
set -uo pipefail
OUT=${1:?usage: bench/profile_attention.sh OUTDIR [profile_attention.py args]}
shift
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
P=${PROFILE:-attention}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -n 1)
timeout 400 "$NCU" --clock-control none --profile-from-start off --target-processes all \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
    --section InstructionStats --section Occupancy --section MemoryWorkloadAnalysis \
    ${NCU_EXTRA:-} --export "$OUT/ncu_$P" --force-overwrite \
    "${PYTHON:-python3}" "bench/profile_$P.py" "$@" > "$OUT/ncu_$P.log" 2>&1
echo "ncu rc=$?"
"$NCU" --import "$OUT/ncu_$P.ncu-rep" --page details > "$OUT/ncu_$P.txt" 2>&1
"$NCU" --import "$OUT/ncu_$P.ncu-rep" --page raw --csv > "$OUT/ncu_${P}_raw.csv" \
    2>/dev/null
if [[ "${NCU_EXTRA:-}" == *SourceCounters* ]]; then  # per-SASS-instruction stalls, by kernel
    "$NCU" --import "$OUT/ncu_$P.ncu-rep" --page source --csv --print-source sass \
        > "$OUT/ncu_${P}_source.csv" 2>&1
fi
tail -n 5 "$OUT/ncu_$P.log"

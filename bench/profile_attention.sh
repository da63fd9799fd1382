#!/usr/bin/env bash
# Nsight Compute over bench/profile_attention.py (one tilepy and one cuDNN attention launch per
# target shape): speed of light, pipe utilisation, warp stall reasons. Clocks left alone
# (--clock-control none, as the device notes ask). Usage: bench/profile_attention.sh OUTDIR
# [profile_attention.py args]; NCU_EXTRA="--section SourceCounters" adds per-instruction stalls
# (exported as ncu_attention_source.csv).
set -uo pipefail
OUT=${1:?usage: bench/profile_attention.sh OUTDIR [profile_attention.py args]}
shift
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -n 1)
timeout 400 "$NCU" --clock-control none --profile-from-start off --target-processes all \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
    --section InstructionStats --section Occupancy ${NCU_EXTRA:-} \
    --export "$OUT/ncu_attention" --force-overwrite \
    "${PYTHON:-python3}" bench/profile_attention.py "$@" > "$OUT/ncu_attention.log" 2>&1
echo "ncu rc=$?"
"$NCU" --import "$OUT/ncu_attention.ncu-rep" --page details > "$OUT/ncu_attention.txt" 2>&1
"$NCU" --import "$OUT/ncu_attention.ncu-rep" --page raw --csv > "$OUT/ncu_attention_raw.csv" \
    2>/dev/null
if [[ "${NCU_EXTRA:-}" == *SourceCounters* ]]; then  # per-SASS-instruction stalls, by kernel
    "$NCU" --import "$OUT/ncu_attention.ncu-rep" --page source --csv --print-source sass \
        > "$OUT/ncu_attention_source.csv" 2>&1
fi
tail -n 5 "$OUT/ncu_attention.log"

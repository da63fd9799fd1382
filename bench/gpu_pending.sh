#!/usr/bin/env bash
# The GPU checks still pending after 2026-11-29 (bench/NOTES.md), in priority order, each in
# its own process with its own time limit (a CUDA_ERROR_ILLEGAL_* poisons the process that hit
# it, and an mbarrier deadlock hangs it). Two parts, each one device call of under 10 minutes:
#   PART=tests bench/gpu_pending.sh OUTDIR   the correctness checks (steps 1, 2 and 4)
#   PART=sweeps bench/gpu_pending.sh OUTDIR  the two Hopper sweeps (step 3)
# (default: both, for a machine without the per-call limit). tilepy on PYTHONPATH.
set -uo pipefail
OUT=${1:?usage: bench/gpu_pending.sh OUTDIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
summary=()

step() {  # step NAME SECONDS CMD...
    local name=$1 secs=$2
    shift 2
    timeout "$secs" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    summary+=("$(printf '%-28s rc=%-3s %s' "$name" "$rc" "$(grep -aE '[0-9]+ (passed|failed)' \
        "$OUT/$name.log" | tail -n 1)")")
}

PART=${PART:-tests sweeps}
if [[ " $PART " == *" tests "* ]]; then
    # 1. the Hopper PTX tests that never ran (they followed a crash), one per process
    for k in phases hand_over specialised 3d_load tma_fed; do
        step "ptx_tma_$k" 45 "$PY" -m pytest -q -p no:cacheprovider -m gpu \
            tests/test_ptx_mbarrier_tma.py -k "$k"
    done
    # 2. the warp-specialised GEMM and the wgmma attention kernel
    step ops_gemm_wgmma_ws 120 "$PY" -m pytest -q -p no:cacheprovider -m gpu \
        tests/test_ops_gemm_wgmma_ws.py
    step ops_attention_wgmma 90 "$PY" -m pytest -q -p no:cacheprovider -m gpu \
        tests/test_ops_attention_wgmma.py
    # 4. gemm_softmax at full size and the custom-kernel guide against cuBLAS
    step ops_gemm_softmax 120 "$PY" -m pytest -q -s -p no:cacheprovider -m gpu \
        tests/test_ops_gemm_softmax.py tests/test_docs.py
fi
if [[ " $PART " == *" sweeps "* ]]; then
    # 3. the Hopper kernels' configs against cuBLAS / SDPA FA2
    step sweep_gemm_wgmma 280 "$PY" bench/sweep_gemm_wgmma.py \
        --json "$OUT/sweep_gemm_wgmma.json"
    step sweep_attention 250 "$PY" bench/sweep_attention.py --quick ${SWEEP_ATTN_ARGS:-} \
        --json "$OUT/sweep_attention.json"
fi

echo "== pending GPU checks =="
printf '%s\n' "${summary[@]}"
for f in "$OUT"/sweep_*.log; do
    [ -e "$f" ] || continue
    echo "-- ${f##*/}"
    grep -aE "TFLOPS|check|FAILED|Error" "$f" | tail -n 20
done

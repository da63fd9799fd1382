#!/usr/bin/env bash
# One batch on a GPU machine: info, the gpu test layer, the demo, the benchmarks.
# Usage: bench/gpu_check.sh OUTDIR [extra pytest args for the benchmarks]
# Works with tilepy on PYTHONPATH (not installed), beside the machine's numba-cuda/CuPy/PyTorch.
# Writes: info.txt, gpu_tests.log, demo.json, bench.json (pytest-benchmark) into OUTDIR and
# prints a short summary table last. Exit status: non-zero if tests, demo or benchmarks failed.
set -uo pipefail
OUT=${1:?usage: bench/gpu_check.sh OUTDIR}
shift
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
status=0

"$PY" -m tilepy info 2>&1 | tee "$OUT/info.txt" || status=1
"$PY" -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
"$PY" -m tilepy demo --json "$OUT/demo.json" 2>&1 | tee "$OUT/demo.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
"$PY" -m pytest -q bench -p no:cacheprovider --benchmark-json="$OUT/bench.json" \
    --benchmark-columns=median,rounds "$@" 2>&1 | tail -n 30
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo
echo "== summary =="
"$PY" bench/summary.py "$OUT"
exit $status

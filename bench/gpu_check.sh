#!/usr/bin/env bash
# One batch on a GPU machine: info, the gpu test layer, the demo, the benchmarks.
# Usage: bench/gpu_check.sh OUTDIR [extra pytest args for the benchmarks]
# PARTS="tests demo bench" (default: all three) selects parts; TESTS="tests/test_x.py ..."
# narrows the gpu test layer. On an H200 (2026-11-29) the gpu test layer took about 6 minutes
# (most of it compiling ~80 small kernels), the demo 15 s, the benchmarks about 1 minute: with
# the device tool's 10-minute cap per command, run the tests and the benchmarks as two calls.
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

PARTS=${PARTS:-tests demo bench}
TESTS=${TESTS:-tests}

"$PY" -m tilepy info 2>&1 | tee "$OUT/info.txt" || status=1
if [[ " $PARTS " == *" tests "* ]]; then
    # shellcheck disable=SC2086
    "$PY" -m pytest -q -m gpu $TESTS -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [[ " $PARTS " == *" demo "* ]]; then
    "$PY" -m tilepy demo --json "$OUT/demo.json" 2>&1 | tee "$OUT/demo.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [[ " $PARTS " == *" bench "* ]]; then
    "$PY" -m pytest -q bench -p no:cacheprovider --benchmark-json="$OUT/bench.json" \
        --benchmark-columns=median,rounds "$@" 2>&1 | tail -n 30
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

echo
echo "== summary =="
"$PY" bench/summary.py "$OUT"
exit $status

#!/usr/bin/env bash
# One batch on a GPU machine: info, the gpu test layer, the demo, the benchmarks.
# Usage: bench/gpu_check.sh OUTDIR [extra pytest args for the benchmarks]
# PARTS="tests demo bench" (default: all three) selects parts; TESTS="tests/test_x.py ..."
# narrows the gpu test layer; BENCH_K="gemm" (a pytest -k expression) narrows the benchmarks
# and names their JSON bench_<expression>.json, so that several calls can share one OUTDIR
# (the summary reads every bench*.json there). On an H200 (2026-11-29) the gpu test layer took
# about 6 minutes (most of it compiling ~80 small kernels), the demo 15 s. The benchmark
# suites compile ~30 tilepy kernels and autotune the Triton peers: run them as
# BENCH_K=gemm, BENCH_K=softmax and BENCH_K=attention, one call each, to stay inside the
# device tool's 10-minute cap per command.
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
    BENCH_K=${BENCH_K:-}
    json="$OUT/bench.json"
    kargs=()
    if [ -n "$BENCH_K" ]; then
        json="$OUT/bench_$(printf '%s' "$BENCH_K" | tr -c 'A-Za-z0-9' '_').json"
        kargs=(-k "$BENCH_K")
    fi
    "$PY" -m pytest -q bench -p no:cacheprovider --benchmark-json="$json" \
        --benchmark-columns=median,rounds ${kargs[@]+"${kargs[@]}"} "$@" 2>&1 | tail -n 30
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

echo
echo "== summary =="
"$PY" bench/summary.py "$OUT"
exit $status

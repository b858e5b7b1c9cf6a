#!/usr/bin/env bash
# Issue 33 on a lent H200, with .whl carried (tools/h200/env.sh): vd record --trace's cost and vd locate's
# answer for the 0.5B and 8B shapes, graphed against compiled-graphed (tools/bench_trace.py), and the GPU tests
# of tracing. One part per call, each inside the 10-minute limit:
#   bash tools/h200/trace.sh tests   # the trace tests of tests/test_gpu.py
#   bash tools/h200/trace.sh 8b      # -> $OUT/bench_trace_8b.json
#   bash tools/h200/trace.sh 0.5b    # -> $OUT/bench_trace_05b.json
set -uo pipefail
. tools/h200/env.sh
export PYTHONUNBUFFERED=1
bench() {
  python3 tools/bench_trace.py --device cuda --model "$1" --forwards graphed compiled-graphed \
    --prompt Verify. --reps "${REPS:-3}" --out "$OUT/$2" 2>&1 | tail -6
}
case "${1:-tests}" in
  tests) python3 -m pytest -q -p no:cacheprovider -m gpu -s -k "traced or locate" tests/test_gpu.py 2>&1 \
           | tee "$OUT/pytest-trace.log" | tail -25 ;;
  0.5b) bench qwen2.5-0.5b-shape bench_trace_05b.json ;;
  8b) bench llama3-8b-shape bench_trace_8b.json ;;
esac
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv

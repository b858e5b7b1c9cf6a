#!/usr/bin/env bash
# Issue 32 on a lent H200, with .whl carried (tools/h200/env.sh): the GPU tests, then the table of axes
# (verify vs decode, and the golden's sequence in a batch of 8) for the 0.5B and 8B shapes under graphed,
# compiled-graphed and eager SDPA. One part per call, each inside the 10-minute limit:
#   bash tools/h200/axes.sh tests     # python3 -m pytest -m gpu, the log in $OUT
#   bash tools/h200/axes.sh 0.5b      # tools/bench_axes.py on qwen2.5-0.5b-shape -> $OUT/bench_axes_05b.json
#   bash tools/h200/axes.sh 8b        # the same on llama3-8b-shape -> $OUT/bench_axes_8b.json
# The two JSON files are merged into tools/h200/bench_axes.json (runs of both) here afterwards.
set -uo pipefail
. tools/h200/env.sh
export PYTHONUNBUFFERED=1
bench() {
  python3 tools/bench_axes.py --device cuda --models "$1" --forwards graphed compiled-graphed sdpa \
    --record-forward graphed --batch 8 --prompt Verify. --steps 8 --out "$OUT/$2" 2>&1 | tail -5
}
case "${1:-tests}" in
  tests) python3 -m pytest -q -p no:cacheprovider -m gpu 2>&1 | tee "$OUT/pytest-gpu.log" | tail -25 ;;
  0.5b) bench qwen2.5-0.5b-shape bench_axes_05b.json ;;
  8b) bench llama3-8b-shape bench_axes_8b.json ;;
  both) bench qwen2.5-0.5b-shape bench_axes_05b.json; bench llama3-8b-shape bench_axes_8b.json ;;
esac
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv

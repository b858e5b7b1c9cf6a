#!/usr/bin/env bash
# Issue 34 on a lent H200, with .whl carried (tools/h200/env.sh) and VD_COMMIT set to the commit the working
# tree is: one part per call, each inside the 10-minute limit.
#   bash tools/h200/speed.sh 0.5b      # tools/bench_gpu.py, the 0.5B shape  -> $OUT/bench_gpu.json
#   bash tools/h200/speed.sh 8b        # the 8B shape                       -> $OUT/bench_gpu.json
#   bash tools/h200/speed.sh start-graphed   # whole `vd` processes on the 8B shape (or start-cg: compiled-graphed):
#                                      # start-up of the second and later replays -> $OUT/bench_process_*.json
#   bash tools/h200/speed.sh tests     # the GPU tests                      -> $OUT/gpu_tests.json
set -uo pipefail
. tools/h200/env.sh
export PYTHONUNBUFFERED=1
bench() {
  python3 tools/bench_gpu.py --model "$1" --forwards graphed,compiled-graphed --k 2,3,4 --reps "${REPS:-3}" \
    --prompt Verify. --out "$OUT/bench_gpu.json" 2>&1 | grep -v Warning | tail -8
}
start() {
  python3 tools/bench_process.py --device cuda --model llama3-8b-shape --forward "$1" --prompt Verify. \
    --steps 16 --reps 3 --out "$OUT/bench_process_8b_$1.json" 2>&1 | tail -6
}
case "${1:-tests}" in
  0.5b) bench qwen2.5-0.5b-shape ;;
  8b) bench llama3-8b-shape ;;
  start-graphed) start graphed ;;
  start-cg) start compiled-graphed ;;
  tests) python3 tools/gpu_tests.py --out "$OUT/gpu_tests.json" 2>&1 | tail -25 ;;
esac
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv

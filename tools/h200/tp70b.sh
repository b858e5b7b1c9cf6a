#!/usr/bin/env bash
# The 70B shape at TP=2 (issue 19), with .whl carried (tools/h200/env.sh). On two GPUs (nvidia-h200-x2) the ranks
# sum through NCCL and the forward is `graphed` (the collectives inside each K's graph); on one GPU the two ranks
# share it, sum through gloo (VD_TP_COLLECTIVES=gloo: NCCL refuses two ranks on one GPU) and run `static`.
# Reports go to $OUT as tp70b-<gpus>gpu-*.json:
#   bash tools/h200/tp70b.sh record   # record here, replay here, the golden back in $OUT (g70.tar.* parts)
#   bash tools/h200/tp70b.sh replay   # on a fresh machine, replay the golden carried in .carry/ (g70.tar.*) at
#                                     # TP=2, then in one process (TP=1: 131 GiB on one H200) under a KL bound
#   bash tools/h200/tp70b.sh bench    # two GPUs: tools/bench_gpu.py's rows for the 70B shape at TP=2 (graphed)
#   bash tools/h200/tp70b.sh 8b       # two GPUs: the 8B shape's TP=1 golden (graphed) replayed at TP=2 (graphed)
#   bash tools/h200/tp70b.sh test     # the GPU tests of tests/test_tp.py (one GPU: ranks sharing it; two: NCCL)
# The one-GPU runs of 2026-12-02 are in tools/h200/tp70b-one-h200.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/h200/env.sh
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
gpus=$(nvidia-smi -L | wc -l)
if [ "$gpus" -ge 2 ]; then forward=graphed; else forward=static; export VD_TP_COLLECTIVES=gloo; fi
tag=tp70b-${gpus}gpu
tol=(--tolerance kl:0.01 --tolerance decisions=margin:0.5)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# GPU memory used, every second, while the runs go (the two ranks' shards are 67.7 GiB each)
nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv,noheader -l 1 > "$OUT/smi-$1.csv" &
smi=$!
run() { local t=$SECONDS; python3 -m vd "$@"; echo "vd $1 rc=$? in $((SECONDS - t)) s"; }
case "$1" in
  record)
    run record /tmp/g70.zarr --model llama3-70b-shape --device cuda --forward $forward --prompt Verify. --k 2,4 \
      --steps 8 --tp 2
    python3 -m vd show /tmp/g70.zarr > "$OUT/show.txt" 2>&1; head -40 "$OUT/show.txt"
    run replay /tmp/g70.zarr --tp 2 --report "$OUT/$tag-same.json"
    (cd /tmp && tar cf - g70.zarr | split -b 15000000 - "$OUT/g70.tar.") && ls -la "$OUT"
    ;;
  replay)
    (cd /tmp && cat "$OLDPWD"/.carry/g70.tar.* | tar xf -) && python3 -m vd verify /tmp/g70.zarr
    run replay /tmp/g70.zarr --tp 2 --report "$OUT/$tag-fresh.json"
    (unset VD_TP_COLLECTIVES; run replay /tmp/g70.zarr --report "$OUT/$tag-tp1.json" "${tol[@]}")
    ;;
  bench)
    python3 -m torch.distributed.run --standalone --nproc-per-node 2 tools/bench_gpu.py --model llama3-70b-shape \
      --forwards graphed --k 2,3,4 --reps 3 --prompt Verify. --out "$OUT/bench70b.json" 2>&1 | grep -v "^W\|^I"
    ;;
  8b)
    run record /tmp/g8.zarr --model llama3-8b-shape --device cuda --forward graphed --prompt Verify. --k 2,4 \
      --steps 8 --allow-thin
    run replay /tmp/g8.zarr --tp 2 --report "$OUT/tp2-vs-tp1-8b-nccl.json" "${tol[@]}"
    ;;
  test)
    python3 -m pytest -q -p no:cacheprovider tests/test_tp.py -m gpu 2>&1 | tail -15
    ;;
esac
kill $smi
cp /tmp/vd-*.txt "$OUT"/ 2>/dev/null  # the tracebacks a failing run names

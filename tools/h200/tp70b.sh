#!/usr/bin/env bash
# The 70B shape at TP=2 on one H200 (issue 19): two ranks share the GPU, their sums through gloo
# (VD_TP_COLLECTIVES=gloo; NCCL refuses two ranks on one GPU, so no graphs), the `static` forward. Results in
# tools/h200/tp70b-*.json. With .whl carried (tools/h200/env.sh):
#   bash tools/h200/tp70b.sh record   # record on this machine, replay it here, the golden back in $OUT (tar parts)
#   bash tools/h200/tp70b.sh replay   # on a fresh machine, replay the golden carried back in .carry/ (g70.tar.*)
#                                     # at TP=2, then in one process (TP=1) under a KL tolerance
#   bash tools/h200/tp70b.sh test     # the GPU test of ranks sharing one GPU (0.5B shape)
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/h200/env.sh
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 VD_TP_COLLECTIVES=gloo
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
args=(--tp 2)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# GPU memory used, every second, while the runs go (the two ranks' shards are ~134 GiB together)
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader -l 1 > "$OUT/smi-$1.csv" &
smi=$!
case "$1" in
  record)
    t=$SECONDS
    python3 -m vd record /tmp/g70.zarr --model llama3-70b-shape --device cuda --forward static \
      --prompt Verify. --k 2,4 --steps 8 "${args[@]}"; echo "record rc=$? in $((SECONDS - t)) s"
    python3 -m vd show /tmp/g70.zarr > "$OUT/show.txt" 2>&1; head -40 "$OUT/show.txt"
    t=$SECONDS
    python3 -m vd replay /tmp/g70.zarr "${args[@]}" --report "$OUT/tp70b-same.json"; echo "replay rc=$? in $((SECONDS - t)) s"
    (cd /tmp && tar cf - g70.zarr | split -b 15000000 - "$OUT/g70.tar.") && ls -la "$OUT"
    ;;
  test)  # the GPU test of ranks sharing one GPU (the 0.5B shape)
    python3 -m pytest -q -p no:cacheprovider tests/test_tp.py -m gpu -k gloo 2>&1 | tail -15
    ;;
  replay)
    (cd /tmp && cat "$OLDPWD"/.carry/g70.tar.* | tar xf -) && python3 -m vd verify /tmp/g70.zarr; echo "verify rc=$?"
    t=$SECONDS
    python3 -m vd replay /tmp/g70.zarr "${args[@]}" --report "$OUT/tp70b-fresh.json"; echo "replay rc=$? in $((SECONDS - t)) s"
    t=$SECONDS  # the whole model in one process (131 GiB of weights on the one GPU): another build, as measured
    python3 -m vd replay /tmp/g70.zarr --report "$OUT/tp70b-tp1.json" --tolerance kl:0.01 \
      --tolerance decisions=margin:0.5; echo "replay at TP=1 rc=$? in $((SECONDS - t)) s"
    ;;
esac
kill $smi
cp /tmp/vd-*.txt "$OUT"/ 2>/dev/null  # the tracebacks a failing run names

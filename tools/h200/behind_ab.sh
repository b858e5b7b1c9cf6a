#!/usr/bin/env bash
# Issue 34, target 3, on a lent H200 (.whl carried, VD_COMMIT set): the recorder's writer behind its runs
# against the writer that waits for every slice (vd.store.write.BEHIND_BYTES = -1, the writer before the
# change), the same bench_gpu.py command on the same machine -> $OUT/bench_gpu_wait.json. Run after
# `speed.sh 0.5b` (the committed code: $OUT/bench_gpu.json) in the same call.
set -uo pipefail
. tools/h200/env.sh
export PYTHONUNBUFFERED=1
python3 - "${1:-qwen2.5-0.5b-shape}" <<'PY' 2>&1 | grep -v Warning | tail -8
import os, runpy, sys
import vd.store.write as W
W.BEHIND_BYTES = -1  # every slice waited for before KRows.write returns
model = sys.argv[1]
sys.argv = ["tools/bench_gpu.py", "--model", model, "--forwards", "graphed,compiled-graphed", "--k", "2,3,4",
            "--reps", os.environ.get("REPS", "3"), "--prompt", "Verify.", "--out", f"{os.environ['OUT']}/bench_gpu_wait.json"]
runpy.run_path("tools/bench_gpu.py", run_name="__main__")
PY

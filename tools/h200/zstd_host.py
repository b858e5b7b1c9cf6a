"""Where a writer process's row-chunk job goes on a host (not a GPU figure): the high plane's chunk of a 0.5B K=2
step (2 x 151936 bf16 values) made by `vd.chunkfiles.row_chunk` against Zstd of the same bytes kept hot, with and
without glibc's malloc returning freed memory to the system (``GLIBC_TUNABLES``), each variant a fresh process.

    python3 tools/h200/zstd_host.py OUT.json      # tools/h200/h100-zstd_host.json: an H100 host, 9ca8440
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

TUNED = "glibc.malloc.mmap_threshold=67108864:glibc.malloc.trim_threshold=268435456:glibc.malloc.top_pad=67108864"


def child() -> dict:
    import numpy as np
    sys.path.insert(0, os.getcwd())
    from vd.chunkfiles import encode_chunk, row_chunk, split_planes
    rng = np.random.default_rng(0)
    f = (rng.standard_normal((1, 2, 151936), dtype=np.float32) * 3).astype(np.float32)
    r = (f.view(np.uint32) >> 16).astype(np.uint16)  # bfloat16's bits
    hi, lo = split_planes(r)

    def t(fn, n=200, idle=0.0):
        xs = []
        for _ in range(n):
            if idle:
                time.sleep(idle)
            s = time.perf_counter()
            fn()
            xs.append(time.perf_counter() - s)
        return [round(min(xs) * 1e3, 3), round(statistics.median(xs) * 1e3, 3), round(max(xs) * 1e3, 3)]
    shape = (16, 2, 151936)
    return {"zstd_same_array": t(lambda: encode_chunk(hi, "zstd")),
            "row_chunk_hi": t(lambda: row_chunk("logits", 0, r, 1, shape, (".hi",))),
            "row_chunk_lo": t(lambda: row_chunk("logits", 0, r, 1, shape, (".lo",))),
            "row_chunk_hi_idle5ms": t(lambda: row_chunk("logits", 0, r, 1, shape, (".hi",)), 100, 0.005),
            "split": t(lambda: split_planes(r))}


if __name__ == "__main__":
    if sys.argv[1:] == ["child"]:
        print(json.dumps(child()))
        sys.exit()
    out = {"command": "python3 tools/h200/zstd_host.py " + " ".join(sys.argv[1:]),
           "cpu": open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(": \t"),
           "tuned": TUNED, "runs": []}
    for variant in ("plain", "tuned", "plain", "tuned"):
        env = dict(os.environ, **({"GLIBC_TUNABLES": TUNED} if variant == "tuned" else {}))
        got = json.loads(subprocess.run([sys.executable, __file__, "child"], env=env, capture_output=True,
                                        text=True, check=True).stdout)
        out["runs"].append({"variant": variant, "ms_min_median_max": got})
        print(variant, got)
    with open(sys.argv[1], "w") as fh:
        json.dump(out, fh, indent=1)

"""What a replay's integrity check costs: every file of a golden hashed against its manifest
(`vd.store.read.Golden.check_files`, run by a replay on a thread while its model loads), timed.

    python tools/bench_integrity.py GOLDEN... --out tools/bench_integrity.json [--reps 5]

For each golden: its size, its file count, the median and every sample of opening it (the ID and the
files' sizes checked) and of hashing every file, in this process, the files in the page cache after the
first repetition (as a replay finds a golden it has just been given).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import checkout  # noqa: F401,E402  (the checkout's vd first on sys.path)

from vd.store import open_golden


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("goldens", nargs="+")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    rows = []
    for where in a.goldens:
        opens, checks = [], []
        for _ in range(a.reps):
            t = time.perf_counter()
            g = open_golden(where)
            opens.append(time.perf_counter() - t)
            t = time.perf_counter()
            g.check_files()
            checks.append(time.perf_counter() - t)
            g.close()
        size = sum(s for s, _ in g.manifest.values())
        rows.append({"golden": where, "files": len(g.manifest), "bytes": size,
                     "open_ms_median": 1e3 * statistics.median(opens),
                     "check_ms_median": 1e3 * statistics.median(checks),
                     "check_mb_per_s": size / 1e6 / statistics.median(checks),
                     "open_ms": [1e3 * x for x in opens], "check_ms": [1e3 * x for x in checks]})
        print(json.dumps({k: v for k, v in rows[-1].items() if not isinstance(v, list)}))
    a.out.write_text(json.dumps({"command": " ".join(shlex.quote(x) for x in [sys.executable, *sys.argv]),
                                 "date": time.strftime("%Y-%m-%d"), "goldens": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()

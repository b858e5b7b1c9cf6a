"""A suite of N goldens of one model replayed in one process (`vd replay --suite`, the model loaded once)
against the same N goldens replayed one process each (`vd replay GOLDEN`), as CI would run them.

    python tools/bench_suite.py --out tools/bench_suite.json [--model smollm2] [--goldens 3] [--steps 8] [--reps 2]

Both are run as the CLI runs (subprocesses, wall time from start to exit), interleaved, ``--reps`` times;
the JSON holds every run, the medians, their ratio and the command that made it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from figures import cpu_model, load_average, provenance

PROMPTS = ["Explain how speculative decoding speeds up a large language model.",
           "Write one sentence about the sea.", "List three uses of a hash table.",
           "Describe a rainy morning in a city.", "Why do compilers inline small functions?"]


def _vd(*args: str, cwd: Path) -> float:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "vd", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"vd {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--goldens", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    started = provenance()
    with tempfile.TemporaryDirectory(prefix="vd-bench-suite-") as tmp:
        root = Path(tmp)
        names = [f"g{i}" for i in range(a.goldens)]
        (root / "vd.toml").write_text(f'[defaults]\nmodel = "{a.model}"\nsteps = {a.steps}\n' + "".join(
            f'[goldens.{n}]\npath = "goldens/{n}.zarr"\nprompt = "{PROMPTS[i % len(PROMPTS)]}"\n'
            for i, n in enumerate(names)))
        record_s = _vd("record", "--suite", cwd=root)
        suite, single = [], []
        for _ in range(a.reps):
            suite.append(_vd("replay", "--suite", cwd=root))
            single.append(sum(_vd("replay", f"goldens/{n}.zarr", cwd=root) for n in names))
    result = {
        "command": " ".join(shlex.quote(x) for x in [sys.executable, *sys.argv]),
        "model": a.model, "goldens": a.goldens, "steps": a.steps, "reps": a.reps,
        "record_suite_s": record_s,
        "suite_replay_s": suite, "single_replays_s": single,
        "suite_median_s": statistics.median(suite), "single_median_s": statistics.median(single),
        "ratio_single_over_suite": statistics.median(single) / statistics.median(suite),
        "machine": {"cpu_model": cpu_model(), "cpu_count": os.cpu_count()},
        "date": time.strftime("%Y-%m-%d"),
        **started, "load_after": load_average(),
    }
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}, indent=2))


if __name__ == "__main__":
    main()

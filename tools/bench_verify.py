"""Benchmark: what ``vd replay --verify`` (every stored row read and checked against its digest and statistics
before the replay) costs on the default golden: whole ``vd replay`` processes with and without it, interleaved,
their seconds and the ratio repetition by repetition. Writes JSON.

    python tools/bench_verify.py --out tools/bench_verify.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import checkout  # noqa: F401  (the checkout's vd first on sys.path)
from figures import cpu_model, load_average, provenance, ratios, spread


def _replay(golden: Path, *extra: str) -> float:
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "vd", "replay", str(golden), *extra], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"vd replay {' '.join(extra)} exited {done.returncode}: {done.stderr[-500:]}")
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    started = provenance()
    with tempfile.TemporaryDirectory() as d:
        golden = Path(d) / "smollm2.zarr"
        subprocess.run([sys.executable, "-m", "vd", "record", str(golden)], check=True, capture_output=True)
        size = sum(f.stat().st_size for f in golden.rglob("*") if f.is_file())
        _replay(golden)  # the converted weights and the page cache warm for both
        plain, verified = [], []
        for _ in range(args.reps):
            plain.append(_replay(golden))
            verified.append(_replay(golden, "--verify"))
    out = {"benchmark": "bench_verify", "command": " ".join(["python", *sys.argv]),
           "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), **started, "load_after": load_average(),
           "machine": {"cpu_model": cpu_model()}, "golden_bytes": size, "replay_s": spread(plain),
           "replay_verify_s": spread(verified), "ratio": ratios(verified, plain),
           "extra_s": spread([v - q for v, q in zip(verified, plain)])}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"--verify: {out['ratio']['median']:.2f}x a replay (+{out['extra_s']['median']:.2f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()

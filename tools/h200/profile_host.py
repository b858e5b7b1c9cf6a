"""Where a GPU recording's and replay's host time goes: `cProfile` over ``REPS`` recordings and replays of one K
(after a warm-up of each), beside the bare loops `tools/bench_gpu.py` times them against, in one process. Writes
the functions by own time and by cumulative time (the first 60 of each) as text, and the wall times as JSON.

    python3 tools/h200/profile_host.py MODEL FORWARD K OUTDIR [REPS]
"""

from __future__ import annotations

import atexit
import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_gpu  # noqa: E402
import checkout  # noqa: F401,E402
import torch  # noqa: E402

from vd.loop import prepare  # noqa: E402
from vd.models import load_model  # noqa: E402
from vd.recorder import RecordSettings, record  # noqa: E402
from vd.replayer import ReplaySettings  # noqa: E402
from vd.store import open_golden  # noqa: E402
from vd.store.local import finish_removals  # noqa: E402


def main() -> None:
    name, forward, k, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    reps = int(sys.argv[5]) if len(sys.argv) > 5 else 5
    device = torch.device(os.environ.get("DEVICE", "cuda"))  # (DEVICE=cpu: to try the script here)
    model = load_model(name, device=device, dtype="bfloat16")
    model.set_forward(forward)
    prompt = model.encode("Verify.")
    prepare(model, len(prompt), 16, [k])
    path = Path(tempfile.mkdtemp(prefix="vd-profile-")) / "g.zarr"
    atexit.register(shutil.rmtree, path.parent, ignore_errors=True)
    settings = RecordSettings(model=name, prompt="Verify.", ks=(k,), steps=16, forward=forward, allow_thin=True)
    replay_settings = ReplaySettings(forwards=(forward,), control=False)
    record(path, settings, refresh=True, model=model)
    finish_removals()
    bench_gpu.timed_replay(path, replay_settings, model)
    steps = open_golden(path).checked_log(k).steps
    times: dict[str, list[float]] = {}
    profiles = {"record": cProfile.Profile(), "replay": cProfile.Profile()}
    for _ in range(reps):
        t = time.perf_counter()
        with profiles["record"]:
            done = record(path, settings, refresh=True, model=model)
        times.setdefault("record_ms", []).append(1e3 * (time.perf_counter() - t))
        for part, s in {**done.seconds, **{f"part_{n}": v for n, v in done.parts.items()}}.items():
            times.setdefault(f"record_{part}_ms", []).append(1e3 * s)
        finish_removals()
        times.setdefault("bare_record_ms", []).append(
            1e3 * (bench_gpu.bare_decode(model, prompt, 16 * k + 1) + bench_gpu.bare_verify(model, prompt, steps)[0]))
        with profiles["replay"]:
            s, _, _, r = bench_gpu.timed_replay(path, replay_settings, model)
        times.setdefault("replay_ms", []).append(1e3 * s)
        for phase, sec in r["phases"].items():
            times.setdefault(f"replay_{phase}_ms", []).append(1e3 * sec)
        times.setdefault("bare_replay_ms", []).append(1e3 * bench_gpu.bare_replay(model, prompt, path))
    out.mkdir(parents=True, exist_ok=True)
    for what, prof in profiles.items():
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf)
        stats.sort_stats("tottime").print_stats(60)
        stats.sort_stats("cumulative").print_stats(60)
        (out / f"profile_{what}_k{k}.txt").write_text(buf.getvalue())
    medians = {n: statistics.median(v) for n, v in times.items()}
    cuda = device.type == "cuda"
    (out / f"profile_host_k{k}.json").write_text(json.dumps(
        {"command": "python3 " + " ".join(sys.argv), "gpu": cuda and torch.cuda.get_device_name(),
         "gpu_id": cuda and bench_gpu.gpu_id(device), "medians_ms": medians, "samples_ms": times}, indent=1))
    print(json.dumps({n: round(v, 2) for n, v in medians.items()}), flush=True)


if __name__ == "__main__":
    main()

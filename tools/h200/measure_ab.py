"""A/B of `vd.rowmath.measure_differing` on a GPU, in one process, interleaved: ``old`` (a copy of the module at
an earlier commit, its path given: ``git show 8dadda1:vd/rowmath.py > OLD``), whose histogram of differing places
listed them (``nonzero``: the host waits for the count) and read back twice, against ``new`` (this checkout's: the
histogram from per-column sums, one read-back). Two figures each:

* ``micro``: one call on ``[D, V]`` bf16 rows that differ nearly everywhere (a verify row against a decode row of
  another kernel), from launch to the figures on the host; median of ``REPS * 10`` calls per D.
* ``replay``: `vd.replayer.replay` of a golden of ``MODEL`` at each K (reference feed, ``FORWARD``, 16 steps; its
  own verify-vs-decode pairs measured where their digests differ) with the old or the new function in both
  places that call it (`vd.equivalence`, `vd.replayer.measure`), the replay's ``compare`` phase and its whole
  time (as `tools/bench_gpu.py` times it), and the pairs that differed.

    python3 tools/h200/measure_ab.py OLD MODEL FORWARD OUT.json [REPS]
"""

from __future__ import annotations

import atexit
import importlib.util
import json
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

import vd.equivalence as E  # noqa: E402
import vd.replayer.measure as M  # noqa: E402
from vd import rowmath  # noqa: E402
from vd.dtypes import int_view  # noqa: E402
from vd.loop import prepare  # noqa: E402
from vd.models import load_model  # noqa: E402
from vd.policy import Spec  # noqa: E402
from vd.recorder import RecordSettings, record  # noqa: E402
from vd.replayer import ReplaySettings  # noqa: E402
from vd.store.local import finish_removals  # noqa: E402


def _old(path: str):
    spec = importlib.util.spec_from_file_location("rowmath_old", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.measure_differing


def micro(variants: dict, reps: int, vocab: int) -> dict:
    out = {}
    for d in (8, 32):
        g = torch.randn(d, vocab, device="cuda").to(torch.bfloat16)
        c = (g.float() + 0.01 * torch.randn_like(g.float())).to(torch.bfloat16)
        gb = int_view(g).clone()
        times: dict[str, list[float]] = {n: [] for n in variants}
        for _ in range(reps * 10):
            for name, fn in variants.items():
                torch.cuda.synchronize()
                t = time.perf_counter()
                fn(gb, c, "bfloat16", Spec("exact", "exact"))
                times[name].append(1e3 * (time.perf_counter() - t))
        out[f"D={d}"] = {n: {"median_ms": statistics.median(v), "min_ms": min(v)} for n, v in times.items()}
        print(f"micro D={d}: " + ", ".join(f"{n} {statistics.median(v):.3f} ms" for n, v in times.items()), flush=True)
    return out


def whole(variants: dict, model_name: str, forward: str, reps: int) -> dict:
    model = load_model(model_name, device=torch.device("cuda"), dtype="bfloat16")
    model.set_forward(forward)
    prompt = model.encode("Verify.")
    prepare(model, len(prompt), 16, [2, 3, 4])
    tmp, out = Path(tempfile.mkdtemp(prefix="vd-measure-ab-")), {}
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    for k in (2, 3, 4):
        path = tmp / f"k{k}.zarr"
        record(path, RecordSettings(model=model_name, prompt="Verify.", ks=(k,), steps=16, forward=forward,
                                    allow_thin=True), refresh=True, model=model)
        finish_removals()
        settings = ReplaySettings(forwards=(forward,), control=False)
        samples: dict[str, list[float]] = {}
        pairs = None
        for rep in range(reps + 1):  # the first of each is a warm-up
            for name, fn in variants.items():
                E.measure_differing = M.measure_differing = fn
                s, _, _, r = bench_gpu.timed_replay(path, settings, model)
                bare = bench_gpu.bare_replay(model, prompt, path)
                if rep:
                    samples.setdefault(f"{name}_replay_ms", []).append(1e3 * s)
                    samples.setdefault(f"{name}_compare_ms", []).append(1e3 * r["phases"]["compare"])
                    samples.setdefault(f"{name}_ratio", []).append(s / bare)
                pairs = pairs or _pairs(r)
        out[f"K={k}"] = {"pairs": pairs, **{n: statistics.median(v) for n, v in samples.items()}, "samples": samples}
        print(f"K={k} pairs {pairs}: " + ", ".join(f"{n} {statistics.median(v):.3f}" for n, v in samples.items()),
              flush=True)
    return out


def _pairs(report: dict) -> list:
    """(rows, identical) of the golden's own verify-vs-decode pairs and the candidate's, per K."""
    found = []
    for run in report.get("verify", []):
        eq = run.get("equivalence") or {}
        found += [(e["rows"], e["identical"]) for e in [eq.get("golden"), *eq.get("forwards", [])] if e]
    return found


def main() -> None:
    old_path, model_name, forward, out = sys.argv[1:5]
    reps = int(sys.argv[5]) if len(sys.argv) > 5 else 5
    variants = {"old": _old(old_path), "new": rowmath.measure_differing}
    result = {"command": "python3 " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
              "gpu_id": bench_gpu.gpu_id(torch.device("cuda")), "micro": micro(variants, reps, 151936),
              "replay": whole(variants, model_name, forward, reps)}
    Path(out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Where a GPU recording's store tail goes, function by function (issue 34 target 3): ``--reps`` recordings of one K
(16 steps, prompt 'Verify.') over the last, each wrapped function's seconds per recording (a function's time includes
what it calls), medians over the repetitions after the first.

    python3 tools/h200/tail_parts.py qwen2.5-0.5b-shape compiled-graphed OUT.json [REPS [DEVICE]]

``SETTLE_BEFORE_DRAIN=1``: the writer's drains wait 20 ms first (untimed in their parts below), so that what
``_Worker.receive`` then takes is reading the answers, not waiting for the processes.
"""

from __future__ import annotations

import collections
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # wall_parts, also under `python3 -P`
import checkout  # noqa: F401,E402
from wall_parts import ACC, COUNT, wrap  # noqa: E402

import vd.store.journal as JR  # noqa: E402
import vd.store.processes as P  # noqa: E402
import vd.store.write as W  # noqa: E402
from vd.models import load_model  # noqa: E402
from vd.store.local import finish_removals  # noqa: E402

rec = importlib.import_module("vd.recorder.record")


def wrap_all() -> None:
    """Every part timed, wrapped (and with ``SETTLE_BEFORE_DRAIN`` the drains delayed)."""
    for n in ("check_target", "_journal", "_meta", "_finished", "_own_equivalence", "_read_back_equivalence",
              "keep_artifacts", "_record_decode", "_record_k"):
        wrap(rec, n, n)
    wrap(rec, "GoldenWriter", "GoldenWriter()")
    if os.environ.get("SETTLE_BEFORE_DRAIN"):  # 20 ms for the workers: is what is left reading answers? (no: 08686e5)
        drain = W.GoldenWriter._drain

        def settled(self):
            time.sleep(0.02)
            return drain(self)

        W.GoldenWriter._drain = settled
    for n in ("_finish_k", "_send_files", "_small", "_drain", "publish", "abort"):
        wrap(W.GoldenWriter, n, "GoldenWriter." + n)
    for n in ("finish", "write", "hand", "_send"):
        wrap(W.KRows, n, "KRows." + n)
    wrap(W._RowArray, "create", "_RowArray.create")
    wrap(W, "seal", "seal")
    wrap(JR.Journal, "finished", "Journal.finished")
    wrap(P.WriterPool, "submit", "WriterPool.submit")
    wrap(P.WriterPool, "copy_in", "WriterPool.copy_in")
    wrap(P.WriterPool, "collect", "WriterPool.collect")
    wrap(P._Worker, "send", "_Worker.send")
    wrap(P._Worker, "receive", "_Worker.receive")


def main() -> None:
    model_name, forward, out = sys.argv[1], sys.argv[2], sys.argv[3]
    reps = int(sys.argv[4]) if len(sys.argv) > 4 else 6
    device = sys.argv[5] if len(sys.argv) > 5 else "cuda"
    wrap_all()
    m = load_model(model_name, device=device, dtype="bfloat16")
    path = Path(tempfile.mkdtemp()) / "g.zarr"
    settings = rec.RecordSettings(model=model_name, ks=(2,), steps=16, prompt="Verify.", allow_thin=True,
                                  forward=forward, device=device)
    samples: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(reps):
        ACC.clear()
        COUNT.clear()
        t = time.perf_counter()
        r = rec.record(path, settings, refresh=path.exists(), model=m)
        total = time.perf_counter() - t
        finish_removals()
        samples["total"].append(total * 1e3)
        for k, v in {**{f"seconds.{a}": b for a, b in r.seconds.items()},
                     **{f"parts.{a}": b for a, b in r.parts.items()}, **ACC}.items():
            samples[k].append(v * 1e3)
        samples["calls"].append(dict(COUNT))  # type: ignore[arg-type]
    med = {k: round(statistics.median(v[1:]), 3) for k, v in samples.items() if k != "calls"}
    doc = {"command": " ".join(["python3", *sys.argv]), "model": model_name, "forward": forward,
           "median_ms_after_first": dict(sorted(med.items(), key=lambda kv: -kv[1])),
           "calls": samples["calls"][-1], "samples_ms": {k: v for k, v in samples.items() if k != "calls"}}
    Path(out).write_text(json.dumps(doc, indent=1))
    for k, v in doc["median_ms_after_first"].items():
        print(f"{k:36s} {v:10.3f}")


if __name__ == "__main__":
    main()

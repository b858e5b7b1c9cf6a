"""A/B of what a GPU recording's run does when it hands a step's rows over (`vd.store.write.KRows.hand`), in one
process, interleaved: ``later`` (as committed since 727a9ed: the K's metadata and the run before's small files are
the writer's `later` work, a unit each hand-over) and ``now`` (that work done when it is queued: the metadata in the
first hand-over, the files between the runs, as at 726ce17); per configuration the medians of the recording's whole
time, its runs, its store tail, and the bare loop of the same model calls beside them. (At 08686e5 the A/B was
``ahead``, the metadata written at the first hand-over, against ``neither``, written by `KRows.finish`: 81.5
against 86.8 ms, tools/h200/hand_ab_05b_*.json; that run also had ``read`` and ``both``: the writer processes'
answers read as they came, ``WriterPool.take_ready``, removed after it for saving nothing.)

    python3 tools/h200/hand_ab.py qwen2.5-0.5b-shape compiled-graphed OUT.json [REPS [DEVICE]]

``AB=hand`` (5711e33): ``hand``, each step's rows handed to the writer processes as the run logs them (as
committed), against ``nohand``, the run's hold handing nothing (`vd.recorder.record._Settled.hold` without
``each``: the rows and the K's documents written once the run ends, as without writer processes): what the
hand-over costs the runs, and what it saves the tail.

(``AB=artifacts``, as at bd07c04, whose recorder handed them early since 1585ad7: the Inductor artifacts
handed before the runs against in the publish, both written by a writer process; tools/h200/artifacts_ab_05b_cg.json:
no difference beyond the noise, recording 80.1 against 78.2 ms, so the recorder hands them in the publish again.)
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_gpu  # noqa: E402
import checkout  # noqa: F401,E402

import vd.store.write as W  # noqa: E402
from vd.loop import Hold, hold_bytes  # noqa: E402
from vd.models import load_model  # noqa: E402
from vd.store import open_golden  # noqa: E402
from vd.store.local import finish_removals  # noqa: E402

rec = importlib.import_module("vd.recorder.record")
LATER = W.GoldenWriter.later
HOLD = rec._Settled.hold
AB = os.environ.get("AB", "later")


def now(self, units) -> None:
    self._later.extend(units)
    self.catch_up()


def no_hand(self, device) -> Hold:
    return Hold(hold_bytes(device), self.add, None)


def configure(name: str) -> None:
    if AB == "hand":
        rec._Settled.hold = HOLD if name == "hand" else no_hand
    else:
        W.GoldenWriter.later = LATER if name == "later" else now


def once(path: Path, settings, m) -> dict:
    t = time.perf_counter()
    r = rec.record(path, settings, refresh=path.exists(), model=m)
    total = time.perf_counter() - t
    finish_removals()
    tail = r.seconds["store"] + r.seconds["write"] + r.seconds["equivalence"]
    return {"total": total, "runs": r.seconds["continuation"] + r.seconds["verify"], "tail": tail,
            "loop": total - tail}


def main() -> None:
    model_name, forward, out = sys.argv[1], sys.argv[2], sys.argv[3]
    reps = int(sys.argv[4]) if len(sys.argv) > 4 else 7
    device = sys.argv[5] if len(sys.argv) > 5 else "cuda"
    m = load_model(model_name, device=device, dtype="bfloat16")
    path = Path(tempfile.mkdtemp()) / "g.zarr"
    atexit.register(shutil.rmtree, path.parent, ignore_errors=True)
    settings = rec.RecordSettings(model=model_name, ks=(2,), steps=16, prompt="Verify.", allow_thin=True,
                                  forward=forward, device=device)
    names = ("hand", "nohand") if AB == "hand" else ("later", "now")
    samples: dict[str, dict[str, list[float]]] = {n: {} for n in (*names, "bare")}
    for n in names:  # warm-up
        configure(n)
        once(path, settings, m)
    prompt, steps = m.encode("Verify."), open_golden(path).checked_log(2).steps
    for _ in range(reps):
        for n in names:
            configure(n)
            for key, v in once(path, settings, m).items():
                samples[n].setdefault(key, []).append(v * 1e3)
        bare = bench_gpu.bare_decode(m, prompt, 16 * 2 + 1) + bench_gpu.bare_verify(m, prompt, steps)[0]
        samples["bare"].setdefault("total", []).append(bare * 1e3)
    med = {n: {k: round(statistics.median(v), 3) for k, v in s.items()} for n, s in samples.items()}
    run = [*([f"AB={AB}"] if "AB" in os.environ else []), "python3", *sys.argv]
    doc = {"command": " ".join(run), "model": model_name, "forward": forward, "reps": reps,
           "median_ms": med, "samples_ms": samples}
    Path(out).write_text(json.dumps(doc, indent=1))
    for n, v in med.items():
        print(f"{n:8s} " + "  ".join(f"{k} {x:8.2f}" for k, x in v.items()))


if __name__ == "__main__":
    main()

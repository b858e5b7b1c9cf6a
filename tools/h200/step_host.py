"""Where a recording's runs lose time to the bare loop, step by step (issue 34, target 3): the host's time in each
step's parts, a `vd record` run's against a bare loop's, interleaved in one process.

    python3 -P tools/h200/step_host.py qwen2.5-0.5b-shape compiled-graphed OUT.json [K ...]

Per step the loop's parts are wrapped and stamped by wall clock (no profiler): ``issue`` (the forward issued, its
rows checked), ``log`` (the step before logged: the hold's hand-over of its rows to the writer processes),
``read`` (the argmax read back: the wait for the GPU). A bare loop (`tools/bench_gpu.py`'s, stamped the same
way) gives the same steps' ``issue`` and ``read``. ``period`` is one step's issue to the next's. The
recording's hand-overs are timed too (``hand``, and ``document``: at 726ce17 the K's metadata written at its
first hand-over; since 727a9ed only queued there as the writer's later work, which ``hand`` includes).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/
sys.path.insert(0, str(Path(__file__).resolve().parent))  # wall_parts, also under `python3 -P`
import checkout  # noqa: F401,E402  (the checkout's vd first on sys.path)
from wall_parts import stamp  # noqa: E402

import vd.loop as L  # noqa: E402
from vd.loop import gc_paused  # noqa: E402
from vd.models import load_model  # noqa: E402
from vd.recorder import RecordSettings, record  # noqa: E402
from vd.store import open_golden  # noqa: E402
from vd.store.local import finish_removals  # noqa: E402
from vd.store.write import KRows  # noqa: E402

STAMPS: list[tuple[str, float, float]] = []

for owner, name, label in ((L, "_issue", "issue"), (L, "_log", "log"), (L, "_read_back", "read"),
                           (KRows, "hand", "hand"), (KRows, "document", "document")):
    stamp(owner, name, label, STAMPS)


@gc_paused()
@torch.inference_mode()
def bare(model, prompt, decodes: int, steps) -> None:
    """bench_gpu's bare decode then bare verify, stamped as vd's loop is."""
    torch.cuda.synchronize()
    model.reset()
    last = model.forward(prompt)[-1].argmax().item()
    for _ in range(decodes - 1):
        t = time.perf_counter()
        rows = model.forward([last])
        STAMPS.append(("issue", t, t2 := time.perf_counter()))
        last = rows[0].argmax().item()
        STAMPS.append(("read", t2, time.perf_counter()))
    model.reset()
    model.forward(prompt)
    for st in steps:
        t = time.perf_counter()
        rows = model.forward(st.tokens)
        STAMPS.append(("issue", t, t2 := time.perf_counter()))
        rows.argmax(dim=-1).tolist()
        STAMPS.append(("read", t2, time.perf_counter()))
        model.rewind(len(st.tokens) - 1 - st.accepted)
    torch.cuda.synchronize()


def steps_of(stamps) -> list[dict]:
    """Per step (one ``issue`` each): its parts' ms and its period (issue to the next issue)."""
    out: list[dict] = []
    for label, a, b in stamps:
        if label == "issue":
            if out:
                out[-1]["period"] = 1e3 * (a - out[-1]["at"])
            out.append({"at": a, "issue": 1e3 * (b - a)})
        elif out:
            out[-1][label] = out[-1].get(label, 0.0) + 1e3 * (b - a)
    return out


def summary(runs: list[list[dict]]) -> dict:
    """Per part: the median over repetitions of each run's sum, and of its largest step."""
    parts = sorted({p for run in runs for st in run for p in st if p != "at"})
    return {p: {"sum_ms": statistics.median(sum(st.get(p, 0.0) for st in run) for run in runs),
                "max_ms": statistics.median(max((st.get(p, 0.0) for st in run), default=0.0) for run in runs)}
            for p in parts}


def main() -> None:
    name, forward, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    ks = [int(k) for k in sys.argv[4:]] or [2, 4]
    model = load_model(name, device="cuda", dtype="bfloat16")
    model.set_forward(forward)
    L.prepare(model, len(model.encode("Verify.")), 16, [2, 3, 4])
    prompt = model.encode("Verify.")
    tmp = Path(tempfile.mkdtemp())
    doc: dict = {"command": "python3 -P tools/h200/step_host.py " + " ".join(sys.argv[1:]), "ks": {}}
    for k in ks:
        path = tmp / f"k{k}.zarr"
        settings = RecordSettings(model=name, prompt="Verify.", ks=(k,), steps=16, forward=forward, allow_thin=True)
        record(path, settings, refresh=True, model=model)  # warm-up
        finish_removals()
        steps = open_golden(path).checked_log(k).steps
        vd_runs, bare_runs, vd_ms, bare_ms = [], [], [], []
        for _ in range(7):
            STAMPS.clear()
            t = time.perf_counter()
            done = record(path, settings, refresh=True, model=model)
            vd_ms.append({n: 1e3 * s for n, s in done.seconds.items()} | {"whole": 1e3 * (time.perf_counter() - t)})
            vd_runs.append(steps_of(STAMPS))
            vd_runs[-1] = [{**st, "hand": st.get("hand", 0.0)} for st in vd_runs[-1]]
            extra = [(lab, 1e3 * (b - a)) for lab, a, b in STAMPS if lab in ("hand", "document")]
            finish_removals()
            STAMPS.clear()
            t = time.perf_counter()
            bare(model, prompt, 16 * k + 1, steps)
            bare_ms.append(1e3 * (time.perf_counter() - t))
            bare_runs.append(steps_of(STAMPS))
        doc["ks"][k] = {"vd": summary(vd_runs), "bare": summary(bare_runs), "vd_seconds_ms": vd_ms,
                        "bare_ms": bare_ms, "last_hands_ms": extra,
                        "vd_last_steps": [{p: round(v, 3) for p, v in st.items() if p != "at"}
                                          for st in vd_runs[-1]],
                        "bare_last_steps": [{p: round(v, 3) for p, v in st.items() if p != "at"}
                                            for st in bare_runs[-1]]}
        print(k, json.dumps({"vd": doc["ks"][k]["vd"], "bare": doc["ks"][k]["bare"]}), flush=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()

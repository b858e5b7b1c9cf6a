"""What a GPU recording's publish waits for (issue 34 target 3): the writer processes' jobs on one clock with the
recording's own parts, after its K run's end. ``--reps`` recordings of one K (16 steps, prompt 'Verify.') over the
last; each job's sending, reading, start, end and answer read (the processes are `timed_chunkfiles.py`, stamping
their answers), relative to the K run's end (`_finished` called), and the recording's parts on the same clock.

    python3 tools/h200/writer_timeline.py qwen2.5-0.5b-shape graphed OUT.json [REPS [DEVICE]]

``IDLE_S=x`` sleeps x seconds before each recording (the writer processes left idle, as `tools/bench_gpu.py`
leaves them while it replays and runs its bare loops); each job's ``waited`` is its sending to its reading.
"""

from __future__ import annotations

import collections
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # wall_parts, also under `python3 -P`
import checkout  # noqa: F401,E402
from wall_parts import stamp  # noqa: E402

import vd.store.processes as P  # noqa: E402
import vd.store.write as W  # noqa: E402
from vd.models import load_model  # noqa: E402
from vd.store.local import finish_removals  # noqa: E402

rec = importlib.import_module("vd.recorder.record")
TIMED = str(Path(__file__).resolve().parent / "timed_chunkfiles.py")
EVENTS: list[tuple[str, float, float]] = []
SENT: dict[int, tuple[float, str]] = {}
DONE: dict[int, tuple[float, tuple[float, float, float]]] = {}


def _popen(args, **kw):
    if list(args[1:]) == ["-m", "vd.chunkfiles"]:
        args = [args[0], TIMED]
    return subprocess.Popen(args, **kw)


def _what(job: dict) -> str:
    if "files" in job:
        return f"files x{len(job['files'])} ({job['files'][0][0]}, ...)"
    if "file" in job:
        return f"file {job['file'][0]}, {job['file'][2]} bytes"
    chunks = [f"{name}[{index}] rows {b - a}" for name, index, a, b, _, _ in job["chunks"]]
    return f"{job['group']} {', '.join(chunks) or 'no chunk'} {job.get('planes', '')}; digest {job.get('digest')}"


def patch() -> None:
    P.subprocess = types.SimpleNamespace(**{**vars(subprocess), "Popen": _popen})
    send, receive = P._Worker.send, P._Worker.receive

    def sent(self, jobs):
        t = time.perf_counter()
        send(self, jobs)
        for i, job in jobs:
            SENT[i] = (t, _what(job))

    def received(self):
        i, answer = receive(self)
        DONE[i] = (time.perf_counter(), answer.pop("t"))
        return i, answer

    P._Worker.send, P._Worker.receive = sent, received
    for n in ("_finished", "_own_equivalence", "keep_artifacts"):
        stamp(rec, n, n, EVENTS)
    for n in ("_finish_k", "publish", "_drain", "_send_files"):
        stamp(W.GoldenWriter, n, n, EVENTS)
    stamp(W, "seal", "seal", EVENTS)


def one(path: Path, settings, model) -> dict:
    time.sleep(float(os.environ.get("IDLE_S", "0")))
    EVENTS.clear()
    SENT.clear()
    DONE.clear()
    t = time.perf_counter()
    r = rec.record(path, settings, refresh=path.exists(), model=model)
    total = time.perf_counter() - t
    finish_removals()
    t0 = [s for label, s, _ in EVENTS if label == "_finished"][-1]  # the K run's end

    def ms(x: float) -> float:
        return round((x - t0) * 1e3, 3)

    jobs = [{"id": i, "what": what, "sent": ms(s), "read": ms(DONE[i][1][0]), "began": ms(DONE[i][1][1]),
             "ended": ms(DONE[i][1][2]), "answer_read": ms(DONE[i][0]),
             "took": round((DONE[i][1][2] - DONE[i][1][1]) * 1e3, 3), "waited": round((DONE[i][1][0] - s) * 1e3, 3)}
            for i, (s, what) in sorted(SENT.items()) if i in DONE and DONE[i][1][2] >= t0]
    events = [{"part": label, "from": ms(s), "to": ms(e)} for label, s, e in sorted(EVENTS, key=lambda x: x[1])
              if e >= t0]
    drains = [e for e in events if e["part"] == "_drain"]
    last = max(jobs, key=lambda j: j["ended"])
    return {"total_ms": total * 1e3, "parts_ms": {k: v * 1e3 for k, v in r.parts.items()},
            "wait_ms": r.parts.get("write_wait", 0.0) * 1e3,
            "jobs_waited_ms": sorted(j["waited"] for j in jobs)[-3:],
            "publish_drain": drains[-1] if drains else None, "last_job": last,
            "row_jobs_took_ms": [j["took"] for j in jobs if "files" not in j["what"]],
            "jobs": jobs, "events": events}


def main() -> None:
    model_name, forward, out = sys.argv[1], sys.argv[2], sys.argv[3]
    reps = int(sys.argv[4]) if len(sys.argv) > 4 else 6
    device = sys.argv[5] if len(sys.argv) > 5 else "cuda"  # elsewhere with VD_WRITER_PROCESSES=N
    patch()
    model = load_model(model_name, device=device, dtype="bfloat16")
    path = Path(tempfile.mkdtemp()) / "g.zarr"
    settings = rec.RecordSettings(model=model_name, ks=(2,), steps=16, prompt="Verify.", allow_thin=True,
                                  forward=forward, device=device)
    runs = [one(path, settings, model) for _ in range(reps)]
    after = runs[1:]
    summary = {
        "idle_s": float(os.environ.get("IDLE_S", "0")),
        "publish_wait_ms": sorted(round(r["wait_ms"], 2) for r in after),
        "jobs_waited_most_ms": [r["jobs_waited_ms"] for r in after],
        "publish_drain_from_ms": statistics.median(r["publish_drain"]["from"] for r in after),
        "publish_drain_to_ms": statistics.median(r["publish_drain"]["to"] for r in after),
        "last_job_ended_ms": statistics.median(r["last_job"]["ended"] for r in after),
        "last_job_took_ms": statistics.median(r["last_job"]["took"] for r in after),
        "last_jobs": collections.Counter(r["last_job"]["what"] for r in after),
        "row_job_took_ms_median": statistics.median(took) if (took := [x for r in after for x in r["row_jobs_took_ms"]])
        else None,  # (none: every row job ended before the K run did, as a small model's on the CPU can)
    }
    doc = {"command": " ".join(["python3", *sys.argv]), "model": model_name, "forward": forward,
           "summary_after_first": summary, "runs": runs}
    Path(out).write_text(json.dumps(doc, indent=1))
    print(json.dumps(summary, indent=1))
    for j in runs[-1]["jobs"]:
        print(f"{j['sent']:8.2f} {j['read']:8.2f} {j['began']:8.2f} {j['ended']:8.2f} {j['answer_read']:8.2f} "
              f"{j['took']:6.2f}  {j['what'][:80]}")
    for e in runs[-1]["events"]:
        print(f"{e['from']:8.2f} {e['to']:8.2f}  {e['part']}")


if __name__ == "__main__":
    main()

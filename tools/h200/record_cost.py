"""Where a recording's time goes on a GPU (the experiment behind tools/h200/record-cost.json): one K's run
timed bare, through vd's loop, with the row hold and the queued summary, and as the recorder runs it (the
rows held, then written after the run: ``record_run`` and ``record_tail``).

    python3 tools/h200/record_cost.py qwen2.5-0.5b-shape graphed OUT.json
"""

from __future__ import annotations

import importlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: bench_gpu's bare loop
import bench_gpu  # noqa: E402
import checkout  # noqa: F401,E402  (the checkout's vd first on sys.path)

from vd.layout import RowLayout  # noqa: E402
from vd.loop import Hold, ReferenceFeed, continuation, hold_bytes, prepare, run_verify  # noqa: E402
from vd.models import load_model  # noqa: E402
from vd.store import GoldenWriter  # noqa: E402
from vd.store import journal as J  # noqa: E402

record = importlib.import_module("vd.recorder.record")
STEPS = 16


def main() -> None:
    model_name, forward, out = sys.argv[1], sys.argv[2], sys.argv[3]
    m = load_model(model_name, device="cuda", dtype="bfloat16")
    m.set_forward(forward)
    prompt = m.encode("Verify.")
    prepare(m, len(prompt), STEPS, [2, 3, 4])
    res = {}
    for k in (2, 4):
        res[k] = measure_k(m, prompt, k)
        print(k, {n: round(statistics.median(v), 1) for n, v in res[k].items()}, flush=True)
    what = ("milliseconds of one K's run (16 steps, prompt 'Verify.') per way of running it, 5 interleaved "
            "repetitions: bare = the bare verify loop; loop = vd.loop.run_verify with no hold; hold = plus the row "
            "hold and the summary queued behind the last step; record_run = the run as the recorder runs it (hold, "
            "summary, a golden writer and its journal open); record_tail = what the recorder does after it (the "
            "held rows written, the K's metadata)")
    doc = {"command": f"python3 tools/h200/record_cost.py {model_name} {forward} OUT.json", "what": what, "ms": res}
    Path(out).write_text(json.dumps(doc, indent=1) + "\n")


def measure_k(m, prompt, k: int) -> dict[str, list[float]]:
    greedy = continuation(m, prompt, STEPS * k + 1)
    ref = run_verify(m, prompt, k, STEPS, ReferenceFeed(greedy))
    layout = RowLayout(len(prompt), STEPS, k)

    def timed(fn) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    def held_run(rows=None):
        settled = record._Settled(layout, rows)
        run = run_verify(m, prompt, k, STEPS, ReferenceFeed(greedy), hold=Hold(hold_bytes(m.device), settled.add),
                         on_last=settled.queue)
        return run, settled

    def summarised():
        settled = held_run()[1]
        settled.summary.result()

    def recorded() -> tuple[float, float]:
        d = Path(tempfile.mkdtemp())
        w = GoldenWriter(d / "g.zarr")
        w.journal = J.Journal(d / ".g.zarr.journal", {"experiment": 1})
        out = []
        run_s = timed(lambda: out.append(held_run(w.rows(layout, m.vocab_size, m.dtype))))
        t = time.perf_counter()
        run, settled = out[0]
        log, summary, _ = record._finished(run, True, settled)
        settled.rows.finish(log, summary)
        tail = time.perf_counter() - t
        w.abort()
        return run_s, tail

    names = ("bare", "loop", "hold", "record_run", "record_tail")
    r: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(5):
        r["bare"].append(bench_gpu.bare_verify(m, prompt, ref.steps)[0])
        r["loop"].append(timed(lambda: run_verify(m, prompt, k, STEPS, ReferenceFeed(greedy))))
        r["hold"].append(timed(summarised))
        a, b = recorded()
        r["record_run"].append(a)
        r["record_tail"].append(b)
    return {n: [x * 1e3 for x in v] for n, v in r.items()}


if __name__ == "__main__":
    main()

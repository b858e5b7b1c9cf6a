"""Where a recording's time goes on a GPU (the experiment behind tools/h200/record-cost.json): one K's run
timed bare, through vd's loop, with the row hold and the queued summary, and with a golden writer streaming
its rows beside it in several variants (see the JSON's ``what``).

    python3 -P tools/h200/record_cost.py qwen2.5-0.5b-shape graphed OUT.json
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
    Path(out).write_text(json.dumps(res, indent=1) + "\n")


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

    def held_run(sink=None):
        settled = record._Settled(layout)
        run_verify(m, prompt, k, STEPS, ReferenceFeed(greedy), sink=sink,
                   hold=Hold(hold_bytes(m.device), settled.add), on_last=settled.queue)
        settled.summary.result()

    def streamed(journal: bool = False, write: bool = True) -> tuple[float, float]:
        d = Path(tempfile.mkdtemp())
        w = GoldenWriter(d / "g.zarr", background=True)
        if journal:
            w.journal = J.Journal(d / ".g.zarr.journal", {"experiment": 1})

        def go():
            stream = w.stream(layout, m.vocab_size, m.dtype, m.device)
            if not write:
                stream._write = lambda *a: None
            held_run(stream.put)

        dt = timed(go)
        t = time.perf_counter()
        w._drain()
        drain = time.perf_counter() - t
        w.abort()
        return dt, drain

    names = ("bare", "loop", "hold", "stream", "stream_drain", "stream_nowrite", "stream_switch", "stream_journal")
    r: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(5):
        r["bare"].append(bench_gpu.bare_verify(m, prompt, ref.steps)[0])
        r["loop"].append(timed(lambda: run_verify(m, prompt, k, STEPS, ReferenceFeed(greedy))))
        r["hold"].append(timed(held_run))
        a, b = streamed()
        r["stream"].append(a)
        r["stream_drain"].append(b)
        r["stream_nowrite"].append(streamed(write=False)[0])
        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-4)
        r["stream_switch"].append(streamed()[0])
        sys.setswitchinterval(old)
        r["stream_journal"].append(streamed(journal=True)[0])
    return {n: [x * 1e3 for x in v] for n, v in r.items()}


if __name__ == "__main__":
    main()

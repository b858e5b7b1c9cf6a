"""How fast a recording's store writes a run's rows after it (the tail `vd.store.write.KRows` leaves), by
number of writer threads, and what one chunk's parts cost on one thread: the experiment behind
tools/h200/writer-threads.json.

    python3 tools/h200/writer_threads.py OUT.json
"""

from __future__ import annotations

import hashlib
import importlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import checkout  # noqa: F401,E402  (the checkout's vd first on sys.path)
import torch

import vd.store.write as W
from vd.dtypes import to_storage
from vd.layout import RowLayout
from vd.loop import Hold, ReferenceFeed, continuation, hold_bytes, prepare, run_verify
from vd.models import load_model
from vd.store import GoldenWriter
from vd.store import format as F
from vd.store import journal as J
from vd.store.chunks import encode_chunk

record = importlib.import_module("vd.recorder.record")
MODEL, STEPS, K = "qwen2.5-0.5b-shape", 16, 2


def main() -> None:
    m = load_model(MODEL, device="cuda", dtype="bfloat16")
    m.set_forward("graphed")
    prompt = m.encode("Verify.")
    prepare(m, len(prompt), STEPS, [K])
    greedy = continuation(m, prompt, STEPS * K + 1)
    layout = RowLayout(len(prompt), STEPS, K)

    def tail_ms() -> float:
        d = Path(tempfile.mkdtemp())
        w = GoldenWriter(d / "g.zarr")
        w.journal = J.Journal(d / ".g.zarr.journal", {"experiment": 1})
        settled = record._Settled(layout, w.rows(layout, m.vocab_size, m.dtype))
        run = run_verify(m, prompt, K, STEPS, ReferenceFeed(greedy), hold=Hold(hold_bytes(m.device), settled.add),
                         on_last=settled.queue)
        t = time.perf_counter()
        for kind, start, rows in run.held():
            settled.rows.write(kind, start, rows)
        dt = time.perf_counter() - t
        w.abort()
        return dt * 1e3

    threads = {}
    for n in (1, 2, 4, 8, 16):
        W.WRITERS = n
        threads[n] = [tail_ms() for _ in range(5)]
        print(n, round(statistics.median(threads[n]), 1), flush=True)
    x = to_storage(torch.randn(K, m.vocab_size).bfloat16())
    hi, lo = F.split_planes(x)
    lo_bytes = encode_chunk(lo, None)

    def one(fn, n: int = 30) -> float:
        fn()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n * 1e3

    parts = {"split_planes": one(lambda: F.split_planes(x)),
             "encode_hi_zstd1": one(lambda: encode_chunk(hi, "zstd")),
             "encode_lo": one(lambda: encode_chunk(lo, None)),
             "sha256_lo": one(lambda: hashlib.sha256(lo_bytes).digest()),
             "write_lo": one(lambda: Path(tempfile.gettempdir(), "vd-lo").write_bytes(lo_bytes))}
    doc = {"command": "python3 tools/h200/writer_threads.py OUT.json",
           "what": f"{MODEL} graphed, K={K}, {STEPS} steps (prompt 'Verify.'): milliseconds KRows.write takes for "
                   "the rows a run held (prefill and verify, journal on), 5 repetitions per number of writer "
                   "threads; and one K-row chunk's parts on one thread (ms)",
           "rows_bytes": (len(prompt) + STEPS * K) * m.vocab_size * 2, "tail_ms_by_threads": threads,
           "chunk_parts_ms": parts}
    Path(sys.argv[1]).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()

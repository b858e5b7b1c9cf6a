"""`vd.chunkfiles`'s writer process with each answer stamped (``"t"``: when its message was read, its job
began and ended, by `time.perf_counter`, the system's monotonic clock, which the recording shares), for
`tools/h200/writer_timeline.py`. The answers are otherwise the process's own."""

from __future__ import annotations

import pickle
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import vd.chunkfiles as C  # noqa: E402


def serve(inp, out) -> None:
    arenas = C._Arenas()
    while True:
        try:
            jobs = pickle.load(inp)
        except EOFError:
            return
        read = time.perf_counter()
        for job in jobs:
            began = time.perf_counter()
            try:
                answer = C.do_job(job, arenas)
            except BaseException as e:  # noqa: BLE001
                answer = {"error": (type(e).__name__, str(e), "")}
            answer["t"] = (read, began, time.perf_counter())
            pickle.dump(answer, out, protocol=pickle.HIGHEST_PROTOCOL)
        out.flush()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(sys.stdin.buffer, sys.stdout.buffer)

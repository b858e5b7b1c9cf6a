"""Benchmark: the axes where greedy speculative decoding stops being lossless, measured on the CPU.

For each model: a golden is recorded (``--record-forward``, bf16, K = 2, 3, 4, the default steps), then
replayed under each forward the model offers among ``--forwards``, and the report's table of axes is kept:
per K and forward, the rows compared, the rows bit-identical, the largest |Δ| and ULP, and the argmax flips
of each forward's verify rows against its own decode rows (``verify vs decode``), and of its rows against the
golden's (``golden``). Then, for each batch size of ``--batch`` (2 and 4), the same replay with the golden's
sequence one member of a batch of that many (``vd replay --batch N``, every slot in turn, seed 0) under each
forward that can run a batch: its rows against the golden's (``batch (N=…)`` rows, with the step and slot of
the first difference), and its cost: the seconds of the batched runs against N times those of the runs of
the sequence alone, measured in the same replay. Nothing is judged: the figures are what they are. Writes JSON.

    python tools/bench_axes.py --out tools/bench_axes.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import checkout  # noqa: F401,E402  (the checkout's vd first on sys.path)
import torch
from figures import load_average, provenance

from vd import env, protocol
from vd.models import load_model
from vd.recorder import RecordSettings, record
from vd.replayer import ReplaySettings, replay

MODELS = ("smollm2", "tiny-llama", "tiny-qwen2")
FORWARDS = ("eager", "sdpa", "static")


def _machine() -> dict:
    e = env.capture(torch.device("cpu"))
    return {f: e[f] for f in ("cpu_model", "cpu_capability", "cpu_count", "torch", "transformers", "python",
                              "platform")}


def _finite(x: float) -> float | None:
    return None if math.isnan(x) else x


def axes_of(report) -> list[dict]:
    """Every row of the report's tables of axes, as plain fields (with the ULP and KL figures of the
    verify-vs-decode rows)."""
    out = []
    for v in ([report.decode] if report.decode is not None else []) + list(report.verify):
        firsts = {b.label: b.first_difference for b in v.batch}
        for row in v.axes():
            if v is report.decode and row.axis == "golden":
                continue  # the decode rows against the golden's: in the batch table only as its batch row
            fields = {"k": "decode" if v is report.decode else v.k, "forward": row.forward, "axis": row.axis,
                      "rows": row.rows, "identical": row.identical, "max_abs": row.max_abs, "flips": row.flips,
                      "verdict": row.verdict}
            e = None if v.equivalence is None or row.axis != "verify vs decode" else (
                v.equivalence.golden if row.forward == "golden (recorded)" else v.equivalence.of(row.forward))
            if e is not None:
                fields.update(max_ulp=_finite(e.max_ulp), kl_mean=_finite(e.kl_mean), kl_max=_finite(e.kl_max),
                              first=None if e.first is None else [e.first.step, e.first.row])
            if row.axis in firsts:
                first = firsts[row.axis]
                fields["first_difference"] = None if first is None else {"step": first[0], "slot": first[1]}
            out.append(fields)
    return out


def bench_batch(path: Path, model, forwards: list[str], n: int) -> dict:
    """A replay of ``path`` with ``--batch n`` under each forward of ``forwards`` that can run a batch: its axes and
    the cost of the batched runs against ``n`` times the sequence's runs alone."""
    b = protocol.batched(model)
    can = [f for f in forwards if b is not None and f in b.batch_forwards()]
    if not can:
        return {"n": n, "forwards": [], "axes": []}
    report = replay(str(path), ReplaySettings(forwards=tuple(can), control=False, batch=n), model=model)
    alone = report.phases["run"] + report.phases["wait_golden"] + report.phases["compare"]
    return {"n": n, "forwards": can, "batch_s": report.phases["batch"], "alone_s": alone,
            "cost_ratio": report.phases["batch"] / (n * alone), "companion_prompt_tokens":
            (report.batch or {}).get("companion_prompt_tokens"),
            "axes": [a for a in axes_of(report) if a["axis"].startswith("batch")]}


def bench_model(name: str, forwards: tuple[str, ...], record_forward: str, work: Path, batches: list[int]
                ) -> dict:
    model = load_model(name, device="cpu", dtype="bfloat16")
    offered = [f for f in forwards if f in model.forwards()]
    path = work / f"{name}.zarr"
    t = time.perf_counter()
    record(str(path), RecordSettings(model=name, forward=record_forward, dtype="bfloat16", threads=1,
                                     allow_thin=True), model=model)
    recorded_s = time.perf_counter() - t
    t = time.perf_counter()
    report = replay(str(path), ReplaySettings(forwards=tuple(offered), control=False), model=model)
    replay_s = time.perf_counter() - t
    return {"model": name, "identity": model.identity().name, "record_forward": record_forward,
            "forwards": offered, "record_s": recorded_s, "replay_s": replay_s,
            "verdict": report.verdict, "axes": axes_of(report),
            "batch": [bench_batch(path, model, offered, n) for n in batches]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--forwards", nargs="+", default=list(FORWARDS))
    ap.add_argument("--record-forward", default="eager")
    ap.add_argument("--batch", nargs="*", type=int, default=[2, 4], help="batch sizes (none: no batch axis)")
    args = ap.parse_args(argv)
    started = provenance()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [bench_model(m, tuple(args.forwards), args.record_forward, Path(tmp), args.batch) for m in args.models]
    out = {"command": "python tools/bench_axes.py " + " ".join(sys.argv[1:]), **started,
           "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "machine": _machine(),
           "load_after": load_average(), "dtype": "bfloat16", "threads": 1, "runs": runs}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

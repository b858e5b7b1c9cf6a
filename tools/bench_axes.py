"""Benchmark: the axes where greedy speculative decoding stops being lossless, measured on the CPU.

For each model: a golden is recorded (``--record-forward``, bf16, K = 2, 3, 4, the default steps), then
replayed under each forward the model offers among ``--forwards``, and the report's table of axes is kept:
per K and forward, the rows compared, the rows bit-identical, the largest |Δ| and ULP, and the argmax flips
of each forward's verify rows against its own decode rows (``verify vs decode``), and of its rows against the
golden's (``golden``). Then, for each forward that can run a batch, a golden of that forward, replayed under it
with its sequence one member of a batch of N for each N of ``--batch`` (2 and 4; ``vd replay --batch N``, every
slot in turn, seed 0): its rows in the batch against its own alone (``batch (N=…)`` rows, with the step and
slot of the first difference), and the cost: the seconds of the batched runs against N times those of the
runs of the sequence alone, measured in the same replay. Nothing is judged: the figures are what they are. Writes JSON.

    python tools/bench_axes.py --out tools/bench_axes.json
    python3 tools/bench_axes.py --device cuda --models qwen2.5-0.5b-shape llama3-8b-shape \
        --forwards graphed compiled-graphed sdpa --record-forward graphed --batch 8 --prompt Verify. --steps 8 \
        --out tools/h200/bench_axes.json      # on the H200
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
from vd.models.presets import smollm2_path
from vd.recorder import RecordSettings, record
from vd.replayer import ReplaySettings, replay

MODELS = ("smollm2", "tiny-llama", "tiny-qwen2", "llamacpp-smollm2")
FORWARDS = ("eager", "sdpa", "static", "cpu", "cpu-flash")  # each model runs those it offers (llama.cpp: cpu*)
LLAMACPP = "llamacpp-smollm2"  # the default model's GGUF run by llama.cpp (`llamacpp:PATH`)


def _machine(device: str) -> dict:
    e = env.capture(torch.device(device))
    return {f: e.get(f) for f in ("cpu_model", "cpu_capability", "cpu_count", "gpu_name", "cuda", "torch",
                                  "transformers", "python", "platform")}


def _finite(x: float) -> float | None:
    return None if math.isnan(x) else x


def axes_of(report) -> list[dict]:
    """Every row of the report's tables of axes, as plain fields (with the ULP and KL figures of the
    verify-vs-decode rows)."""
    out = []
    for v in ([report.decode] if report.decode is not None else []) + list(report.verify):
        firsts = {(b.forward, b.label): b.first_difference for b in v.batch}
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
            if (row.forward, row.axis) in firsts:
                first = firsts[row.forward, row.axis]
                fields["first_difference"] = None if first is None else {"step": first[0], "slot": first[1]}
            out.append(fields)
    return out


def _record(path: Path, spec: str, model, forward: str, args: argparse.Namespace) -> float:
    """Record a golden of ``model`` under ``forward`` at ``path``; its seconds."""
    t = time.perf_counter()
    extra = {"prompt": args.prompt} if args.prompt else {}
    record(str(path), RecordSettings(model=spec, forward=forward, dtype="bfloat16", device=args.device,
                                     threads=1 if args.device == "cpu" else None, steps=args.steps,
                                     allow_thin=True, **extra), model=model)
    return time.perf_counter() - t


def bench_batch(path: Path, model, forward: str, n: int) -> dict:
    """A replay of ``path`` (a golden of ``forward``) with ``--batch n`` under ``forward``: its batch axes and the
    cost of the batched runs against ``n`` times the sequence's runs alone."""
    report = replay(str(path), ReplaySettings(forwards=(forward,), control=False, batch=n), model=model)
    alone = report.phases["run"] + report.phases["wait_golden"] + report.phases["compare"]
    return {"n": n, "forward": forward, "batch_s": report.phases["batch"], "alone_s": alone,
            "cost_ratio": report.phases["batch"] / (n * alone), "companion_prompt_tokens":
            (report.batch or {}).get("companion_prompt_tokens"),
            "axes": [a for a in axes_of(report) if a["axis"].startswith("batch")]}


def bench_model(name: str, args: argparse.Namespace, work: Path) -> dict:
    """A golden of ``name`` under ``--record-forward`` replayed under each forward (the axes); then, per forward that
    can run a batch, a golden of that forward replayed under it with ``--batch N`` for each N (so a row in a batch
    is judged against the same forward's row alone)."""
    spec = f"llamacpp:{smollm2_path()}" if name == LLAMACPP else name
    model = load_model(spec, device=args.device, dtype="bfloat16")
    offered = [f for f in args.forwards if f in model.forwards()]
    record_forward = args.record_forward if args.record_forward in model.forwards() else model.default_forward()
    goldens = {record_forward: work / f"{name}-{record_forward}.zarr"}
    recorded_s = _record(goldens[record_forward], spec, model, record_forward, args)
    t = time.perf_counter()
    report = replay(str(goldens[record_forward]), ReplaySettings(forwards=tuple(offered), control=False), model=model)
    replay_s = time.perf_counter() - t
    b = protocol.batched(model)
    batched = [f for f in offered if b is not None and f in b.batch_forwards()]
    for f in batched:
        if f not in goldens:
            goldens[f] = work / f"{name}-{f}.zarr"
            _record(goldens[f], spec, model, f, args)
    return {"model": name, "identity": model.identity().name, "record_forward": record_forward,
            "forwards": offered, "record_s": recorded_s, "replay_s": replay_s,
            "verdict": report.verdict, "axes": axes_of(report),
            "batch": [bench_batch(goldens[f], model, f, n) for f in batched for n in args.batch]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--forwards", nargs="+", default=list(FORWARDS))
    ap.add_argument("--record-forward", default="eager")
    ap.add_argument("--batch", nargs="*", type=int, default=[2, 4], help="batch sizes (none: no batch axis)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt", default=None, help="default: vd record's")
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    started = provenance()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [bench_model(m, args, Path(tmp)) for m in args.models]
    out = {"command": "python tools/bench_axes.py " + " ".join(sys.argv[1:]), **started,
           "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "machine": _machine(args.device),
           "load_after": load_average(), "device": args.device, "dtype": "bfloat16",
           "threads": 1 if args.device == "cpu" else None, "steps": args.steps, "runs": runs}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark: what ``vd record --trace`` costs, and what ``vd locate`` answers, on one machine.

For each forward of ``--forwards`` (one model, loaded once): golden recordings of it without and with
``--trace`` interleaved ``--reps`` times (whole recordings: the greedy continuation, every K, the store; with
``--trace`` also its traced pass), their seconds and the ratio repetition by repetition, and the golden's bytes
with and without the trace arrays. Then each traced golden is replayed under every other forward of the list
with ``--locate`` (`vd.replayer.replay`, as ``vd replay --forward B --locate`` does), and where its rows differ
the located module is kept, with the seconds the replay took and those its locating took; and ``vd locate
--between`` is run for the same pair in one process. Nothing is judged: the figures are what they are. JSON.

    python tools/bench_trace.py --out tools/bench_trace.json                        # CPU, SmolLM2
    python3 tools/bench_trace.py --device cuda --model llama3-8b-shape --forwards graphed compiled-graphed \
        --prompt Verify. --out $OUT/bench_trace_8b.json                              # on the H200
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import checkout  # noqa: F401  (the checkout's vd first on sys.path)
import torch
from figures import load_average, provenance, ratios, spread

from vd import env
from vd.errors import ModelOutputError
from vd.models import load_model
from vd.recorder import RecordSettings, record
from vd.replayer import ReplaySettings, replay
from vd.replayer.locate import locate
from vd.store import format as F
from vd.store import open_golden


def _machine(device: str) -> dict:
    e = env.capture(torch.device(device))
    return {f: e.get(f) for f in ("cpu_model", "cpu_count", "gpu_name", "cuda", "torch", "transformers", "python")}


def _trace_bytes(path: Path) -> int:
    names = (F.TRACE_DIGESTS, F.TRACE_STATS)
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and any(n in f.parts for n in names))


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _record_costs(model, args, forward: str, tmp: Path) -> tuple[dict, Path | None]:
    """Recordings of ``forward`` without and with --trace, interleaved; their figures (with the refusals: a traced
    pass that did not reproduce its rows) and the first traced golden (None where every one was refused)."""
    plain, traced, parts, refused = [], [], [], []
    base = RecordSettings(model=args.model, prompt=args.prompt, ks=tuple(args.k), steps=args.steps, forward=forward,
                          device=args.device, allow_thin=True)
    kept = tmp / f"{forward}-traced.zarr"
    for rep in range(args.reps):
        for trace, out in ((False, plain), (True, traced)):
            path = tmp / f"{forward}-{rep}-{trace}.zarr"
            t = time.perf_counter()
            try:
                r = record(path, replace(base, trace=trace), model=model)
            except ModelOutputError as e:  # the traced pass did not reproduce the rows: refused, as vd record does
                refused.append(str(e))
                continue
            out.append(time.perf_counter() - t)
            if trace:
                parts.append(r.seconds.get("trace", 0.0))
            if trace and not kept.exists():
                shutil.move(path, kept)
            else:
                shutil.rmtree(path)
    if not traced:
        return {"forward": forward, "record_s": spread(plain), "refused": refused}, None
    g = open_golden(kept)
    points = len(g.trace_points())
    g.close()
    total, trace_bytes = _size(kept), _trace_bytes(kept)
    ratio = ratios(traced, plain) if len(traced) == len(plain) else spread([t / min(plain) for t in traced])
    return {"forward": forward, "record_s": spread(plain), "record_traced_s": spread(traced),
            "traced_pass_s": spread(parts), "ratio": ratio, "points": points,
            "golden_bytes_traced": total, "trace_bytes": trace_bytes, "trace_share": trace_bytes / total,
            "refused": refused}, kept


def _located(model, golden: Path, forward: str, other: str, args) -> dict:
    """The traced golden of ``forward`` replayed under ``other`` with --locate, and located --between them."""
    t = time.perf_counter()
    plain = replay(golden, ReplaySettings(forwards=(other,), ks=tuple(args.k)), model=model)
    plain_s = time.perf_counter() - t
    t = time.perf_counter()
    r = replay(golden, ReplaySettings(forwards=(other,), ks=tuple(args.k), locate=True), model=model)
    located_s = time.perf_counter() - t
    t = time.perf_counter()
    between = locate(golden, forward, other, model=model, ks=tuple(args.k))
    between_s = time.perf_counter() - t
    return {"golden_forward": forward, "replayed": other, "verdict": r.verdict, "verdict_without": plain.verdict,
            "replay_s": plain_s, "replay_locate_s": located_s,
            "located": [x.to_json() for x in r.located], "between": between.to_json(), "between_s": between_s}


def _brief(x: dict) -> dict:
    """A located K without its per-point profile (kept only for the first K, where the plot comes from)."""
    return {key: v for key, v in x.items() if key != "profile"}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--forwards", nargs="+", default=["eager", "sdpa"])
    p.add_argument("--k", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prompt", default=RecordSettings().prompt)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    started = provenance()
    model = load_model(args.model, device=args.device, dtype="bfloat16")
    costs, located = [], []
    with tempfile.TemporaryDirectory() as d:
        goldens = {}
        for forward in args.forwards:
            c, kept = _record_costs(model, args, forward, Path(d))
            costs.append(c)
            if kept is None:
                print(f"{forward}: --trace refused every time: {c['refused'][0]}", file=sys.stderr)
                continue
            goldens[forward] = kept
            print(f"{forward}: --trace {c['ratio']['median']:.2f}x the recording ({c['trace_bytes'] / 1e6:.2f} MB "
                  f"of traces, {100 * c['trace_share']:.0f} % of the golden; refused {len(c['refused'])} of "
                  f"{args.reps})", file=sys.stderr)
        for forward, golden in goldens.items():
            for other in args.forwards:
                if other != forward:
                    x = _located(model, golden, forward, other, args)
                    for r in x["located"]:
                        r["verify"] = [_brief(v) if i else v for i, v in enumerate(r["verify"])]
                    x["between"]["verify"] = [_brief(v) for v in x["between"]["verify"]]
                    located.append(x)
    out = {"benchmark": "bench_trace", "command": " ".join(["python", *sys.argv]),
           "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), **started, "load_after": load_average(),
           "machine": _machine(args.device), "model": args.model, "steps": args.steps, "k": args.k,
           "prompt": args.prompt, "reps": args.reps, "record": costs, "locate": located}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()

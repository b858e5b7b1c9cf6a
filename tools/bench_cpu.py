"""Benchmark: vd's record and replay wall time against a bare loop of the same forward, and the
golden's bytes (and its slim form's) against raw bf16 bytes, on the embedded default model on the CPU.

The bare loops run the same model calls (prefill, the same verify steps with the same tokens, the same
rewinds; before them the greedy continuation's one-token decodes, which a recording runs and a replay of a
golden with decode rows runs again) with no storage and no comparison. Each variant
runs ``--reps`` times, interleaved, and the medians and their ratios are reported. Writes JSON.

    python tools/bench_cpu.py --out tools/bench_cpu.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import checkout  # noqa: F401,E402  (the checkout's vd first on sys.path)
import torch
from figures import load_average, provenance, ratios, spread

from vd import env
from vd.loop import continuation, gc_paused
from vd.models import load_model
from vd.recorder import DEFAULT_PROMPT, RecordSettings, record
from vd.replayer import ReplaySettings, replay
from vd.store import locate, open_golden, slim
from vd.store.format import DECODE_K


@gc_paused()  # as vd's runs (`vd.loop.run_verify`)
@torch.inference_mode()
def bare_verify(model, prompt, golden) -> None:
    """Prefill then the golden's steps: forward, argmax, rewind. Nothing stored, nothing compared; Python's
    cyclic collector paused, as over vd's runs."""
    for k in golden.ks:
        log = golden.checked_log(k)
        model.reset()
        model.forward(prompt).argmax(-1).tolist()
        for tokens, na in zip(log.tokens.tolist(), log.accepted.tolist()):
            model.forward(tokens).argmax(-1).tolist()
            model.rewind(k - 1 - int(na))


def _timed(a: argparse.Namespace, model, prompt: list[int], ks: tuple[int, ...], path: Path) -> dict[str, list[float]]:
    """Each variant's seconds, ``a.reps`` interleaved repetitions; the golden is left at ``path``."""
    times: dict[str, list[float]] = {n: [] for n in
                                     ("bare_record", "record", "bare_replay", "replay", "replay_with_control")}
    for _ in range(a.reps):
        t = time.perf_counter()
        record(path, RecordSettings(model=a.model, ks=ks, steps=a.steps), refresh=True, model=model)
        times["record"].append(time.perf_counter() - t)
        golden = open_golden(path)

        t = time.perf_counter()
        continuation(model, prompt, a.steps * max(ks) + 1)
        bare_verify(model, prompt, golden)
        times["bare_record"].append(time.perf_counter() - t)

        t = time.perf_counter()
        if golden.decoded:  # a replay runs the golden's one-token decodes first (format 7), as a recording does
            continuation(model, prompt, golden.layout(DECODE_K).steps + 1)
        bare_verify(model, prompt, golden)
        times["bare_replay"].append(time.perf_counter() - t)

        t = time.perf_counter()
        assert replay(path, ReplaySettings(control=False), model=model).verdict == "PASS"
        times["replay"].append(time.perf_counter() - t)

        t = time.perf_counter()
        assert replay(path, model=model).verdict == "PASS"
        times["replay_with_control"].append(time.perf_counter() - t)
    return times


def _sizes(path: Path, ks: tuple[int, ...], work: Path) -> dict[str, float]:
    """The golden's bytes, its logits rows' against raw bf16, and its slim form's (made under ``work``)."""
    golden = open_golden(path)
    raw = sum((golden.layout(k).counts["prefill"] + golden.layout(k).counts["verify"]) * golden.info.vocab * 2
              for k in ks)
    stored = locate(path).nbytes()
    logits_stored = sum(f.stat().st_size for k in ks for d in (path / f"k{k}").iterdir()
                        if d.name.split(".")[0] in ("prefill", "logits") for f in d.rglob("*") if f.is_file())
    slim_bytes = slim(path, work / "slim.zarr").nbytes()
    return {"golden_bytes": stored, "golden_logits_bytes": logits_stored, "raw_bf16_logits_bytes": raw,
            "logits_stored_over_raw": logits_stored / raw, "slim_bytes": slim_bytes,
            "slim_over_full": slim_bytes / stored}


NOTES = ("each ratio is taken repetition by repetition (the repetitions are interleaved) and given as "
         "min, median and max: the eager forward's time on a shared 2-core host varies from one "
         "repetition to the next by more than vd's own cost. record includes the greedy "
         "continuation, the rows' digests and the zarr write; bare_record the same continuation "
         "and verify steps with no storage. replay includes opening the "
         "golden, reading its step logs and digests, and comparing every row by digest (rows read "
         "only where digests differ); replay_with_control adds the detection-control pass (one "
         "more replay of every K, whose changed rows are read), which the CLI always runs.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("tools/bench_cpu.json"))
    a = ap.parse_args()
    started = provenance()

    model = load_model(a.model)
    prompt = model.encode(DEFAULT_PROMPT)
    ks = (2, 3, 4)
    work = Path(tempfile.mkdtemp(prefix="vd-bench-"))
    try:
        times = _timed(a, model, prompt, ks, work / "g.zarr")
        sizes = _sizes(work / "g.zarr", ks, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    per_rep = {"record_ratio": ratios(times["record"], times["bare_record"]),
               "replay_ratio": ratios(times["replay"], times["bare_replay"]),
               "replay_with_control_ratio": ratios(times["replay_with_control"], times["bare_replay"])}
    e = env.capture(model.device)
    result = {
        "command": "python " + " ".join(sys.argv),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        **started, "load_after": load_average(),
        "machine": {f: e[f] for f in ("cpu_model", "cpu_capability", "cpu_count", "threads", "torch",
                                      "transformers", "zarr", "python", "platform")},
        "model": a.model, "dtype": "bfloat16", "forward": "eager", "k": list(ks), "steps": a.steps,
        "reps": a.reps,
        "seconds": {n: spread(v) for n, v in times.items()},
        "seconds_all": times,
        **per_rep,
        **sizes,
        "notes": NOTES,
    }
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("seconds", "record_ratio", "replay_ratio",
                                             "replay_with_control_ratio", "logits_stored_over_raw",
                                             "slim_over_full")}, indent=2))

if __name__ == "__main__":
    main()

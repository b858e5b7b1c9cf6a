"""GPU benchmark: verify-step time per forward against the weight-streaming floor, and what vd's record
and replay cost over bare loops of the same forward.

    python tools/bench_gpu.py --model llama3-8b-shape --out tools/bench_gpu.json

For each forward and K it records a golden (K alone, reference feed) and replays it, timing both
against a bare loop that makes the same model calls (a bare greedy decode then the same verify steps,
argmax read back after each, the same rewinds) with no feed, storage or comparison. Every figure is
a median over ``--reps`` interleaved repetitions in this one process, ratios taken repetition by
repetition; ``spread`` gives each figure's min, median and max, and the JSON keeps every sample. An
ungraphed forward's rows carry no ratio fields of their own (``host_bound``): their spread is the host's
noise as much as vd's cost.

* ``step_ms``: median verify step (CUDA events around one ``forward`` of K tokens).
* ``floor_ms``: the model's weight bytes over the device-to-device copy bandwidth measured here
  (bytes read plus written per second): a verify step must stream every weight once.
* ``record_ratio``: `vd.recorder.record` without the store's work (the greedy continuation's run, the writer
  opened, the K run with its rows held on the GPU and summarised behind its last step) over the bare decode
  plus verify loop; ``record_tail_ms`` the store's work after each run (the decode rows written after the
  continuation's run, each K's rows after its run: bounded by `vd.loop.hold_bytes`; then the publish:
  metadata, manifest, the golden put in place; then the golden's own verify-vs-decode figures read back
  from it), and ``record_total_ratio`` both over the bare loop.
* ``replay_ratio``: `vd.replayer.replay` without the detection control over a bare loop of the same model
  calls (the golden's one-token decodes, then its verify steps). Timed: opening the golden
  (`vd.replayer.open_for_replay`), the setup, the decode and verify runs, the comparison by row digests on
  the GPU, the report. Not timed: the golden's small arrays read and every file hashed against its manifest
  (`vd.store.prefetch`): the CLI runs that on a thread while the model loads, and this process, whose model
  is loaded, waits for the same thread beside nothing (``replay_read_s``, the reading's own seconds, is
  kept per repetition). Nothing of vd's runs while the steps run. ``reader`` says where the last replay's
  reading ran; ``samples`` keeps each replay's ``phases``.
* Each repetition records over the last one's golden (``--refresh``), and the version it replaces is removed
  on a thread (`vd.store.local.Directory.publish`; a `vd record` process waits for it at exit): the bench waits
  for that removal untimed after each recording (``refresh_removal_s`` in ``samples``), so it never runs
  beside the bare loops or the replay (until 1c6bd26 it did, holding the interpreter while they ran).
* The bare loops run with Python's cyclic collector paused, as `vd.loop.run_verify` runs vd's steps: no
  collection of what vd's work left falls inside either side of a ratio.
* Warm-up: per forward and K, one recording and one replay run before the timed repetitions (graph
  capture, compilation, the first digest weights); every timed repetition counts, the first included.
* ``record_gc_ms`` in ``samples``: per repetition, the milliseconds Python's cyclic collector ran during the
  recording, by generation (0, 1, 2).
* ``import_s``, ``cuda_init_s``, ``load_s`` (the model's build alone) and ``fingerprint_s``: start-up.
* ``golden_bytes`` and ``raw_rows_bytes``: the golden's size and its prefill and verify rows' raw bytes.

Rows are appended to ``--out`` (a JSON file holding a list of runs), so the shapes can run as separate
processes (each needs its own GPU memory) into one file. Under torchrun the model is split over the ranks
(`vd.models.tp`; ``torchrun --standalone --nproc-per-node 2 tools/bench_gpu.py --model llama3-70b-shape
--forwards graphed ...``): rank 0 measures, ``floor_ms`` is one GPU's weight bytes over its bandwidth.
"""

from __future__ import annotations

import argparse
import atexit
import datetime as _dt
import gc
import json
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import checkout  # noqa: F401,E402  (the checkout's vd first on sys.path)
import torch
from figures import load_average, provenance, ratios, spread

from vd import env  # noqa: E402
from vd.loop import gc_paused, prepare  # noqa: E402
from vd.models import load_model  # noqa: E402
from vd.recorder import RecordSettings, record  # noqa: E402
from vd.replayer import ReplaySettings, open_for_replay, replay  # noqa: E402
from vd.store import locate, open_golden  # noqa: E402
from vd.store.format import DECODE_K  # noqa: E402
from vd.store.local import finish_removals  # noqa: E402

PROMPT = "Speculative decoding: draft, then verify."


class Collections:
    """Milliseconds Python's cyclic collector ran, by generation, since the last `take` (`gc.callbacks`)."""

    def __init__(self):
        self.ms = [0.0, 0.0, 0.0]
        self._t = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.ms[info["generation"]] += 1e3 * (time.perf_counter() - self._t)

    def take(self) -> list[float]:
        out, self.ms = self.ms, [0.0, 0.0, 0.0]
        return out


def gpu_id(device: torch.device) -> str | None:
    """The GPU's UUID, which tells one machine's GPU from another's of the same model."""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return None if uuid is None else str(uuid)


def event_ms(op: Callable[[], object]) -> float:
    """The device time of what ``op()`` issues, in ms: CUDA events recorded around it, waited for."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    op()
    e.record()
    e.synchronize()
    return s.elapsed_time(e)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes per second (read plus written), median of ``reps``."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    copy = partial(b.copy_, a)
    times = [event_ms(copy) / 1e3 for _ in range(reps)]
    del a, b, copy
    return 2 * nbytes / statistics.median(times)


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.model.parameters())  # tied weights once


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@gc_paused()  # as vd's runs: no collection inside either side of a ratio
@torch.inference_mode()
def bare_verify(model, prompt, steps, timed: bool = False) -> tuple[float, list[float]]:
    """The same verify calls as a replay, nothing else: seconds and (``timed``: CUDA events around each
    step's forward, kept out of the untimed loops the ratios divide by) each step's ms."""
    sync(model.device)
    t0 = time.perf_counter()
    model.reset()
    model.forward(prompt)
    step_ms = []
    for st in steps:
        if timed:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
        rows = model.forward(st.tokens)
        if timed:
            e.record()
        rows.argmax(dim=-1).tolist()
        if timed:
            step_ms.append(s.elapsed_time(e))
        model.rewind(len(st.tokens) - 1 - st.accepted)
    sync(model.device)
    return time.perf_counter() - t0, step_ms


def timed_replay(path: Path, settings: ReplaySettings, model) -> tuple[float, float, float, dict]:
    """One replay as the CLI places its work: the golden opened and its reading started, the reading waited for
    untimed (the CLI's model load hides it), then the replay. (Seconds timed, the reading's seconds, the report.)"""
    sync(model.device)
    t = time.perf_counter()
    opened = open_for_replay(path, settings, model.device)
    opened_s = time.perf_counter() - t
    t = time.perf_counter()
    opened.reader.wait()
    read_s = time.perf_counter() - t
    t = time.perf_counter()
    r = replay(opened, settings, model=model).to_json()
    return opened_s + time.perf_counter() - t, opened_s, read_s, r


def bare_replay(model, prompt, path: Path) -> float:
    """A replay's model calls with nothing else: the golden's one-token decodes (if it stores decode rows),
    then its verify steps."""
    g = open_golden(path)
    decodes = g.layout(DECODE_K).steps + 1 if g.decoded else 0
    steps = g.checked_log(g.ks[0]).steps
    return (bare_decode(model, prompt, decodes) if decodes else 0.0) + bare_verify(model, prompt, steps)[0]


@gc_paused()
@torch.inference_mode()
def bare_decode(model, prompt, n) -> float:
    sync(model.device)
    t0 = time.perf_counter()
    model.reset()
    last = model.forward(prompt)[-1].argmax().item()
    for _ in range(n - 1):
        last = model.forward([last])[0].argmax().item()
    sync(model.device)
    return time.perf_counter() - t0


def _raw_bytes(path: Path, k: int) -> int:
    """The golden's prefill and verify rows as raw values (what its stored rows are measured against)."""
    g = open_golden(path)
    counts = g.layout(k).counts
    return (counts["prefill"] + counts["verify"]) * g.info.vocab * g.info.dtype.storage.itemsize


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b-shape")
    ap.add_argument("--forwards", default="eager,sdpa,static,graphed,compiled,compiled-graphed")
    ap.add_argument("--k", default="2,3,4")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--out", type=Path, required=True)
    return ap.parse_args()


def _start(args: argparse.Namespace, device: torch.device) -> tuple:
    """The model built on ``device``, the prompt's tokens, and the run's header: where start-up went
    (transformers' model code imported, CUDA started, the build, the fingerprint) and the weight-streaming
    floor."""
    t = time.perf_counter()
    import transformers.models.llama.modeling_llama  # noqa: F401  imported apart from the build it serves
    import_s = time.perf_counter() - t
    t = time.perf_counter()
    torch.cuda.init()
    torch.empty(1, device=device)
    cuda_init_s = time.perf_counter() - t
    t = time.perf_counter()
    model = load_model(args.model, device=device, dtype="bfloat16")
    load_s = time.perf_counter() - t  # the build alone: transformers imported and CUDA started above
    t = time.perf_counter()
    fingerprint = model.identity().fingerprint
    fingerprint_s = time.perf_counter() - t
    bw = copy_bandwidth(device)
    wbytes = weight_bytes(model)
    floor_ms = wbytes / bw * 1e3
    prompt = model.encode(args.prompt)
    print(f"{args.model}: {wbytes / 1e9:.2f} GB of weights, copy {bw / 1e12:.2f} TB/s, floor {floor_ms:.3f} ms; "
          f"import {import_s:.1f} s, CUDA init {cuda_init_s:.1f} s, build {load_s:.2f} s, fingerprint "
          f"{fingerprint_s:.2f} s", flush=True)
    header = {
        "gpu": torch.cuda.get_device_name(device),
        "gpu_id": gpu_id(device),
        "environment": env.of_model(model),
        "model": args.model, "fingerprint": fingerprint, "weight_bytes": wbytes,
        "copy_bandwidth_bytes_per_s": bw, "floor_ms": floor_ms, "steps": args.steps, "reps": args.reps,
        "prompt_tokens": len(prompt), "import_s": import_s, "cuda_init_s": cuda_init_s,
        "load_s": load_s, "fingerprint_s": fingerprint_s,
    }
    return model, prompt, header


def _repetitions(model, prompt: list[int], path: Path, settings: RecordSettings, args: argparse.Namespace, k: int,
                 collections: Collections) -> tuple[dict[str, list], dict]:
    """``args.reps`` interleaved repetitions of a recording, its bare loop, a replay and its bare loop (so
    drift hits both sides alike): every sample, and the last replay's report."""
    steps = open_golden(path).checked_log(k).steps
    replay_settings = ReplaySettings(forwards=(settings.forward,), control=False)
    timed_replay(path, replay_settings, model)  # warm-up
    samples: dict[str, list] = {"record_s": [], "bare_record_s": [], "replay_s": [], "bare_replay_s": [],
                                "step_ms": []}
    for _ in range(args.reps):
        collections.take()
        t = time.perf_counter()
        done = record(path, settings, refresh=True, model=model)
        samples["record_s"].append(time.perf_counter() - t)
        samples.setdefault("record_gc_ms", []).append(collections.take())
        t = time.perf_counter()
        finish_removals()  # the version the refresh replaced, removed on a thread: not beside what is timed
        samples.setdefault("refresh_removal_s", []).append(time.perf_counter() - t)
        for name, sec in done.seconds.items():  # where record's own time went
            samples.setdefault(f"record_{name}_s", []).append(sec)
        for name, sec in done.parts.items():  # parts of its store and write (RecordResult.parts)
            samples.setdefault(f"record_part_{name}_s", []).append(sec)
        bare_s, _ = bare_verify(model, prompt, steps)
        samples["bare_record_s"].append(bare_decode(model, prompt, args.steps * k + 1) + bare_s)
        replay_s, opened_s, read_s, r = timed_replay(path, replay_settings, model)
        samples["replay_s"].append(replay_s)
        samples.setdefault("replay_opened_s", []).append(opened_s)
        samples.setdefault("replay_read_s", []).append(read_s)
        for name, sec in r["phases"].items():  # where replay's own time went
            samples.setdefault(f"replay_{name}_s", []).append(sec)
        samples["bare_replay_s"].append(bare_replay(model, prompt, path))
        samples["step_ms"].extend(bare_verify(model, prompt, steps, timed=True)[1])
    return samples, r


def _figures(samples: dict[str, list]) -> dict:
    """Each figure's spread over the repetitions: the step, the record ratio without and with the store's
    tail, the tail, the replay ratio."""
    tail_s = [a + b + c for a, b, c in zip(samples["record_store_s"], samples["record_write_s"],
                                           samples["record_equivalence_s"])]
    loop_s = [a - b for a, b in zip(samples["record_s"], tail_s)]
    return {
        "step_ms": spread(samples["step_ms"]),
        "record_ratio": ratios(loop_s, samples["bare_record_s"]),
        "record_total_ratio": ratios(samples["record_s"], samples["bare_record_s"]),
        "record_tail_ms": spread([1e3 * x for x in tail_s]),
        "replay_ratio": ratios(samples["replay_s"], samples["bare_replay_s"]),
    }


def _row(model, name: str, fwd: str, k: int, path: Path, floor_ms: float, accepted, samples: dict[str, list],
         r: dict) -> dict:
    """One forward and K's row of the run (``name``: the model as the command named it)."""
    step_ms = statistics.median(samples["step_ms"])
    figures = _figures(samples)
    graphed = bool(r["graphs"] == "graphed")
    return {
        "model": name, "forward": fwd, "description": model.forwards()[fwd], "k": k,
        "graphs": r["graphs"], "verdict": r["verdict"], "reasons": r["reasons"],
        "step_ms": step_ms, "floor_ms": floor_ms, "step_over_floor": step_ms / floor_ms,
        **({n: figures[n]["median"] for n in ("record_ratio", "record_total_ratio", "replay_ratio")}
           if graphed else {"host_bound": "an ungraphed forward launches every kernel from Python: its "
                                         "ratios below are the host's noise as much as vd's cost"}),
        "record_tail_ms": figures["record_tail_ms"]["median"],
        "spread": figures,
        "accepted": accepted, "reader": r["reader"], "samples": samples,
        "golden_bytes": locate(path).nbytes(), "raw_rows_bytes": _raw_bytes(path, k),
    }


def main() -> None:
    args = _args()
    started = provenance()
    device = torch.device("cuda")
    ks = [int(x) for x in args.k.split(",")]
    model, prompt, header = _start(args, device)

    rows, tmp = [], Path(tempfile.mkdtemp(prefix="vd-bench-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)  # its goldens, whatever ends the run
    earlier = json.loads(args.out.read_text()) if args.out.exists() else []
    run = {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        **started, "load_after": None, **header, "rows": rows,
    }

    def save():  # after every row, so a run cut short still leaves its figures
        run["load_after"] = load_average()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps([*earlier, run], indent=1, default=str) + "\n")

    collections = Collections()  # one callback for the whole run
    for fwd in args.forwards.split(","):
        if fwd not in model.forwards():
            print(f"  {fwd}: not offered here, skipped", flush=True)
            continue
        model.set_forward(fwd)
        t = time.perf_counter()
        prepare(model, len(prompt), args.steps, ks)  # graphs captured (and code compiled) up front
        warm_s = time.perf_counter() - t
        for k in ks:
            path = tmp / f"{fwd}-k{k}.zarr"
            settings = RecordSettings(model=args.model, prompt=args.prompt, ks=(k,), steps=args.steps, forward=fwd,
                                      allow_thin=True)
            rec = record(path, settings, refresh=True, model=model)  # warm-up: the first record compiles too
            finish_removals()
            samples, r = _repetitions(model, prompt, path, settings, args, k, collections)
            row = _row(model, args.model, fwd, k, path, header["floor_ms"], rec.accepted[k], samples, r)
            rows.append(row)
            f = row["spread"]
            print(f"  {fwd:17s} K={k}: step {row['step_ms']:.3f} ms ({row['step_over_floor']:.2f}x floor), record "
                  f"{f['record_ratio']['min']:.3f}-{f['record_ratio']['max']:.3f}x + tail "
                  f"{f['record_tail_ms']['median']:.1f} ms, replay {f['replay_ratio']['min']:.3f}-"
                  f"{f['replay_ratio']['max']:.3f}x, {r['verdict']}", flush=True)
            row["prepare_s"] = warm_s  # graph capture (and compilation) before the first K
            save()

if __name__ == "__main__":
    from vd.models import tp

    if tp.is_follower():  # under torchrun: rank 0 benchmarks, the other ranks run its model calls
        tp.follow()
    else:
        try:
            main()
        finally:
            tp.stop()
    tp.finish()

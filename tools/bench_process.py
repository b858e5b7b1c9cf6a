"""Benchmark: whole `vd` processes on the CPU, as a user runs them: start-up (process start to the first
verify step, by phase) and peak memory and time per step as the number of steps grows.

    python tools/bench_process.py --out tools/bench_process.json

Each figure comes from `vd record` / `vd replay` run as subprocesses (peak resident memory from the kernel's
accounting of that child, `os.wait4`); start-up from the replay report's ``timing`` (``first_step`` counts
from the process's start). Beside each replay's time per step, this process runs the golden's steps as a
bare loop of the same forward (``bare_ms_per_step``, ``run_over_bare``), so a step that costs more at
more steps can be told to be the model's (a longer context) or vd's. The converted-weights cache is
warmed first, so start-ups are the second and later ones, as the target asks; the first (a conversion)
is measured once and kept apart.

The goldens are recorded with ``--allow-thin``: a speed bench times what a reference costs, and on some
machines a model's verify rows leave its own greedy continuation at the first step (the 8B shape under
`compiled-graphed` on one H200: every later draft rejected, a thin reference). A replay then FAILs on
that alone, and is timed as any other; a replay that FAILs for anything else, or a recording that
fails, stops the bench with its line.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import checkout  # noqa: F401,E402  (the checkout's vd first on sys.path)
import torch
from bench_cpu import bare_verify
from bench_gpu import bare_decode
from figures import load_average, provenance, spread

from vd import env
from vd.coverage import thin_reason
from vd.models import load_model
from vd.store import open_golden
from vd.store.format import DECODE_K


def run(args: list[str], cache: Path, warm: Path | None = None, ok: tuple[int, ...] = (0, 1)) -> dict:
    """One `vd` process: its wall time, peak memory (MB) and exit code (one not in ``ok`` stops the bench with
    the process's last lines). With ``warm`` (a `vd warm` server's folder) the command is forked from that
    server (its peak memory is then the command's process alone)."""
    t = time.perf_counter()
    where = {"VD_WARM_DIR": str(warm)} if warm is not None else {"VD_WARM": "off"}
    proc = subprocess.Popen([sys.executable, "-m", "vd", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "VD_CACHE_DIR": str(cache), **where})
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    code = os.waitstatus_to_exitcode(status)
    if code not in ok:
        raise SystemExit(f"vd {' '.join(args)} exited {code}: {proc.stderr.read().decode()[-2000:]}")
    return {"wall_s": wall, "peak_mb": usage.ru_maxrss / 1024, "exit": code}


def machine() -> dict:
    return {k: v for k, v in env.capture(torch.device("cpu")).items() if k in ("cpu_model", "torch", "transformers",
                                                                                 "vd")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--steps", default="16,64,256", help="step counts for the memory rows")
    ap.add_argument("--reps", type=int, default=3, help="replays measured for start-up")
    ap.add_argument("--device", default="cpu", help="where the model runs (cuda: an H200's start-up, say)")
    ap.add_argument("--forward", default=None, help="the forward to record with (default: the model's)")
    ap.add_argument("--prompt", default=None, help="the prompt to record (default: vd's)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vd-bench-process-"))
    try:
        measure(a, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # its goldens and converted weights (0.6 GB for SmolLM2)


def measure(a: argparse.Namespace, work: Path) -> None:
    """The runs ``main`` asked for, in the folder ``work``; their figures to ``a.out``."""
    cache = work / "cache"
    result: dict = {"command": "python tools/bench_process.py " + " ".join(shlex.quote(x) for x in sys.argv[1:]),
                    "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), **provenance(),
                    "machine": {"cpu_count": os.cpu_count(), **machine()},
                    "model": a.model, "device": a.device, "forward": a.forward}
    rows = {}
    for steps in [int(s) for s in a.steps.split(",")]:
        golden = work / f"g{steps}.zarr"
        how = ["--model", a.model, "--steps", str(steps), "--device", a.device,
               *(["--forward", a.forward] if a.forward else []), *(["--prompt", a.prompt] if a.prompt else [])]
        rec = run(["record", str(golden), *how, "--allow-thin"], cache, ok=(0,))
        if "first_conversion" not in result:
            result["first_conversion"] = rec  # the first process converted the GGUF into the cache
            golden_first = golden
            rec = run(["record", str(work / "again.zarr"), *how, "--allow-thin"], cache, ok=(0,))
        report = work / f"r{steps}.json"
        rep = run(["replay", str(golden), "--report", str(report)], cache)
        timing = judged(report, rep["exit"], f"replay of {golden.name}")["timing"]
        bare = bare_s(golden, a)
        rows[steps] = {"record": rec, "replay": rep, "replay_timing": timing,
                       "replay_run_ms_per_step": 1000 * timing["run"] / steps,
                       "bare_ms_per_step": 1000 * bare / steps, "run_over_bare": timing["run"] / bare}
        print(f"{steps:4d} steps: record {rec['wall_s']:.1f} s {rec['peak_mb']:.0f} MB, replay {rep['wall_s']:.1f} s "
              f"{rep['peak_mb']:.0f} MB, run {rows[steps]['replay_run_ms_per_step']:.1f} ms/step (bare loop "
              f"{rows[steps]['bare_ms_per_step']:.1f})", flush=True)
    result["memory"] = rows
    base = rows[min(rows)]
    result["peak_over_smallest"] = {n: {"record": r["record"]["peak_mb"] / base["record"]["peak_mb"],
                                        "replay": r["replay"]["peak_mb"] / base["replay"]["peak_mb"]}
                                    for n, r in rows.items()}
    result["startup"] = startup(golden_first, cache, a.reps, None)
    result["startup"]["imports_s"] = imports()
    result["startup_warm"] = startup_warm(golden_first, cache, a.reps, work / "warm")
    result["load_after"] = load_average()
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}")


def startup(golden: Path, cache: Path, reps: int, warm: Path | None) -> dict:
    """Start-up of ``reps`` replays of ``golden``, each a `vd` process (forked from the server in ``warm``)."""
    starts = []
    for i in range(reps):
        report = Path(tempfile.mkdtemp(prefix="vd-start-", dir=cache.parent)) / "report.json"  # in `main`'s folder
        p = run(["replay", str(golden), "--report", str(report)], cache, warm)
        r = judged(report, p["exit"], f"replay {i}")
        starts.append({**r["timing"], "wall_s": p["wall_s"], "exit": p["exit"], "reasons": r["reasons"]})
        if starts[-1]["warm"] != (warm is not None):
            raise SystemExit(f"replay {i}: warm {starts[-1]['warm']} (expected {warm is not None})")
        print(f"replay {i}{' (warm)' if warm else ''}: first step {starts[-1]['first_step']:.2f} s after start",
              flush=True)
    return {"samples": starts,
            **{k: spread([s[k] for s in starts]) for k in ("first_step", "started", "load", "model_code", "setup",
                                                          "fingerprint", "prepare", "wall_s")},
            "setup_and_prepare": spread([s["setup"] + s["prepare"] for s in starts])}


def judged(report: Path, code: int, what: str) -> dict:
    """The replay report at ``report`` of a process that exited ``code``: its own golden on this machine, so a
    PASS, or a FAIL whose every reason is a K too thin (see the module's docstring); else the bench stops."""
    r = json.loads(report.read_text())
    thin = {thin_reason(v["k"], v["accepted"]) for v in r["verify"]}
    if code != 0 and not (r["verdict"] == "FAIL" and r["reasons"] and set(r["reasons"]) <= thin):
        raise SystemExit(f"{what} exited {code}, {r['verdict']}: {'; '.join(r['reasons'])[:2000]}")
    return r


def startup_warm(golden: Path, cache: Path, reps: int, server: Path) -> dict:
    """`startup` forked from a `vd warm` server started for it (in ``server``), with the server's status."""
    ready = subprocess.run([sys.executable, "-m", "vd", "warm", "--json"], check=True, capture_output=True,
                           env={**os.environ, "VD_CACHE_DIR": str(cache), "VD_WARM_DIR": str(server)})
    try:
        return {"server": json.loads(ready.stdout), **startup(golden, cache, reps, server)}
    finally:
        subprocess.run([sys.executable, "-m", "vd", "warm", "--stop"], env={**os.environ, "VD_WARM_DIR": str(server)},
                       capture_output=True)


_MODEL: list = []


def bare_s(golden: Path, a) -> float:
    """Seconds this process takes to run ``golden``'s model calls (its one-token decodes, then every K's verify
    steps) as a bare loop of the same forward: what a replay's ``run`` costs without vd, so its time per step
    can be told from the model's."""
    if not _MODEL:
        _MODEL.append(load_model(a.model, device=a.device))
    model, g = _MODEL[0], open_golden(golden)
    model.set_forward(a.forward or g.info.forward)
    prompt = g.prompt
    t = time.perf_counter()
    if g.decoded:  # the golden's one-token decodes (the prefill and one per step), as its replay runs them first
        bare_decode(model, prompt, g.layout(DECODE_K).steps + 1)
    bare_verify(model, prompt, g)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def imports() -> dict:
    """How long this machine takes to import what a replay needs, each in a fresh interpreter (median of 3)."""
    steps = {"python": "pass", "torch": "import torch",
             "torch+transformers' Llama": "import torch, transformers.models.llama.modeling_llama"}
    out = {}
    for name, code in steps.items():
        times = []
        for _ in range(3):
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True)
            times.append(time.perf_counter() - t)
        out[name] = statistics.median(times)
    return out


if __name__ == "__main__":
    main()

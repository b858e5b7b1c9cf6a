"""Where a GPU replay's fixed cost goes (issue 34 target 1), by wall clock (no profiler): for ``--reps``
replays of a 16-step golden, as `tools/bench_gpu.py` times them (the golden opened and read as the CLI does,
then `vd.replayer.replay` and its report's JSON), the seconds of each part below, and the bare loops of the
same model calls beside them.

    python3 tools/h200/replay_parts.py --model qwen2.5-0.5b-shape --forward graphed --out $OUT/parts.json

Parts (wrapped functions; a part's time includes what it calls): ``open`` (`open_for_replay`), ``run``
(`vd.loop.run_verify`: every run), ``queued`` (`Queued.result`: waiting for the comparison queued behind the
last step), ``measure`` (`Measurer.add`), ``judge`` (`judge._judged`), ``axis`` (`runs._axis`), ``report``
(`replay.report_of`), ``json`` (the report's `to_json`), ``check_files`` (the reader's last check),
``other`` what the replay's wall time leaves.
"""

from __future__ import annotations

import collections
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # profile_compare, also under `python3 -P`
import checkout  # noqa: F401,E402
import torch  # noqa: E402
from profile_compare import arguments, golden  # noqa: E402
from wall_parts import ACC, wrap  # noqa: E402

import vd.equivalence as E  # noqa: E402
import vd.replayer.judge as J  # noqa: E402
import vd.replayer.measure as M  # noqa: E402
import vd.replayer.runs as R  # noqa: E402
from vd.models import load_model  # noqa: E402
from vd.replayer import ReplaySettings, open_for_replay  # noqa: E402
from vd.store import open_golden  # noqa: E402
from vd.store.format import DECODE_K  # noqa: E402
from vd.store.prefetch import Prefetcher  # noqa: E402

RP = importlib.import_module("vd.replayer.replay")
SS = importlib.import_module("vd.replayer.session")
INNER = [(E.Accumulator, "add", "in measure: equivalence add"), (E.KeptDecode, "observe", "in measure: decode kept"),
         (M._Tally, "__init__", "in measure: tally init"), (M._Tally, "add", "in measure: tally add"),
         (J, "_decisions", "in judge: decisions"), (J, "_per_step", "in judge: per step"),
         (RP, "set_up", "around: set_up"), (RP, "replay_decode", "around: replay_decode"),
         (RP, "replay_k", "around: replay_k"), (R, "_forward", "around: _forward"), (R, "_control", "around: control"),
         (R, "_own_checks", "in other: own checks"), (R, "_accumulator", "in other: accumulator"),
         (SS, "open_golden_for", "in open: open_golden_for"), (SS, "_reader", "in open: reader"),
         (RP.env, "of_model", "in report: env.of_model")]


SUMMED = ("open", "run", "queued", "measure", "judge", "axis", "report", "json", "check_files")


def one(m, path: Path, st: ReplaySettings) -> dict[str, float]:
    """One replay timed as `tools/bench_gpu.py` times it, by part (seconds)."""
    ACC.clear()
    if m.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    o = open_for_replay(path, st, m.device)
    t1 = time.perf_counter()
    o.reader.wait()  # untimed: the CLI's model load hides it
    t2 = time.perf_counter()
    r = RP.replay(o, st, model=m)
    t3 = time.perf_counter()
    r.to_json()
    t4 = time.perf_counter()
    parts = {"open": t1 - t0, **ACC, "json": t4 - t3, "total": (t1 - t0) + (t4 - t2)}
    parts["other"] = parts["total"] - sum(v for k, v in parts.items() if k in SUMMED)
    assert r.verdict == "PASS", r.reasons
    return parts


def steps_of(path: Path, k: int) -> tuple[int, list]:
    """The golden's decode steps (its one-token decodes) and its verify steps at ``k``."""
    g = open_golden(path)
    decodes, steps = g.layout(DECODE_K).steps + 1, g.checked_log(k).steps
    g.close()
    return decodes, steps


def main() -> None:
    ap = arguments(reps=7)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from bench_gpu import bare_decode, bare_verify  # noqa: E402

    m = load_model(a.model, device=torch.device(a.device), dtype="bfloat16")
    m.set_forward(a.forward)
    prompt = m.encode("Verify.")
    path = golden(m, a.model, a.forward, a.k)
    decodes, steps = steps_of(path, a.k)
    st = ReplaySettings(control=False, forwards=(a.forward,))
    for owner, name, label in ((R, "run_verify", "run"), (J.Queued, "result", "queued"), (M.Measurer, "add", "measure"),
                               (J, "_judged", "judge"), (R, "_axis", "axis"), (RP, "report_of", "report"),
                               (Prefetcher, "check_files", "check_files"), *INNER):  # INNER: shown, not summed
        wrap(owner, name, label)
    for _ in range(3):
        one(m, path, st)
    samples: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(a.reps):
        for k, v in one(m, path, st).items():
            samples[k].append(v * 1e3)
        samples["bare"].append((bare_decode(m, prompt, decodes) + bare_verify(m, prompt, steps)[0]) * 1e3)
    med = {k: round(statistics.median(v), 3) for k, v in samples.items()}
    print(json.dumps(med))
    doc = {"command": "python3 " + " ".join(sys.argv), "model": a.model, "forward": a.forward, "k": a.k,
           "what": __doc__.split("\n\n")[0], "median_ms": med, "samples_ms": samples}
    a.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()

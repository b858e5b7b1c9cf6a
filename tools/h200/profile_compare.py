"""Where a GPU replay's time goes after its runs (issue 34): cProfile over the comparison and the axes of
``--reps`` replays of a 16-step golden, the golden read beforehand as the CLI does (`open_for_replay`).
``--whole``: over everything a replay does but its runs (the golden's opening, the setup, the comparison, the
report and its JSON), the profiler off while `vd.loop.run_verify` steps.

    python3 tools/h200/profile_compare.py --model qwen2.5-0.5b-shape --forward graphed --out $OUT/profile.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import checkout  # noqa: F401,E402
import torch  # noqa: E402

import vd.replayer.runs as R  # noqa: E402
from vd.loop import prepare  # noqa: E402
from vd.models import load_model  # noqa: E402
from vd.recorder import RecordSettings, record  # noqa: E402
from vd.replayer import ReplaySettings, open_for_replay, replay  # noqa: E402


def arguments(reps: int) -> argparse.ArgumentParser:
    """The options of the H200 replay scripts (this one and `replay_parts.py`): model, forward, K, repetitions."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-0.5b-shape")
    ap.add_argument("--forward", default="graphed")
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--out", type=Path, required=True)
    return ap


def golden(m, model: str, forward: str, k: int, prompt: str = "Verify.") -> Path:
    """A 16-step golden of the loaded model ``m`` at ``k`` alone, recorded by ``forward`` in a new folder."""
    path = Path(tempfile.mkdtemp()) / "g.zarr"
    prepare(m, len(m.encode(prompt)), 16, (k,))
    record(path, RecordSettings(model=model, prompt=prompt, ks=(k,), steps=16, forward=forward, allow_thin=True),
           model=m)
    return path


def main() -> None:
    ap = arguments(reps=5)
    ap.add_argument("--whole", action="store_true")
    a = ap.parse_args()
    m = load_model(a.model, device=torch.device("cuda"), dtype="bfloat16")
    m.set_forward(a.forward)
    path = golden(m, a.model, a.forward, a.k)
    st = ReplaySettings(control=False, forwards=(a.forward,))

    pr = cProfile.Profile()

    def one(profile: bool = False):
        """One replay; ``profile``: the profiler on over all of it (the runs excepted: `_instrument`)."""
        if profile:
            pr.enable()
        o = open_for_replay(path, st, m.device)
        if profile:
            pr.disable()
        o.reader.wait()
        t = time.perf_counter()
        if profile:
            pr.enable()
        r = replay(o, st, model=m)
        j = r.to_json()
        if profile:
            pr.disable()
        return time.perf_counter() - t, r, j

    for _ in range(3):
        one()
    _instrument(pr, a.whole)
    lines = []
    for _ in range(a.reps):
        sec, r, _ = one(a.whole)
        lines.append(f"replay {sec * 1e3:.2f} ms: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in r.phases.items() if v))
    out = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(pr, stream=out).sort_stats(key).print_stats(50)
    a.out.write_text("\n".join(lines) + "\n" + out.getvalue())
    print("\n".join(lines))


def _instrument(pr: cProfile.Profile, whole: bool) -> None:
    """The profiler on within the comparison and the axes, or (``whole``) off within the runs."""
    names, enter, leave = (("run_verify",), pr.disable, pr.enable) if whole else \
        (("compare_run", "_axis"), pr.enable, pr.disable)
    for name in names:
        orig = getattr(R, name)

        def wrapped(*args, _orig=orig, **kw):
            enter()
            try:
                return _orig(*args, **kw)
            finally:
                leave()
        setattr(R, name, wrapped)


if __name__ == "__main__":
    main()

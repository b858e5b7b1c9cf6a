"""Experiment (issue 18, target 2): does a `compiled-graphed` golden replay bit for bit on another machine
when the replay first loads the Inductor artifacts the recording compiled (`torch.compiler.save_cache_artifacts`
/ `load_cache_artifacts`)?

    python tools/h200/compiled_travel.py record OUT_DIR [--model M]   # machine A: golden + artifacts
    python tools/h200/compiled_travel.py replay OUT_DIR [--artifacts] # machine B: fresh Inductor cache

Each mode starts from an empty Inductor cache directory of its own (TORCHINDUCTOR_CACHE_DIR), so nothing
compiled earlier on the machine is reused. ``replay --artifacts`` loads the recording's artifacts before the
first compilation; without it the replay compiles afresh (the case the README reports as not travelling).
Writes ``OUT_DIR/<mode>.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")  # before torch is imported

import checkout  # noqa: F401,E402  (the checkout's vd first on sys.path)
import torch  # noqa: E402

from vd.models import load_model  # noqa: E402
from vd.recorder import RecordSettings, record  # noqa: E402
from vd.replayer import ReplaySettings, replay  # noqa: E402

PROMPT = "Verify."


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["record", "replay"])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--model", default="qwen2.5-0.5b-shape")
    ap.add_argument("--artifacts", action="store_true")
    ap.add_argument("--tag", default="")
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    golden = a.dir / f"{a.model}.zarr"
    blob = a.dir / f"{a.model}.inductor.bin"
    out: dict = {"mode": a.mode, "model": a.model, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                 "inductor_cache": os.environ["TORCHINDUCTOR_CACHE_DIR"]}
    t = time.perf_counter()
    if a.mode == "replay" and a.artifacts:
        data = blob.read_bytes()
        info = torch.compiler.load_cache_artifacts(data)
        out["loaded"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "info": _info(info)}
    model = load_model(a.model, device="cuda", dtype="bfloat16")
    out["load_s"] = time.perf_counter() - t
    t = time.perf_counter()
    if a.mode == "record":
        s = RecordSettings(model=a.model, prompt=PROMPT, ks=(2, 3, 4), steps=a.steps, forward="compiled-graphed",
                           allow_thin=True)
        rec = record(golden, s, model=model)
        out["record_s"] = time.perf_counter() - t
        out["accepted"] = {str(k): v for k, v in rec.accepted.items()}
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            out["saved"] = None
        else:
            data, info = saved
            blob.write_bytes(data)
            out["saved"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "info": _info(info)}
        # The same process replays its golden too (a check of the recording itself).
        r = replay(golden, ReplaySettings(forwards=("compiled-graphed",)), model=model).to_json()
    else:
        r = replay(golden, ReplaySettings(forwards=("compiled-graphed",)), model=model).to_json()
        out["replay_s"] = time.perf_counter() - t
    out["verdict"], out["reasons"] = r["verdict"], r["reasons"][:6]
    out["per_k"] = {v["k"]: _k(v["comparisons"][0]) for v in r["verify"]}
    name = f"{a.mode}{'-artifacts' if a.artifacts else ''}{a.tag}.json"
    (a.dir / name).write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(json.dumps(out, indent=1, default=str))
    sys.stdout.flush()


def _k(c: dict) -> dict:
    return {"equal": c["mismatched_steps"] == 0 and c["prefill_equal"], "mismatched_steps": c["mismatched_steps"],
            "max_abs_diff": c["max_abs_diff"]}


def _info(info) -> dict:
    """What kinds of artifacts, how many of each."""
    try:
        return {k: len(v) for k, v in vars(info).get("artifacts", {}).items()}
    except Exception as e:  # the info object's shape differs between torch releases
        return {"repr": repr(info)[:500], "error": repr(e)}


if __name__ == "__main__":
    main()

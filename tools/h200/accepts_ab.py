"""Whether a recording's accept counts depend on how its rows are written: one process, one model, the same
forward and prompt, recordings with the writer's threads (``VD_WRITER_PROCESSES=0``) and with writer
processes (which take each step's rows as the run logs it) interleaved; each recording's accept counts and
the verify rows' figures against the one-token decode's. Run on a lent H200 (tools/h200/env.sh sourced):

    python3 tools/h200/accepts_ab.py --model llama3-8b-shape --forward compiled-graphed --out $OUT/accepts_ab.json
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import tempfile
from pathlib import Path

import checkout  # noqa: F401  (the checkout's vd first on sys.path)
import torch
from figures import provenance

from vd.equivalence import describe
from vd.loop import prepare
from vd.models import load_model
from vd.recorder import RecordSettings, record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b-shape")
    ap.add_argument("--forward", default="compiled-graphed")
    ap.add_argument("--k", default="4,3")
    ap.add_argument("--writers", default="0,,0,", help="VD_WRITER_PROCESSES per round ('' as the device wants)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    run = {"command": f"python3 tools/h200/accepts_ab.py --model {args.model} --forward {args.forward}",
           "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), **provenance(),
           "gpu": torch.cuda.get_device_name(), "gpu_id": str(torch.cuda.get_device_properties(0).uuid),
           "recordings": []}
    model = load_model(args.model, device=torch.device("cuda"), dtype="bfloat16")
    model.set_forward(args.forward)
    ks = [int(k) for k in args.k.split(",")]
    prepare(model, len(model.encode("Verify.")), 16, ks)
    tmp = Path(tempfile.mkdtemp(prefix="vd-ab-"))
    for i, writers in enumerate(args.writers.split(",")):
        os.environ["VD_WRITER_PROCESSES"] = writers
        for k in ks:
            settings = RecordSettings(model=args.model, prompt="Verify.", ks=(k,), steps=16, forward=args.forward,
                                      allow_thin=True)
            r = record(tmp / f"{i}-k{k}.zarr", settings, refresh=True, model=model)
            eq = r.equivalence.get(k)
            run["recordings"].append({"round": i, "writers": writers or "default", "k": k,
                                      "accepted": r.accepted[k], "committed_is_greedy": r.committed_is_greedy[k],
                                      "equivalence": None if eq is None else describe(eq)})
            print(i, writers or "default", k, r.accepted[k], flush=True)
    args.out.write_text(json.dumps(run, indent=1, default=str))


if __name__ == "__main__":
    main()

"""Where a verify step's GPU time goes: kernels per step and their device time, grouped by kernel.

    python tools/profile_step.py --model llama3-8b-shape --forward static --out tools/profile_step.json

* ``profile``: `torch.profiler` over ``--steps`` verify steps of the chosen (non-graphed) forward: kernels
  launched per step, device time per step summed over kernels, and the kernels grouped by name with
  their share. A graph replays the same kernels, so this is where a graphed step's time goes too.
* ``graphed_step_ms``: the same step captured as a CUDA graph (``graphed`` for ``static``,
  ``compiled-graphed`` for ``compiled``), median over 50 replays.
(A first version also timed each GEMM and SDPA backend alone in a one-kernel graph; those figures were
dominated by the ~25 us a graph replay costs and were dropped: the profile's per-kernel times are the
honest ones.)
Runs are appended to ``--out`` (a JSON list), with the command, date and GPU.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shlex
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import checkout  # noqa: F401,E402  (the checkout's vd first on sys.path)
import torch

from tools.bench_gpu import PROMPT, copy_bandwidth, event_ms  # noqa: E402
from vd import env  # noqa: E402
from vd.models import load_model  # noqa: E402


def kernel_profile(model, prompt, k: int, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    model.reset()
    model.forward(prompt)
    tokens = prompt[-k:]
    for _ in range(3):  # warm
        model.forward(tokens)
        model.rewind(k)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            model.forward(tokens)
            model.rewind(k)
        torch.cuda.synchronize()
    groups: dict[str, list] = defaultdict(lambda: [0, 0.0])
    count, total = 0, 0.0
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = ev.time_range.elapsed_us()
        name = ev.name if len(ev.name) < 90 else ev.name[:90]
        groups[name][0] += 1
        groups[name][1] += us
        count += 1
        total += us
    top = sorted(groups.items(), key=lambda kv: -kv[1][1])[:40]
    return {
        "kernels_per_step": count / steps,
        "device_ms_per_step": total / steps / 1e3,
        "top": [{"kernel": n, "per_step": c / steps, "ms_per_step": t / steps / 1e3, "share": t / total}
                for n, (c, t) in top],
    }


def graphed_step_ms(model, forward: str, prompt, k: int, reps: int = 50) -> float:
    """The median device time of one verify step of width ``k`` under the graphed ``forward``, over ``reps``
    replays (CUDA events around each, the step rewound after)."""
    model.set_forward(forward)
    model.prepare(len(prompt) + 64, [k])
    model.reset()
    model.forward(prompt)
    tokens = prompt[-k:]
    times = []
    for _ in range(reps):
        times.append(event_ms(lambda: model.forward(tokens)))
        model.rewind(k)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b-shape")
    ap.add_argument("--forward", default="static")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    device = torch.device("cuda")
    model = load_model(args.model, device=device, dtype="bfloat16")
    prompt = model.encode(PROMPT)
    bw = copy_bandwidth(device)
    wbytes = sum(p.numel() * p.element_size() for p in model.model.parameters())
    run = {"command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
           "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
           "gpu": torch.cuda.get_device_name(device), "environment": env.capture(device),
           "model": args.model, "forward": args.forward, "k": args.k,
           "copy_bandwidth_bytes_per_s": bw, "floor_ms": wbytes / bw * 1e3}
    earlier = json.loads(args.out.read_text()) if args.out.exists() else []

    def save():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps([*earlier, run], indent=1, default=str) + "\n")

    with torch.inference_mode():
        model.set_forward(args.forward)
        model.prepare(len(prompt) + 64, [args.k])
        run["description"] = model.forwards()[args.forward]
        run["profile"] = kernel_profile(model, prompt, args.k, args.steps)
        p = run["profile"]
        print(f"{args.model} {args.forward} K={args.k}: {p['kernels_per_step']:.0f} kernels, "
              f"{p['device_ms_per_step']:.3f} ms of kernels a step (floor {run['floor_ms']:.3f})", flush=True)
        for t in p["top"][:15]:
            print(f"  {t['ms_per_step']:.3f} ms {t['per_step']:5.0f}x {t['kernel']}", flush=True)
        save()
        graphed = {"static": "graphed", "compiled": "compiled-graphed"}.get(args.forward)
        if graphed in model.forwards():
            run["graphed_step_ms"] = graphed_step_ms(model, graphed, prompt, args.k)
            print(f"  graphed step {run['graphed_step_ms']:.3f} ms", flush=True)
            save()


if __name__ == "__main__":
    main()

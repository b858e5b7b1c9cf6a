"""Which import of Inductor starts the CUDA driver (issue 34 target 2): in a fresh interpreter set up as `vd warm`'s
server is (``PYTORCH_NVML_BASED_CUDA_CHECK=1``, `vd.workflow.warm.WARM_MODULES` imported), import Inductor's
modules one by one and after each say its seconds, whether torch's CUDA or the CUDA driver runs
(`vd.workflow.warm.cuda_started`) and how many threads Python has; the calls that could start CUDA are wrapped
to print the stack that made them.

    python3 -P tools/h200/inductor_imports.py --out $OUT/inductor_imports.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

CANDIDATES = ("torch._dynamo", "torch._inductor", "torch._inductor.config", "torch._inductor.utils",
              "torch._inductor.codecache", "triton", "triton.language", "triton.runtime.driver",
              "torch._inductor.runtime.triton_heuristics", "torch._inductor.lowering", "torch._inductor.graph",
              "torch._inductor.async_compile", "torch._inductor.compile_fx", "torch._dynamo.backends.inductor",
              "torch._inductor.fx_passes.post_grad", "torch._functorch.aot_autograd")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--trace", default=None, help="a module: import it with every call watched, and keep the stack "
                    "at the first call after which the process has a thread more (the CUDA driver's)")
    ap.add_argument("--patched", action="store_true", help="torch.cuda.is_available answered by a forked child "
                    "while Inductor is imported (each call's stack kept), then whether CUDA started")
    a = ap.parse_args()
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    from vd.workflow import warm as w

    t = time.perf_counter()
    for name in w.WARM_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    rows: list[dict] = [{"module": "WARM_MODULES", "s": time.perf_counter() - t, "cuda": w.cuda_started(),
                         "threads": threading.active_count()}]
    stacks: list[dict] = []
    import torch

    def wrap(owner, name):
        fn = getattr(owner, name)

        def wrapped(*args, **kw):
            stacks.append({"call": f"{owner.__name__}.{name}", "stack": traceback.format_stack(limit=25)})
            return fn(*args, **kw)

        setattr(owner, name, wrapped)

    for name in ("_lazy_init", "get_device_capability", "get_device_properties", "current_device", "init",
                 "synchronize", "set_device"):
        wrap(torch.cuda, name)
    if a.patched:
        rows.append(_patched(stacks))
    if a.trace:
        rows.append(_traced(a.trace, stacks))
    for name in CANDIDATES if not (a.trace or a.patched) else ():
        t = time.perf_counter()
        error = None
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001  a probe: say what failed, go on
            error = f"{type(e).__name__}: {e}"
        rows.append({"module": name, "s": time.perf_counter() - t, "cuda": w.cuda_started(),
                     "threads": threading.active_count(), "error": error, "calls": len(stacks)})
        print(json.dumps(rows[-1]), flush=True)
    Path(a.out).write_text(json.dumps({"command": " ".join(sys.argv), "torch": torch.__version__, "rows": rows,
                                       "stacks": stacks}, indent=1))


def _patched(stacks: list[dict]) -> dict:
    """Inductor imported with `torch.cuda.is_available` answered by a child forked for the question."""
    import torch

    from vd.workflow import warm as w

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, b"1" if torch.cuda.is_available() else b"0")
        os._exit(0)
    os.close(write)
    answer = os.read(read, 1) == b"1"
    os.waitpid(pid, 0)
    real = torch.cuda.is_available

    def is_available() -> bool:
        stacks.append({"call": "is_available", "stack": traceback.format_stack(limit=12)})
        return answer

    torch.cuda.is_available = is_available
    t = time.perf_counter()
    try:
        for name in ("torch._inductor.compile_fx", "torch._dynamo.backends.inductor"):
            importlib.import_module(name)
    finally:
        torch.cuda.is_available = real
    row = {"module": "compile_fx patched", "answer": answer, "s": time.perf_counter() - t,
           "cuda": w.cuda_started(), "threads": threading.active_count(), "calls": len(stacks)}
    print(json.dumps(row), flush=True)
    return row


def _traced(module: str, stacks: list[dict]) -> dict:
    """Import ``module`` with a profile hook counting the process's threads at every call; the stack where the
    count first rose."""
    from vd.workflow import warm as w

    start = len(os.listdir("/proc/self/task"))
    seen = {"done": False}

    def hook(frame, event, arg):
        if seen["done"] or event not in ("call", "c_return", "return"):
            return
        if len(os.listdir("/proc/self/task")) > start:
            seen["done"] = True
            stacks.append({"call": f"threads rose at {event} {getattr(arg, '__name__', '')}",
                           "stack": traceback.format_stack(frame, limit=40)})

    t = time.perf_counter()
    sys.setprofile(hook)
    try:
        importlib.import_module(module)
    finally:
        sys.setprofile(None)
    row = {"module": module, "traced": True, "s": time.perf_counter() - t, "cuda": w.cuda_started(),
           "threads": threading.active_count()}
    print(json.dumps(row), *(s["stack"] for s in stacks), flush=True)
    return row


if __name__ == "__main__":
    main()

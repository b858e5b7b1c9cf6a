"""The environment a golden was recorded in, or a replay ran in: versions, CPU, threads, GPU, host.

CPU results can depend on the CPU's vector ISA (torch's dispatch capability) and on the thread count, so
both are captured; `numerics_differences` names the fields that can move a CPU or GPU result when they
differ between recording and replaying.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import socket
import subprocess
from importlib import metadata

import torch

import vd

# Fields whose difference can change the numbers, in the order a reader should see them.
NUMERIC_FIELDS = (
    "device", "cpu_capability", "cpu_model", "threads", "torch", "transformers", "gpu_name", "cuda",
    "cudnn", "driver",
)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        )
        return out.stdout.strip().splitlines()[0] or None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def capture(device: torch.device) -> dict:
    """The environment of this process, for a computation on ``device``."""
    env = {
        "vd": vd.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "zarr": _version("zarr"),
        "numpy": _version("numpy"),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "device": device.type,
        "cuda": torch.version.cuda,
        "cudnn": None,
        "gpu_name": None,
        "driver": None,
        "host": socket.gethostname(),
        "time": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }
    if device.type == "cuda":
        env["gpu_name"] = torch.cuda.get_device_name(device)
        env["cudnn"] = torch.backends.cudnn.version()
        env["driver"] = _driver()
    return env


def numerics_differences(recorded: dict, replayed: dict) -> list[str]:
    """``field: recorded → replayed`` for each numerics-relevant field that differs."""
    out = []
    for f in NUMERIC_FIELDS:
        a, b = recorded.get(f), replayed.get(f)
        if a != b:
            out.append(f"{f}: {a} → {b}")
    return out

"""How the benchmarks report a figure measured several times: its spread (`spread`), and ratios taken
repetition by repetition (`ratios`), since the repetitions are interleaved and a ratio of one repetition's
two sides is what drift on a shared machine cancels out of; and what a figure was measured on: the commit
(`commit`), the CPU (`cpu_model`) and how busy the machine was (`load_average`, taken before and after)."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def spread(values: Sequence[float]) -> dict:
    """``{"min", "median", "max", "n"}`` of ``values``."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def ratios(num: Sequence[float], den: Sequence[float]) -> dict:
    """The spread of ``num[i] / den[i]`` over the repetitions."""
    return spread([a / b for a, b in zip(num, den, strict=True)])


def load_average() -> list[float]:
    """The machine's load average over 1, 5 and 15 minutes: a figure from a busy machine is not a quiet one's."""
    return [round(x, 2) for x in os.getloadavg()]


def commit() -> str | None:
    """``VD_COMMIT`` where the caller set it (a lent GPU machine's copy of the working tree carries a .git that
    is not the checkout's), else the checkout's commit (short), ``-dirty`` when tracked files differ from it;
    None outside a git checkout."""
    if os.environ.get("VD_COMMIT"):
        return os.environ["VD_COMMIT"]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def cpu_model() -> str:
    """The CPU's model name as the kernel gives it (``platform.processor()`` is often empty on Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance() -> dict:
    """``commit`` and ``load_before``, taken as a benchmark starts; it adds ``load_after`` as it ends."""
    return {"commit": commit(), "load_before": load_average()}

"""Which device a model runs on: a name checked against this machine before anything is loaded.

Importing this module imports no torch (the command line checks a ``--device`` in a moment); checking does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from vd import preflight
from vd.errors import UsageError

if TYPE_CHECKING:
    import torch

# The built-in forwards that run on CUDA only: their static caches are captured or compiled for a GPU, and PyTorch
# has the memory-efficient and cuDNN SDPA backends for CUDA alone (its CPU runs math and flash).
CUDA_ONLY = ("graphed", "compiled", "compiled-graphed", "sdpa-efficient", "sdpa-cudnn")


def check_device_name(device: str) -> None:
    """`check_device`'s refusal of a CUDA device on a machine that cannot have one, known without torch
    (`vd.preflight.cuda_here`); where it may, `check_device` decides once torch is imported."""
    if device.startswith("cuda") and preflight.cuda_here() is False:
        raise UsageError(f"device {device!r} asked for, but this machine has no CUDA device")


def cpu_forward_hint(recorded: str, asked: Sequence[str]) -> str:
    """For a golden recorded with a CUDA-only forward and replayed on a machine without CUDA, naming no forward:
    the other flag such a replay needs (empty where it needs none)."""
    if asked or recorded not in CUDA_ONLY:
        return ""
    return (f", with --forward naming a CPU forward (it was recorded with {recorded!r}, which runs on CUDA only; "
            "`vd forwards` lists them)")


def check_device(device: str | torch.device) -> torch.device:
    """A torch device that exists here, or a UsageError."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise UsageError(f"unknown device {device!r} (use cpu or cuda)") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device {device!r} asked for, but this machine has no CUDA device")
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"unsupported device {device!r} (use cpu or cuda)")
    return dev

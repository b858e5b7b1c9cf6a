"""Which device a model runs on: a name checked against this machine before anything is loaded.

Importing this module imports no torch (the command line checks a ``--device`` in a moment); checking does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vd.errors import UsageError

if TYPE_CHECKING:
    import torch


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

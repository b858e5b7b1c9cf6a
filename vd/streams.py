"""One CUDA side stream per device for the process: work a replay queues beside its run (reading a
golden's small arrays, the comparison queued behind the last step) shares it, and so its cached memory."""

from __future__ import annotations

import torch

_SIDE: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of CUDA ``device``."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return _SIDE[device]

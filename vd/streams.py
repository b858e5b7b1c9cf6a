"""One CUDA side stream per device for the process: work queued beside a run (reading a golden's small arrays,
a replay's comparison and a recording's summary queued behind the last step: `Behind`) shares it, and so its
cached memory."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

_SIDE: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of CUDA ``device``."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return _SIDE[device]


class Behind:
    """``compute()`` queued on ``device``'s side stream behind the work queued so far on its current stream (a
    step still running), its result copied to page-locked memory without waiting; `result` waits for it."""

    def __init__(self, device: torch.device, compute: Callable[[], torch.Tensor]):
        stream = side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            out = compute()
            self.host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            self.host.copy_(out, non_blocking=True)
            self.done = stream.record_event()

    def result(self) -> np.ndarray:
        self.done.synchronize()
        return self.host.numpy()

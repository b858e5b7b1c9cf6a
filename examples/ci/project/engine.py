"""The engine this project guards, as a vd plug-in (vd.protocol.VerifyModel): here the tiny-llama preset
with an optional, deliberate regression, so the example shows a failing engine too.

``MY_ENGINE_BUG=1`` nudges one logit of step 3's second verify row by one ULP, the kind of change a fused
kernel makes; vd's replay must catch it.
"""

import os

import torch

from vd.models import load_model


class Engine:
    def __init__(self, inner, bug: bool):
        self.inner, self.bug, self.calls = inner, bug, 0
        self.vocab_size, self.device, self.dtype = inner.vocab_size, inner.device, inner.dtype
        self.identity, self.forwards = inner.identity, inner.forwards
        self.default_forward, self.set_forward = inner.default_forward, inner.set_forward
        self.encode, self.rewind = inner.encode, inner.rewind

    def reset(self):
        self.calls = 0
        self.inner.reset()

    def forward(self, tokens):
        rows = self.inner.forward(tokens)
        step, self.calls = self.calls - 1, self.calls + 1  # call 0 is the prefill
        if self.bug and step == 3 and len(tokens) > 1:
            rows = rows.clone()
            rows.view(torch.int16)[1, 7] += 1
        return rows


def factory(device="cpu", dtype="bfloat16"):
    return Engine(load_model("tiny-llama", device=device, dtype=dtype), os.environ.get("MY_ENGINE_BUG") == "1")

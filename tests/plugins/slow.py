"""A plug-in engine that takes ``VD_SLOW_S`` seconds (default 0.01) longer for every forward: tiny-llama's
numbers, slowly enough for a test to interrupt a recording in the middle of a K."""

import os
import time

from vd.models import load_model


class Slow:
    def __init__(self, inner, delay: float):
        self.inner, self.delay = inner, delay
        self.vocab_size, self.device, self.dtype = inner.vocab_size, inner.device, inner.dtype

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, tokens):
        time.sleep(self.delay)
        return self.inner.forward(tokens)


def factory(device, dtype):
    return Slow(load_model("tiny-llama", device=device, dtype=dtype), float(os.environ.get("VD_SLOW_S", "0.01")))

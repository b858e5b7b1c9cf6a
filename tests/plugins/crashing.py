"""A plug-in engine that crashes mid-run (``VD_CRASH_AT_STEP``: its forward raises on that verify step), for
the command line's internal-error path. Everything else is tiny-llama's."""

import os

from vd.models import load_model


class Crashing:
    def __init__(self, inner, at: int):
        self.inner, self.at, self.calls = inner, at, 0
        self.vocab_size, self.device, self.dtype = inner.vocab_size, inner.device, inner.dtype

    def __getattr__(self, name):  # the rest of the protocol is the wrapped model's
        return getattr(self.inner, name)

    def reset(self):
        self.calls = 0
        self.inner.reset()

    def forward(self, tokens):
        self.calls += 1
        if self.calls == self.at + 2:  # the prefill is call 1, verify step s is call s + 2
            raise RuntimeError(f"kernel fault at step {self.at}")
        return self.inner.forward(tokens)


def factory(device, dtype):
    return Crashing(load_model("tiny-llama", device=device, dtype=dtype), int(os.environ.get("VD_CRASH_AT_STEP", 2)))

"""A plug-in engine for tests: tiny-llama whose verify at one step is off by one ULP in one element.

``VD_PERTURB_STEP`` picks the step (default 3; ``all``: every step, the prefill left alone), ``VD_PERTURB_K``
the verify width it applies to (default: every width of two or more: a one-token decode has no row 1), so a
replay must fail exactly there. Its weights are tiny-llama's, so it keeps tiny-llama's fingerprint: the same
model, a different build.
"""

import os

import torch

from vd.models import load_model

ROW, INDEX = 1, 7


class Perturbed:
    def __init__(self, inner, step: int | None, k: int | None):
        self.inner, self.step, self.k = inner, step, k
        self.vocab_size, self.device, self.dtype = inner.vocab_size, inner.device, inner.dtype
        self.calls = 0

    def identity(self):
        return self.inner.identity()

    def forwards(self):
        return self.inner.forwards()

    def default_forward(self):
        return self.inner.default_forward()

    def set_forward(self, name):
        self.inner.set_forward(name)

    def encode(self, text):
        return self.inner.encode(text)

    def reset(self):
        self.calls = 0
        self.inner.reset()

    def forward(self, tokens):
        rows = self.inner.forward(tokens)
        s = self.calls - 1  # call 0 is the prefill
        self.calls += 1
        at = s >= 0 and self.step in (None, s) and self.k in (None, len(tokens))
        if at and len(tokens) > ROW:  # not a decode
            rows = rows.clone()
            bits = rows.view(torch.int16)  # one ULP: the next bit pattern
            bits[ROW, INDEX] += 1
        return rows

    def rewind(self, n):
        self.inner.rewind(n)


def factory(device, dtype):
    k, step = os.environ.get("VD_PERTURB_K"), os.environ.get("VD_PERTURB_STEP", "3")
    return Perturbed(load_model("tiny-llama", device=device, dtype=dtype),
                     None if step == "all" else int(step), int(k) if k else None)

"""A plug-in engine for the verify-against-decode axis: tiny-llama whose K-token verify is computed as K
one-token decodes, so its verify rows equal its decode rows bit for bit by construction, except one element of
one verify row moved by one ULP (a verify kernel that is not quite decode's).

``VD_STEPWISE_K``, ``VD_STEPWISE_STEP`` and ``VD_STEPWISE_ROW`` place the moved element (default K=3, step 0,
row 1, at vocabulary index 7); ``VD_STEPWISE_EXACT=1`` moves nothing. Its weights are tiny-llama's, so it keeps
tiny-llama's fingerprint: the same model, another build.
"""

import os

import torch

from vd.models import load_model

INDEX = 7


class Stepwise:
    def __init__(self, inner, k: int, step: int, row: int, exact: bool):
        self.inner, self.k, self.step, self.row, self.exact = inner, k, step, row, exact
        self.vocab_size, self.device, self.dtype = inner.vocab_size, inner.device, inner.dtype
        self.identity, self.default_forward, self.encode = inner.identity, inner.default_forward, inner.encode
        self.calls = 0

    def forwards(self):
        return {"eager": "tiny-llama's eager forward, a K-token verify computed as K one-token decodes"}

    def set_forward(self, name):
        if name != "eager":
            raise KeyError(name)
        self.inner.set_forward("eager")

    def reset(self):
        self.calls = 0
        self.inner.reset()

    def forward(self, tokens):
        s = self.calls - 1  # call 0 is the prefill
        self.calls += 1
        if s < 0 or len(tokens) == 1:
            return self.inner.forward(tokens)
        rows = torch.cat([self.inner.forward([t]) for t in tokens])
        if not self.exact and len(tokens) == self.k and s == self.step:
            rows.view(torch.int16)[self.row, INDEX] += 1  # one ULP: the next bit pattern
        return rows

    def rewind(self, n):
        self.inner.rewind(n)


def factory(device, dtype):
    return Stepwise(load_model("tiny-llama", device=device, dtype=dtype), int(os.environ.get("VD_STEPWISE_K", "3")),
                    int(os.environ.get("VD_STEPWISE_STEP", "0")), int(os.environ.get("VD_STEPWISE_ROW", "1")),
                    os.environ.get("VD_STEPWISE_EXACT") == "1")

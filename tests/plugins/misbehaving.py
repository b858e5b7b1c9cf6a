"""Plug-in engines that break the protocol in one way each (tiny-llama's otherwise), for the checks that name
them: a factory that raises, rows of the wrong width, rank or dtype, and logits that are all NaN."""

import torch

from vd.models import load_model


class Misbehaving:
    def __init__(self, inner, change):
        self.inner, self.change = inner, change
        self.vocab_size, self.device, self.dtype = inner.vocab_size, inner.device, inner.dtype

    def __getattr__(self, name):  # the rest of the protocol is the wrapped model's
        return getattr(self.inner, name)

    def forward(self, tokens):
        return self.change(self.inner.forward(tokens))


def _make(change):
    return lambda device, dtype: Misbehaving(load_model("tiny-llama", device=device, dtype=dtype), change)


def raising(device, dtype):
    raise RuntimeError("no GPU context could be created")


wide = _make(lambda rows: torch.cat([rows, rows[:, :1]], dim=1))
flat = _make(lambda rows: rows[-1])
float32 = _make(lambda rows: rows.float())
nan = _make(lambda rows: torch.full_like(rows, float("nan")))

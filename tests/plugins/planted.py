"""A plug-in engine for `vd locate`: SmolLM2 whose forward ``planted`` is its ``eager`` forward with one module's
output moved by one ULP (in each row, the element of largest magnitude, so that it can reach the logits) at every
call; ``VD_PLANT`` names the module (default ``model.layers.7.mlp.down_proj``). Its weights are SmolLM2's, so it
keeps SmolLM2's fingerprint: the same model, another build. It traces as the HF adapter does (delegated).
Its forward ``unsteady`` plants only while traced: a traced pass that does not reproduce the forward's rows.
"""

import contextlib
import os

import torch

from vd.models import load_model


class Planted:
    def __init__(self, inner, module: str):
        self.inner, self.module = inner, module
        self.vocab_size, self.device, self.dtype = inner.vocab_size, inner.device, inner.dtype
        self.identity, self.encode, self.decode = inner.identity, inner.encode, inner.decode
        self.reset, self.rewind = inner.reset, inner.rewind
        self.on = self.unsteady = self.tracing = False
        inner.model.get_submodule(module).register_forward_hook(self._plant)

    @contextlib.contextmanager
    def trace(self, record):
        self.tracing = True
        try:
            with self.inner.trace(record):
                yield
        finally:
            self.tracing = False

    def _plant(self, module, args, output):
        if not (self.on or self.unsteady and self.tracing):
            return None
        out = output.clone()
        rows = out.view(-1, out.shape[-1])
        at = rows.abs().argmax(dim=-1)
        bits = rows.view(torch.int32) if rows.dtype == torch.float32 else rows.view(torch.int16)
        bits[torch.arange(rows.shape[0]), at] += 1  # one ULP away from zero: the next bit pattern
        return out

    def forwards(self):
        return {"eager": "SmolLM2's eager forward",
                "planted": f"the eager forward with {self.module}'s output one ULP off in each row",
                "unsteady": f"the eager forward with {self.module}'s output one ULP off while traced"}

    def default_forward(self):
        return "eager"

    def set_forward(self, name):
        if name not in self.forwards():
            raise KeyError(name)
        self.on, self.unsteady = name == "planted", name == "unsteady"

    def forward(self, tokens):
        return self.inner.forward(tokens)

    def trace_forwards(self):
        return list(self.forwards())


def factory(device, dtype):
    return Planted(load_model("smollm2", device=device, dtype=dtype),
                   os.environ.get("VD_PLANT", "model.layers.7.mlp.down_proj"))

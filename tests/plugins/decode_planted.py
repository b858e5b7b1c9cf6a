"""A plug-in engine whose one-token decode kernel changed and its K-token verify kernel did not: tiny-llama whose
forward ``decplant`` is its ``eager`` forward with one module's output moved by one ULP (in each row, the element
of largest magnitude) in one-token calls only; ``VD_PLANT`` names the module (default
``model.layers.1.mlp.down_proj``). Its weights are tiny-llama's, so it keeps tiny-llama's fingerprint: the same
model, another build. It traces as the HF adapter does (delegated). (After a user test's plug-in.)
"""

import contextlib
import os

import torch

from vd.models import load_model


class DecodePlanted:
    def __init__(self, inner, module: str):
        self.inner, self.module = inner, module
        self.vocab_size, self.device, self.dtype = inner.vocab_size, inner.device, inner.dtype
        self.identity, self.encode, self.decode = inner.identity, inner.encode, inner.decode
        self.reset, self.rewind = inner.reset, inner.rewind
        self.on = False
        inner.model.get_submodule(module).register_forward_hook(self._plant)

    @contextlib.contextmanager
    def trace(self, record):
        with self.inner.trace(record):
            yield

    def _plant(self, module, args, output):
        if not self.on or output.reshape(-1, output.shape[-1]).shape[0] != 1:  # (a one-token call's only)
            return None
        out = output.clone()
        rows = out.view(-1, out.shape[-1])
        bits = rows.view(torch.int16)  # (bfloat16)
        bits[torch.arange(rows.shape[0]), rows.abs().argmax(dim=-1)] += 1
        return out

    def forwards(self):
        return {"eager": "tiny-llama's eager forward",
                "decplant": f"the eager forward with {self.module}'s output one ULP off in one-token calls"}

    def default_forward(self):
        return "eager"

    def set_forward(self, name):
        if name not in self.forwards():
            raise KeyError(name)
        self.inner.set_forward("eager")
        self.on = name == "decplant"

    def forward(self, tokens):
        return self.inner.forward(tokens)

    def trace_forwards(self):
        return list(self.forwards())


def factory(device, dtype):
    return DecodePlanted(load_model("tiny-llama", device=device, dtype=dtype),
                         os.environ.get("VD_PLANT", "model.layers.1.mlp.down_proj"))

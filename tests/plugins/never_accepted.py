"""A plug-in for tests: tiny-llama-mtp whose head always drafts the same token, one the model never
predicts on these prompts, so no draft is ever accepted: the drafter feed is too thin."""

import torch

from vd.models import load_model

TOKEN = 511


class NeverAccepted:
    def __init__(self, inner):
        self.inner = inner
        for name in ("vocab_size", "device", "dtype"):
            setattr(self, name, getattr(inner, name))
        for name in ("identity", "forwards", "default_forward", "set_forward", "encode", "reset", "forward",
                     "rewind", "head_info", "save_hidden", "trim_proposer"):
            setattr(self, name, getattr(inner, name))

    def propose(self, last, n):
        _, rows = self.inner.propose(last, n)
        rows = rows.clone()
        rows[:, TOKEN] = torch.finfo(rows.dtype).max
        return [TOKEN] * n, rows


def factory(device, dtype):
    return NeverAccepted(load_model("tiny-llama-mtp", device=device, dtype=dtype))

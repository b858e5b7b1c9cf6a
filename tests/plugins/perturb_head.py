"""A plug-in for tests: tiny-llama-mtp whose draft head is off by one ULP in one logit at one step.

``VD_PERTURB_STEP`` (default 2) names the verify step whose proposal is perturbed; the drafts themselves
and every verify row are untouched, so a replay must fail in the draft rows only, exactly there.
"""

import os

import torch

from vd.models import load_model

INDEX = 7


class PerturbedHead:
    def __init__(self, inner, step: int):
        self.inner, self.step, self.proposals = inner, step, 0
        for name in ("vocab_size", "device", "dtype"):
            setattr(self, name, getattr(inner, name))
        for name in ("identity", "forwards", "default_forward", "set_forward", "encode", "forward", "rewind",
                     "head_info", "save_hidden", "trim_proposer"):
            setattr(self, name, getattr(inner, name))

    def reset(self):
        self.proposals = 0
        self.inner.reset()

    def propose(self, last, n):
        drafts, rows = self.inner.propose(last, n)
        if self.proposals == self.step:  # proposal s is the one step s verifies
            rows = rows.clone()
            rows.view(torch.int16)[0, INDEX] += 1
        self.proposals += 1
        return drafts, rows


def factory(device, dtype):
    return PerturbedHead(load_model("tiny-llama-mtp", device=device, dtype=dtype),
                         int(os.environ.get("VD_PERTURB_STEP", "2")))

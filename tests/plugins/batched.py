"""Plug-in engines for the batch axis (`vd.protocol.BatchedForwards`): tiny-llama whose batch runs each member's
tokens through the eager forward over that member's own cache, one after another.

``invariant``: a member's rows are what `forward` gives, whatever shares the batch (a batch-invariant engine).
``variant``: where more than one member appends tokens in a call, every member's logits are summed in another
order (the LM head's dot products in two halves, added in float32), as a kernel chosen by the batch's row
count would: rows off by a few ULP in the last bits. A batch of one is `forward` in both. Their weights are
tiny-llama's, so they keep tiny-llama's fingerprint: the same model, another build.
"""

import torch

from vd.models import load_model


class Batched:
    def __init__(self, inner, variant: bool):
        self.inner, self.variant = inner, variant
        self.vocab_size, self.device, self.dtype = inner.vocab_size, inner.device, inner.dtype
        self.identity, self.encode, self.decode = inner.identity, inner.encode, inner.decode
        self.caches: list = []
        self.single = None  # the sequence `forward` steps, kept aside while a batch runs

    def forwards(self):
        return {"eager": "tiny-llama's eager forward; a batch runs its members one after another"
                + (", their logits summed in two halves when members share a call" if self.variant else "")}

    def default_forward(self):
        return "eager"

    def set_forward(self, name):
        if name != "eager":
            raise KeyError(name)
        self.inner.set_forward("eager")

    def reset(self):
        self.inner.reset()

    def forward(self, tokens):
        return self.inner.forward(tokens)

    def rewind(self, n):
        self.inner.rewind(n)

    def batch_forwards(self):
        return ["eager"]

    def reset_batch(self, n, capacity):
        from transformers import DynamicCache

        self.caches = [DynamicCache(config=self.inner.config) for _ in range(n)]

    def forward_batch(self, tokens):
        shared = sum(1 for t in tokens if t) > 1
        single, out = self.inner._cache, []
        try:
            for cache, ids in zip(self.caches, tokens):
                self.inner._cache = cache
                out.append(self._split(ids) if self.variant and shared else self.inner.forward(ids))
        finally:
            self.inner._cache = single
        return out

    @torch.inference_mode()
    def _split(self, ids):
        _, hidden = self.inner._run(ids, hidden=True)  # [n, H] after the final norm
        w = self.inner.model.get_output_embeddings().weight
        h = hidden.shape[-1] // 2
        halves = (hidden[:, :h] @ w[:, :h].T).float() + (hidden[:, h:] @ w[:, h:].T).float()
        return halves.to(self.dtype)

    def rewind_batch(self, member, n):
        if n:
            self.caches[member].crop(-n)

    def reorder_batch(self, order):
        self.caches = [self.caches[i] for i in order]


def invariant(device, dtype):
    return Batched(load_model("tiny-llama", device=device, dtype=dtype), variant=False)


def variant(device, dtype):
    return Batched(load_model("tiny-llama", device=device, dtype=dtype), variant=True)


class PerMemberTrace(Batched):
    """``variant`` with tiny-llama's module trace: in a batch each member's points are handed as that member
    runs, ``[L, ...]``, not once for the batch as ``[n, L, ...]`` (`vd.protocol.ModuleTrace`): refused."""

    def trace_forwards(self):
        return self.inner.trace_forwards()

    def trace(self, record):
        return self.inner.trace(record)


class Float32Batch(Batched):
    """``invariant`` whose batch returns float32 rows (its `forward`, the model's dtype)."""

    def forward_batch(self, tokens):
        return [rows.float() for rows in super().forward_batch(tokens)]


def per_member_trace(device, dtype):
    return PerMemberTrace(load_model("tiny-llama", device=device, dtype=dtype), variant=True)


def float32_batch(device, dtype):
    return Float32Batch(load_model("tiny-llama", device=device, dtype=dtype), variant=False)

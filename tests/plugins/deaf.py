"""A plug-in engine for tests that never looks at a verify's last draft (it feeds the one before it
twice), so changing that draft changes nothing: the detection control must call it blind."""

from vd.models import load_model


class Deaf:
    def __init__(self, inner):
        self.inner = inner
        self.vocab_size, self.device, self.dtype = inner.vocab_size, inner.device, inner.dtype
        self.identity, self.forwards = inner.identity, inner.forwards
        self.default_forward, self.set_forward = inner.default_forward, inner.set_forward
        self.encode, self.reset, self.rewind = inner.encode, inner.reset, inner.rewind

    def forward(self, tokens):
        tokens = list(tokens)
        if len(tokens) > 1:
            tokens[-1] = tokens[-2]
        return self.inner.forward(tokens)


def factory(device, dtype):
    return Deaf(load_model("tiny-llama", device=device, dtype=dtype))

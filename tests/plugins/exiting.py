"""Plug-in engines that end, or try to end, the process from inside vd (tiny-llama's otherwise), for the
plug-in boundary that turns what they raise into one line naming them (exit 2): ``sys.exit(0)`` in a forward
(which would read as PASS), a `BaseException` that is not an `Exception` in a forward and ``SystemExit(1)``
there (which would read as FAIL), ``sys.exit(0)`` in the factory, an `identity` that raises, and a
``set_forward`` that exits."""

import sys

from vd.models import load_model


class Doom(BaseException):
    """Not an Exception: what ``except Exception`` lets through."""


class Exiting:
    def __init__(self, inner, forward=None, identity=None, set_forward=None):
        self.inner, self.raises, self.calls = inner, {"forward": forward, "identity": identity,
                                                      "set_forward": set_forward}, 0
        self.vocab_size, self.device, self.dtype = inner.vocab_size, inner.device, inner.dtype

    def __getattr__(self, name):  # the rest of the protocol is the wrapped model's
        return getattr(self.inner, name)

    def _maybe(self, method):
        if self.raises[method] is not None:
            self.raises[method]()

    def forward(self, tokens):
        self.calls += 1
        if self.calls == 3:  # the prefill is call 1: the first verify step
            self._maybe("forward")
        return self.inner.forward(tokens)

    def identity(self):
        self._maybe("identity")
        return self.inner.identity()

    def set_forward(self, name):
        self._maybe("set_forward")
        self.inner.set_forward(name)


def _make(**raises):
    return lambda device, dtype: Exiting(load_model("tiny-llama", device=device, dtype=dtype), **raises)


def _doom():
    raise Doom("the engine's own way out")


def _exit1():
    raise SystemExit(1)


def _lookup():
    raise LookupError("no fingerprint for this build")


exit0_in_forward = _make(forward=lambda: sys.exit(0))
exit1_in_forward = _make(forward=_exit1)
doom_in_forward = _make(forward=_doom)
identity_raising = _make(identity=_lookup)
exit0_in_set_forward = _make(set_forward=lambda: sys.exit(0))


def exit0_in_factory(device, dtype):
    sys.exit(0)

"""Plug-in engines that break the protocol in one way each (tiny-llama's otherwise), for the checks that name
them: a factory that raises, rows of the wrong width, rank or dtype, logits that are all NaN (or one NaN in a
late one-token decode), rows on another device than the model's, rows returned
in one reused output buffer (as llama-cpp-python's logits array, viewed without a copy), rows written into
after they were returned, and an engine that
computes float32 whatever dtype it is asked for; a draft head proposing one draft too few, rows too few, or
tokens outside the vocabulary."""

import os

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
elsewhere = _make(lambda rows: rows.to("meta"))  # rows on another device than the model says it computes on


class _AtCall(Misbehaving):
    """Rows changed by ``alter`` (a copy of them) at the ``nth`` call of ``length`` tokens after each reset."""

    def __init__(self, inner, length, nth, alter):
        super().__init__(inner, None)
        self.length, self.nth, self.alter = length, nth, alter

    def reset(self):
        self.calls = 0
        self.inner.reset()

    def forward(self, tokens):
        rows = self.inner.forward(tokens)
        if len(tokens) == self.length:
            self.calls = getattr(self, "calls", 0) + 1
            if self.calls == self.nth:
                rows = self.alter(rows.clone())
        return rows


def _nan_at_5(rows):
    rows[0, 5] = float("nan")
    return rows


def nan_late_decode(device, dtype):
    """One NaN in the seventh one-token decode (a decode kernel broken late in a sequence): the verify runs' rows
    stay finite."""
    return _AtCall(load_model("tiny-llama", device=device, dtype=dtype), 1, 7, _nan_at_5)


class _Reused(Misbehaving):
    """Every forward's rows written into one buffer, and a view of it returned."""

    def forward(self, tokens):
        rows = self.inner.forward(tokens)
        if not hasattr(self, "buffer"):
            self.buffer = torch.empty(1024, rows.shape[1], dtype=rows.dtype, device=rows.device)
        out = self.buffer[:rows.shape[0]]
        out.copy_(rows)
        return out


class _Scribbling(Misbehaving):
    """New tensors each forward, but the last one written into when the sequence is rewound."""

    def forward(self, tokens):
        self.last = self.inner.forward(tokens).clone()
        return self.last

    def rewind(self, n):
        if n and getattr(self, "last", None) is not None:
            self.last[0, 0] += 1
        self.inner.rewind(n)


def scribbling(device, dtype):
    return _Scribbling(load_model("tiny-llama", device=device, dtype=dtype), None)


def _other_token_on_top(rows):
    rows[0, (int(rows[0].argmax()) + 1) % rows.shape[1]] = rows[0].max() + 1
    return rows


def drifting(device, dtype):
    """Verify rows (three-token calls) that at the third such call of a sequence put another token on top of their
    first row: the verify path disagrees with the engine's own one-token decode at step 2."""
    return _AtCall(load_model("tiny-llama", device=device, dtype=dtype), 3, 3, _other_token_on_top)


def aliasing(device, dtype):
    return _Reused(load_model("tiny-llama", device=device, dtype=dtype), None)


def computes_float32(device, dtype):
    return load_model("tiny-llama", device=device, dtype="float32")  # the dtype asked for is ignored


class _Built(Misbehaving):
    """tiny-llama reporting an engine build of its own (`environment()`), from ``VD_ENGINE_BUILD``."""

    def forward(self, tokens):
        return self.inner.forward(tokens)

    def environment(self):
        return {"engine": {"name": "tiny-engine", "build": os.environ.get("VD_ENGINE_BUILD", "1")}}


def built(device, dtype):
    return _Built(load_model("tiny-llama", device=device, dtype=dtype), None)


class _Vocabless(Misbehaving):
    """tiny-llama whose ``vocab_size`` is a property that raises."""

    def __init__(self, inner, change):
        self.inner, self.change = inner, change
        self.device, self.dtype = inner.device, inner.dtype

    @property
    def vocab_size(self):
        raise RuntimeError("the engine has no vocabulary loaded")


def vocabless(device, dtype):
    return _Vocabless(load_model("tiny-llama", device=device, dtype=dtype), lambda rows: rows)


def textual_vocab(device, dtype):
    m = _make(lambda rows: rows)(device, dtype)
    m.vocab_size = "512"
    return m


def _proposing(change):
    """tiny-llama-mtp whose draft head's proposals are changed by ``change(drafts, rows)``."""
    def factory(device, dtype):
        inner = load_model("tiny-llama-mtp", device=device, dtype=dtype)
        propose = inner.propose
        inner.propose = lambda last, n: change(*propose(last, n))
        return inner
    return factory


one_short = _proposing(lambda drafts, rows: (drafts[:-1], rows[:-1]))
rows_short = _proposing(lambda drafts, rows: (drafts, rows[:-1]))
beyond_vocab = _proposing(lambda drafts, rows: ([d + 512 for d in drafts], rows))

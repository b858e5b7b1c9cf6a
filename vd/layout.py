"""The values a recording is made of, shared by the loop, the store and the comparison: a verify step, a
K's step log, and how a K's logits rows are laid out.

A K's rows, in the one order every part of vd uses (`RowLayout`): the ``P`` prefill rows, then each
step's ``K`` verify rows, then for the drafter feed the bootstrap decode's row and each step's ``K-1``
draft rows. This module holds no tensors and does no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

KINDS = ("prefill", "verify", "draft")  # the kinds of row, in layout order


@dataclass(frozen=True, slots=True)
class Step:
    """One verify step's inputs ``[last, d1 .. d_{K-1}]`` and how many drafts it accepted."""

    tokens: tuple[int, ...]
    accepted: int


@dataclass(frozen=True, slots=True)
class StepLog:
    """One K's step log: what a replay needs to drive its steps, without any logits rows.

    ``bootstrap`` is the token the first step starts from; ``decoded`` (drafter feed) the token the
    bootstrap decode ran on; ``committed_is_greedy`` whether the committed sequence equals the greedy
    continuation (None where not recorded).
    """

    k: int
    bootstrap: int
    tokens: np.ndarray  # int32 [S, K]
    accepted: np.ndarray  # int32 [S]
    step_ms: np.ndarray  # float64 [S]
    committed_is_greedy: bool | None = None
    decoded: int | None = None

    @property
    def steps(self) -> list[Step]:
        return [Step(tuple(row), a) for row, a in zip(self.tokens.tolist(), self.accepted.tolist())]

    def same_steps(self, other: StepLog) -> bool:
        """Whether ``other`` drives the same steps (tokens, accept counts, bootstrap and decoded tokens)."""
        return (np.array_equal(self.tokens, other.tokens) and np.array_equal(self.accepted, other.accepted)
                and self.bootstrap == other.bootstrap and self.decoded == other.decoded)

    def to_json(self) -> dict:
        return {"bootstrap": int(self.bootstrap), "decoded": self.decoded,
                "committed_is_greedy": self.committed_is_greedy, "tokens": self.tokens.tolist(),
                "accepted": self.accepted.tolist(), "step_ms": self.step_ms.tolist()}

    @classmethod
    def from_json(cls, k: int, e: Mapping) -> StepLog:
        """A `to_json` copy back (KeyError, TypeError or ValueError if it is malformed)."""
        return cls(k=k, bootstrap=int(e["bootstrap"]), decoded=e.get("decoded"),
                   committed_is_greedy=e.get("committed_is_greedy"),
                   tokens=np.asarray(e["tokens"], dtype=np.int32).reshape(-1, k),
                   accepted=np.asarray(e["accepted"], dtype=np.int32),
                   step_ms=np.asarray(e.get("step_ms", []), dtype=np.float64))


@dataclass(frozen=True, slots=True)
class RowLayout:
    """How one K's rows are laid out: ``prompt`` prefill rows, ``steps`` × ``k`` verify rows and, when
    ``drafted`` (the drafter feed), one bootstrap row and ``steps`` × (``k`` - 1) draft rows."""

    prompt: int
    steps: int
    k: int
    drafted: bool = False

    @property
    def counts(self) -> dict[str, int]:
        """Rows per kind, in layout order."""
        out = {"prefill": self.prompt, "verify": self.steps * self.k}
        if self.drafted:
            out["draft"] = 1 + self.steps * (self.k - 1)
        return out

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def offset(self, kind: str) -> int:
        """The flat index of ``kind``'s first row."""
        at = 0
        for name, n in self.counts.items():
            if name == kind:
                return at
            at += n
        raise KeyError(kind)

    def per_step(self, kind: str) -> int:
        """Rows of ``kind`` one step computes (the prefill counts as one step of ``prompt`` rows)."""
        return {"prefill": self.prompt, "verify": self.k, "draft": self.k - 1}[kind]

    def lead(self, kind: str) -> int:
        """Rows of ``kind`` before its first step's: the draft kind's bootstrap row."""
        return 1 if kind == "draft" else 0

    def locate(self, kind: str, i: int) -> tuple[int | None, int]:
        """Row ``i`` of ``kind`` as (step, row within the step); the step is None for the prefill's rows
        and for the bootstrap row (row 0 of the draft kind)."""
        if kind == "prefill":
            return None, i
        j = i - self.lead(kind)
        if j < 0:
            return None, 0
        per = self.per_step(kind)
        return j // per, j % per

    def step_rows(self, kind: str, step: int | None) -> np.ndarray:
        """The rows of ``kind`` that ``step`` computed (None: the prefill's rows, or the bootstrap row)."""
        if kind == "prefill":
            return np.arange(self.prompt)
        if step is None:
            return np.array([0])
        per, lead = self.per_step(kind), self.lead(kind)
        return np.arange(lead + step * per, lead + (step + 1) * per)

    def by_step(self, kind: str, values: np.ndarray) -> np.ndarray:
        """``kind``'s per-row values arranged ``[steps, per_step]`` (the bootstrap row left out)."""
        per, lead = self.per_step(kind), self.lead(kind)
        return values[lead:lead + self.steps * per].reshape(self.steps, per)

    def split(self, flat):
        """A flat ``[R, ...]`` array or tensor of every row as a dict of each kind's rows."""
        out, at = {}, 0
        for kind, n in self.counts.items():
            out[kind] = flat[at:at + n]
            at += n
        return out


def accepted(tokens: Sequence[int], argmaxes: Sequence[int]) -> int:
    """Leading drafts the verify accepted: draft ``j`` stands when row ``j - 1``'s argmax is it."""
    n = 0
    for j in range(1, len(tokens)):
        if argmaxes[j - 1] != tokens[j]:
            break
        n += 1
    return n

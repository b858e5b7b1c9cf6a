"""Comparing a run's logits rows with a golden's, byte for byte, and the thin-reference check.

Equality is on the stored bit patterns (so a NaN equals only the same NaN, and -0.0 differs from 0.0):
the question vd answers is whether a change moved the model's numbers at all. Tolerances are a later
layer over the same differences.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from vd.golden import KRecord, as_bits, to_float, to_storage
from vd.loop import Run


@dataclass(frozen=True, slots=True)
class Mismatch:
    """Where two sets of rows first differ: step (None for the prefill), row, vocab index, both values."""

    step: int | None
    row: int
    index: int
    golden: float
    got: float


@dataclass(frozen=True, slots=True)
class Comparison:
    """One forward's rows against the golden's, for one K.

    The ``draft_*`` fields and ``bootstrap_equal`` compare the MTP head's outputs and are None for a
    reference golden.
    """

    variant: str
    prefill_equal: bool
    mismatched_steps: int
    steps: int
    first_mismatch: Mismatch | None
    max_abs_diff: float
    prefill_first_mismatch: Mismatch | None = None
    mismatched_step_list: list[int] = field(default_factory=list)
    # Steps where this run's own argmaxes would have accepted a different number of drafts.
    decision_changes: int = 0
    bootstrap_equal: bool | None = None
    draft_mismatched_steps: int | None = None
    draft_first_mismatch: Mismatch | None = None
    draft_max_abs_diff: float | None = None
    draft_mismatched_step_list: list[int] | None = None

    @property
    def equal(self) -> bool:
        return (self.prefill_equal and self.mismatched_steps == 0 and self.bootstrap_equal is not False
                and not self.draft_mismatched_steps)

    def to_json(self) -> dict:
        return asdict(self)


def _first(gold: np.ndarray, got: np.ndarray, logical: str, step: int | None) -> Mismatch | None:
    """The first differing element of two 2-D storage arrays ``[rows, V]``."""
    diff = as_bits(gold) != as_bits(got)
    if not diff.any():
        return None
    row, index = (int(i) for i in np.argwhere(diff)[0])
    g, c = to_float(gold[row, index : index + 1], logical), to_float(got[row, index : index + 1], logical)
    return Mismatch(step, row, index, float(g[0]), float(c[0]))


def _max_abs(gold: np.ndarray, got: np.ndarray, logical: str) -> float:
    """Largest absolute difference over elements whose bits differ (inf where one side is NaN)."""
    diff = as_bits(gold) != as_bits(got)
    if not diff.any():
        return 0.0
    d = np.abs(to_float(gold[diff], logical) - to_float(got[diff], logical))
    d[np.isnan(d)] = np.inf
    return float(d.max())


def _diff_steps(gold: np.ndarray, got: np.ndarray, logical: str) -> tuple[list[int], Mismatch | None, float]:
    """Per-step diff of ``[S, R, V]`` rows: the differing steps, the first mismatch, the largest |Δ|."""
    per_step = (as_bits(gold) != as_bits(got)).reshape(len(gold), -1).any(axis=1)
    bad = [int(s) for s in np.flatnonzero(per_step)]
    first = _first(gold[bad[0]], got[bad[0]], logical, bad[0]) if bad else None
    return bad, first, _max_abs(gold, got, logical)


def _stack(rows: list[torch.Tensor], like: np.ndarray) -> np.ndarray:
    return to_storage(torch.stack(rows)) if rows else np.empty((0,) + like.shape[1:], like.dtype)


def compare_run(variant: str, golden: KRecord, run: Run, logical: str) -> Comparison:
    """Diff every row of ``run`` (its prefill, each step's K rows and, for an MTP golden, the bootstrap
    decode row and the head's draft rows) against ``golden``."""
    prefill = to_storage(run.prefill)
    rows = _stack(run.rows, golden.logits)
    assert prefill.shape == golden.prefill.shape and rows.shape == golden.logits.shape, "shapes checked on load"
    bad, first, max_abs = _diff_steps(golden.logits, rows, logical)
    pre_first = _first(golden.prefill, prefill, logical, None)
    mtp = {}
    if golden.draft_logits is not None:
        drafts = _stack(run.draft_rows, golden.draft_logits)
        dbad, dfirst, dmax = _diff_steps(golden.draft_logits, drafts, logical)
        boot = to_storage(run.bootstrap_row)
        mtp = dict(bootstrap_equal=_first(golden.bootstrap_logits, boot, logical, None) is None,
                   draft_mismatched_steps=len(dbad), draft_first_mismatch=dfirst, draft_max_abs_diff=dmax,
                   draft_mismatched_step_list=dbad)
        max_abs = max(max_abs, _max_abs(golden.bootstrap_logits, boot, logical))
    return Comparison(
        variant=variant,
        prefill_equal=pre_first is None,
        mismatched_steps=len(bad),
        steps=len(rows),
        first_mismatch=first,
        max_abs_diff=max(_max_abs(golden.prefill, prefill, logical), max_abs),
        prefill_first_mismatch=pre_first,
        mismatched_step_list=bad,
        decision_changes=sum(int(a != b) for a, b in zip(run.computed, golden.accepted.tolist())),
        **mtp,
    )


def thin_reason(k: int, accepted: Sequence[int]) -> str | None:
    """Why a reference is too thin to trust (it must hold a full and a partial accept), or None."""
    full = sum(1 for a in accepted if a == k - 1)
    if full == 0 or full == len(accepted):
        return (f"verify K={k}: the reference accepted {list(accepted)}; "
                "it needs both full and partial accepts")
    return None


def histogram(k: int, accepted: Sequence[int]) -> list[int]:
    """How many steps accepted 0, 1, .., K-1 drafts."""
    out = [0] * k
    for a in accepted:
        out[a] += 1
    return out

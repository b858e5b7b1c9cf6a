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


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A logits tensor viewed as signed integers of its width: equal bits, equal integers."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _on_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """Golden storage rows as integer bits on the candidate's device."""
    bits = np.ascontiguousarray(a).view({2: np.int16, 4: np.int32}[a.dtype.itemsize])
    return torch.from_numpy(bits).to(device)


def _diff_steps(gold: np.ndarray, got: torch.Tensor, logical: str,
                gold_dev: torch.Tensor | None = None) -> tuple[list[int], Mismatch | None, float]:
    """Per-step diff of golden ``[S, R, V]`` storage rows against candidate rows on their device.

    The equality test runs where the candidate is (the GPU, for a CUDA forward), against the golden's
    bits already there when ``gold_dev`` is given, and only one flag per step comes back; only steps that
    differ are copied to the host for their details.
    """
    if not len(gold):
        return [], None, 0.0
    if gold_dev is None or gold_dev.device != got.device:
        gold_dev = _on_device(gold, got.device)
    differs = (gold_dev.view(gold.shape) != _bits(got)).flatten(1).any(dim=1).tolist()
    bad = [s for s, d in enumerate(differs) if d]
    if not bad:
        return [], None, 0.0
    g, c = gold[bad], to_storage(got[bad])
    return bad, _first(g[0], c[0], logical, bad[0]), _max_abs(g, c, logical)


def _stack(rows: list[torch.Tensor], like: np.ndarray) -> torch.Tensor:
    if rows:
        return torch.stack(rows)
    return torch.empty((0,) + like.shape[1:])


def compare_run(variant: str, golden: KRecord, run: Run, logical: str,
                device_rows: dict[str, torch.Tensor] | None = None) -> Comparison:
    """Diff every row of ``run`` (its prefill, each step's K rows and, for an MTP golden, the bootstrap
    decode row and the head's draft rows) against ``golden`` (whose arrays ``device_rows`` holds on the
    run's device already, when prefetched)."""
    dev = device_rows or {}
    rows = _stack(run.rows, golden.logits)
    assert tuple(run.prefill.shape) == golden.prefill.shape and tuple(rows.shape) == golden.logits.shape, \
        "shapes checked on load"
    bad, first, max_abs = _diff_steps(golden.logits, rows, logical, dev.get("logits"))
    _, pre_first, pre_max = _diff_steps(golden.prefill[None], run.prefill[None], logical, dev.get("prefill"))
    if pre_first is not None:
        pre_first = Mismatch(None, pre_first.row, pre_first.index, pre_first.golden, pre_first.got)
    mtp = {}
    if golden.draft_logits is not None:
        dbad, dfirst, dmax = _diff_steps(golden.draft_logits, _stack(run.draft_rows, golden.draft_logits), logical,
                                         dev.get("draft_logits"))
        boot_bad, _, boot_max = _diff_steps(golden.bootstrap_logits[None], run.bootstrap_row[None], logical,
                                            dev.get("bootstrap_logits"))
        mtp = dict(bootstrap_equal=not boot_bad, draft_mismatched_steps=len(dbad), draft_first_mismatch=dfirst,
                   draft_max_abs_diff=dmax, draft_mismatched_step_list=dbad)
        max_abs = max(max_abs, boot_max)
    return Comparison(
        variant=variant,
        prefill_equal=pre_first is None,
        mismatched_steps=len(bad),
        steps=len(rows),
        first_mismatch=first,
        max_abs_diff=max(pre_max, max_abs),
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

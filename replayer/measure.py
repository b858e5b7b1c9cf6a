"""Measuring a run's rows against a golden's, row by row, on the candidate's device.

Which rows differ is decided by digest (`vd.store.side.GoldenSide.differ`) in one read-back; a row whose
digest equals the golden's has every measure zero and the golden's argmax. Only rows that differ are
fetched from the golden and measured element by element: how many elements differ and the first one,
the largest absolute and ULP difference, the KL divergence, where in the vocabulary the differences sit;
each is judged under its kind's `vd.policy.Spec`. A slim golden has no rows to fetch: a differing row
fails under ``exact``, is judged by its argmax under ``argmax``, and its element measures are unknown
(NaN); its statistics and the candidate's say how it moved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vd.digest import STATS, stats_tensor
from vd.policy import Policy, Spec
from vd.rowmath import MEASURES, POSITION_BINS, measure_differing, rows_per_block
from vd.store.side import GoldenSide


@dataclass(slots=True)
class Rows:
    """Per-row measurements of one kind's ``R`` candidate rows against the golden's (arrays of length R,
    or ``[R, len(STATS)]`` for ``got_stats``, NaN for rows that do not differ)."""

    differ: np.ndarray
    passed: np.ndarray
    n_diff: np.ndarray
    first_index: np.ndarray
    first_golden: np.ndarray
    first_got: np.ndarray
    max_abs: np.ndarray
    max_ulp: np.ndarray
    kl: np.ndarray
    dp: np.ndarray  # the candidate's probability of the golden's top token minus the golden's
    golden_argmax: np.ndarray
    got_argmax: np.ndarray
    margin: np.ndarray  # the golden row's top-1 minus top-2
    top1: np.ndarray  # the golden row's top-1 value
    golden_absmax: np.ndarray
    top1_p: np.ndarray
    got_stats: np.ndarray | None  # the candidate's statistics of its differing rows (None: no row differs)
    positions: np.ndarray  # differing elements per vocabulary bin, summed over rows
    measured: bool = True  # False: the golden's rows were not at hand (a slim golden)


class Measurer:
    """One run's rows measured against the golden's a block at a time, as the run lets them go (`add`: a
    kind's consecutive rows, whole steps, from row ``start`` of the kind), so a run never holds all its rows;
    `result` gives every kind's `Rows`. ``side`` is the golden's `GoldenSide`, or a function that makes it
    (called at the first block: on CUDA a replay builds it in the run's idle time). For each kind it keeps the
    candidate's rows of the first step whose rows fail or flip an argmax (`kept`), which a first-divergence
    bundle shows. ``observe(kind, start, rows)`` sees every block too (the verify-against-decode axis measures
    the same rows: `vd.equivalence.Accumulator`)."""

    def __init__(self, side: GoldenSide | Callable[[], GoldenSide], logical: str, policy: Policy,
                 observe: Callable[[str, int, torch.Tensor], None] | None = None):
        self._side, self.logical, self.policy, self.observe = side, logical, policy, observe
        self._kinds: dict[str, _Tally] = {}
        self.kept: dict[str, tuple[int | None, torch.Tensor]] = {}

    @property
    def side(self) -> GoldenSide:
        if not isinstance(self._side, GoldenSide):
            self._side = self._side()
        return self._side

    def add(self, kind: str, start: int, got: torch.Tensor, differ: np.ndarray | None = None) -> None:
        """Rows ``start ..`` of ``kind`` (``got``, ``[n, V]``); ``differ``, when given, says which differ (asked
        of the GPU during the run), else their digests are compared here."""
        side = self.side
        if self.observe is not None:
            self.observe(kind, start, got)
        if differ is None:
            differ = side.differ_at(got, side.layout.offset(kind) + start).cpu().numpy()
        if kind not in self._kinds:
            self._kinds[kind] = _Tally(side, kind, self.logical, self.policy[kind])
        bad = self._kinds[kind].add(start, got, differ)
        if bad is not None and kind not in self.kept:
            step = side.layout.locate(kind, bad)[0] if kind != "prefill" else None
            at = side.layout.step_rows(kind, step) - start
            self.kept[kind] = (step, got[torch.from_numpy(at).to(got.device)].clone())

    def result(self) -> dict[str, Rows]:
        """Every kind's measured rows, in layout order; every row of the golden's must have been added (a row
        never compared is never taken for an equal one)."""
        side = self.side
        for kind, n in side.counts.items():
            added = self._kinds[kind].added if kind in self._kinds else 0
            if added != n:
                raise AssertionError(f"{side.where}: {added} of {n} {kind} rows were compared")
        return {kind: self._kinds[kind].rows() for kind in side.counts}


class _Tally:
    """One kind's measures, filled a block of rows at a time."""

    def __init__(self, side: GoldenSide, kind: str, logical: str, spec: Spec):
        self.side, self.kind, self.logical, self.spec = side, kind, logical, spec
        n = side.counts[kind]
        self.golden = side.stats(kind)
        self.differ = np.zeros(n, dtype=bool)
        self.passed = np.ones(n, dtype=bool)
        self.got_argmax = self.golden["argmax"]
        self.host: dict[str, np.ndarray] | None = None  # MEASURES, made at the first differing row
        self.got_stats: np.ndarray | None = None
        self.positions = np.zeros(POSITION_BINS, dtype=np.int64)
        self.measured = True
        self.added = 0  # rows added so far

    def add(self, start: int, got: torch.Tensor, differ: np.ndarray) -> int | None:
        """Rows ``start .. start + len(got)``; the first of them that fails or flips its argmax, if any."""
        self.differ[start:start + differ.size] = differ
        self.added += differ.size
        if not differ.any():
            return None
        n = self.differ.size
        if self.host is None:
            self.host = {m: np.zeros(n, dtype=np.float64) for m in MEASURES}
            self.got_argmax = self.got_argmax.copy()
            self.got_stats = np.full((n, len(STATS)), np.nan)
        side, host, golden, got_stats = self.side, self.host, self.golden, self.got_stats
        assert got_stats is not None
        local = np.flatnonzero(differ)
        self.measured = side.has_rows
        per_block = rows_per_block(got.device, got.shape[1])  # float copies stay bounded
        for part in np.array_split(local, -(-local.size // per_block)):
            cand = got[torch.from_numpy(part).to(got.device)]
            at = part + start
            got_stats[at] = stats_tensor(cand).T.cpu().numpy()
            self.got_argmax[at] = got_stats[at, 0].astype(np.int64)
            if self.measured:
                vals, ok, pos = measure_differing(side.rows(self.kind, at, got.device), cand, self.logical, self.spec)
                self.positions += pos
                for m in MEASURES:
                    host[m][at] = vals[m]
            else:  # a slim golden: the element measures are unknown
                for m in MEASURES:
                    host[m][at] = np.nan
                same = self.got_argmax[at] == golden["argmax"][at]
                ok = same if self.spec.name == "argmax" else np.zeros(part.size, bool)
            self.passed[at] = ok
        at = local + start
        bad = at[~self.passed[at] | (self.got_argmax[at] != golden["argmax"][at])]
        return int(bad[0]) if bad.size else None

    def rows(self) -> Rows:
        golden = self.golden
        host = self.host or dict.fromkeys(MEASURES, np.zeros(self.differ.size, dtype=np.float64))
        return Rows(differ=self.differ, passed=self.passed, golden_argmax=golden["argmax"], got_argmax=self.got_argmax,
                    margin=golden["margin"], top1=golden["top1"], golden_absmax=golden["absmax"],
                    top1_p=golden["top1_p"], got_stats=self.got_stats, positions=self.positions,
                    measured=self.measured, **host)

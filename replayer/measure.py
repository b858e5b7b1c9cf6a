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

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vd.digest import STATS, block_bytes, stats_tensor
from vd.dtypes import DTYPES, int_view
from vd.policy import Policy, Spec
from vd.store.side import GoldenSide

POSITION_BINS = 64
# 0 for equal rows; ``dp``: the candidate's probability of the golden's top token minus the golden's (llama.cpp's Δp)
MEASURES = ("n_diff", "first_index", "first_golden", "first_got", "max_abs", "max_ulp", "kl", "dp")


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


def ordered(bits: torch.Tensor) -> torch.Tensor:
    """Integer bit patterns mapped so that adjacent floats are adjacent integers (-0.0 and 0.0 both 0)."""
    b = bits.to(torch.int64)
    low = -(1 << (8 * bits.element_size() - 1))
    return torch.where(b < 0, low - b, b)


def ulp_of(x: float, logical: str) -> float:
    """One unit in the last place of ``x`` in the logical dtype."""
    x = abs(x) if math.isfinite(x) and x != 0 else 2.0 ** -126
    return 2.0 ** (math.floor(math.log2(x)) - DTYPES[logical].mantissa_bits)


class Measurer:
    """One run's rows measured against the golden's a block at a time, as the run lets them go (`add`: a
    kind's consecutive rows, whole steps, from row ``start`` of the kind), so a run never holds all its rows;
    `result` gives every kind's `Rows`. ``side`` is the golden's `GoldenSide`, or a function that makes it
    (called at the first block: on CUDA a replay builds it in the run's idle time). For each kind it keeps the
    candidate's rows of the first step whose rows fail or flip an argmax (`kept`), which a first-divergence
    bundle shows."""

    def __init__(self, side: GoldenSide | Callable[[], GoldenSide], logical: str, policy: Policy):
        self._side, self.logical, self.policy = side, logical, policy
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
        per_block = max(1, block_bytes(got.device) // (16 * got.shape[1]))  # float copies stay bounded
        for part in np.array_split(local, -(-local.size // per_block)):
            cand = got[torch.from_numpy(part).to(got.device)]
            at = part + start
            got_stats[at] = stats_tensor(cand).T.cpu().numpy()
            self.got_argmax[at] = got_stats[at, 0].astype(np.int64)
            if self.measured:
                vals, ok, pos = _measure_differing(side.rows(self.kind, at, got.device), cand, self.logical, self.spec)
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


def _measure_differing(gb: torch.Tensor, got: torch.Tensor, logical: str, spec: Spec
                       ) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Rows that differ, measured (`MEASURES`) and judged under ``spec`` on the device, golden bits ``gb``
    against candidate rows ``got`` (both ``[D, V]``), with the histogram of their differing elements over
    the vocabulary. One read-back."""
    v = got.shape[1]
    cb = int_view(got)
    gd, cd, dm = gb.view(DTYPES[logical].torch).float(), got.float(), gb != cb
    first = dm.to(torch.int8).argmax(dim=1)
    nan = gd.isnan() | cd.isnan()
    absd = torch.where(dm, (gd - cd).abs(), 0.0)
    absd = torch.where(dm & nan, torch.inf, absd)
    ulp = (ordered(gb) - ordered(cb)).abs().to(torch.float64)
    ulp = torch.where(dm & nan, torch.inf, ulp)
    pg = torch.softmax(gd, 1)
    kl = (pg * (torch.log_softmax(gd, 1) - torch.log_softmax(cd, 1))).sum(1)
    kl = torch.nan_to_num(kl.to(torch.float64), nan=torch.inf).clamp_min(0.0)
    rows_at = torch.arange(gb.shape[0], device=got.device)
    top = gd.argmax(1)
    dp = torch.softmax(cd, 1)[rows_at, top] - pg[rows_at, top]
    positions = torch.bincount(dm.nonzero()[:, 1] * POSITION_BINS // v, minlength=POSITION_BINS)
    vals = {"n_diff": dm.sum(1), "first_index": first, "first_golden": gd[rows_at, first],
            "first_got": cd[rows_at, first], "max_abs": absd.max(1).values, "max_ulp": ulp.max(1).values, "kl": kl,
            "dp": dp}
    ok = _judge(spec, gd, cd, absd, ulp, kl)
    packed = torch.cat([torch.stack([vals[n].to(torch.float64) for n in MEASURES]), ok.double()[None]]).cpu().numpy()
    return {n: packed[i] for i, n in enumerate(MEASURES)}, packed[-1] != 0, positions.cpu().numpy()


def _judge(spec: Spec, gd: torch.Tensor, cd: torch.Tensor, absd: torch.Tensor, ulp: torch.Tensor,
           kl: torch.Tensor) -> torch.Tensor:
    """Which differing rows pass ``spec`` (golden and candidate values ``gd``, ``cd``, and their measures)."""
    if spec.name == "ulp":
        return ulp.max(1).values <= spec.n
    if spec.name == "close":
        return ~(absd > spec.atol + spec.rtol * gd.abs()).any(1)
    if spec.name == "argmax":
        return gd.argmax(1) == cd.argmax(1)
    if spec.name == "topk":
        n = min(spec.n, gd.shape[1])
        return (gd.topk(n, 1).indices.sort(1).values == cd.topk(n, 1).indices.sort(1).values).all(1)
    if spec.name == "kl":
        return kl <= spec.kl
    return torch.zeros(gd.shape[0], dtype=torch.bool, device=gd.device)  # exact: a differing row fails


def measure_rows(gold_bits: torch.Tensor, got: torch.Tensor, logical: str, spec: Spec) -> tuple[np.ndarray, dict]:
    """Candidate rows ``[R, V]`` against golden bit patterns ``[R, V]`` held in memory: which pass ``spec``
    and their measures (for judging rows outside a golden, and for tests of the policies)."""
    differ = (int_view(got) != gold_bits).any(1).cpu().numpy()
    passed = ~differ
    vals = {m: np.zeros(differ.size) for m in MEASURES}
    if differ.any():
        idx = np.flatnonzero(differ)
        at = torch.from_numpy(idx).to(got.device)
        measured, ok, _ = _measure_differing(gold_bits[at], got[at], logical, spec)
        passed[idx] = ok
        for m in MEASURES:
            vals[m][idx] = measured[m]
    return passed, vals


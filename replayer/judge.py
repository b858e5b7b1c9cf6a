"""One forward's run of one K judged against the golden (`compare_run`): every row under the policy, and
every decision.

Rows are measured by `vd.replayer.measure` (digests first, the golden's rows read only where they differ). A
row's argmax is a decision where generation acts on it (every verify and draft row, and the prefill's
last row); a flipped decision fails even inside a tolerance, labelled with the golden's top-1/top-2 margin
so a near-tie can be told from a real change; a step whose candidate rows would accept another number of
drafts fails too. Under ``decisions=margin:X`` (`vd.policy`) a flip at a row whose golden margin is below X
is allowed (``Flip.allowed``), and so is the accept-count change it causes (the step's first row where the
two counts part); every allowed one is still listed with its margin. The result is a `Comparison`, which
becomes JSON only in a report.
"""

from __future__ import annotations

import numpy as np
import torch

from vd.layout import RowLayout
from vd.loop import Run
from vd.policy import Policy
from vd.replayer.comparison import (
    AcceptChange,
    Agreement,
    Comparison,
    Failure,
    Flip,
    KindSummary,
    Mismatch,
    Positions,
    RowDiff,
    RowStats,
    StepFigures,
)
from vd.replayer.measure import Measurer, Rows
from vd.rowmath import POSITION_BINS, ulp_of
from vd.store.side import GoldenSide
from vd.streams import Behind

NEAR_TIE_ULPS = 4
MAX_ROWS = 2000  # rows listed one by one in a comparison; the summaries cover them all
_ORDER = {"prefill": 0, "verify": 2, "draft": 3}  # rows of one step in the order they were computed


class _Kind:
    """One kind's measured rows and where each sits in the layout. ``quiet``: no row differs, so every
    measure is zero and the golden's argmax stands everywhere (the common case, kept cheap)."""

    def __init__(self, name: str, rows: Rows, layout: RowLayout):
        self.name, self.rows, self.layout = name, rows, layout
        self.quiet = not rows.differ.any()

    def where(self, i: int) -> tuple[int | None, int]:
        return self.layout.locate(self.name, i)

    def first_mismatch(self, skip: int = 0) -> Mismatch | None:
        """The first differing element past the first ``skip`` rows."""
        if self.quiet:
            return None
        r = self.rows
        bad = np.flatnonzero(r.differ[skip:]) + skip
        if not bad.size:
            return None
        f = int(bad[0])
        step, row = self.where(f)
        at = r.first_index[f]
        return Mismatch(step, row, _int(at), *_values(at, r.first_golden[f], r.first_got[f]))

    def bad_steps(self, skip: int = 0) -> list[int]:
        """The steps holding a differing row past the first ``skip`` rows (those rows sit in steps)."""
        if self.quiet:
            return []
        steps = {self.where(int(f))[0] for f in np.flatnonzero(self.rows.differ[skip:]) + skip}
        return sorted(s for s in steps if s is not None)


class Queued:
    """Which of a run's held rows differ from the golden's, asked of the GPU while it still runs the run's
    last step (`vd.loop.run_verify`'s ``on_last``): their digests compared and the answer copied back to
    page-locked memory on a side stream behind that step's forward, nothing waited for; `compare_run` takes
    it instead of doing the same after the run, when the GPU would wait."""

    def __init__(self, side: GoldenSide, run: Run, last: torch.Tensor):
        def flags() -> torch.Tensor:  # on the side stream: the rows joined there too
            self.parts = [(kind, start, rows[:side.counts[kind] - start]) for kind, start, rows in run.held(last)]
            return torch.cat([side.differ_at(rows, side.layout.offset(kind) + start)
                              for kind, start, rows in self.parts])

        self.flags = Behind(last.device, flags)

    def result(self) -> list[tuple[str, int, torch.Tensor, np.ndarray]]:
        """Each kind's held rows (for the current stream) and which of them differ, once the side stream is
        done."""
        flags, out, at = self.flags.result(), [], 0
        for kind, start, rows in self.parts:
            rows.record_stream(torch.cuda.current_stream(rows.device))
            out.append((kind, start, rows, flags[at:at + rows.shape[0]]))
            at += rows.shape[0]
        return out


def compare_run(variant: str, side: GoldenSide, run: Run, logical: str, policy: Policy,
                queued: Queued | None = None, measurer: Measurer | None = None) -> Comparison:
    """Measure every row of ``run`` (its prefill, each step's K rows and, for a drafter golden, the bootstrap
    row and the head's draft rows) against ``side`` under ``policy``, and check every decision: each row's
    argmax, and each step's accept count. ``queued``: which held rows differ, asked during the run
    (`Queued`); ``measurer``: the `vd.replayer.measure.Measurer` the run's settled rows went to (a run with a
    hold)."""
    assert run.layout == side.layout, "the replay ran the golden's steps"
    measurer = measurer or Measurer(side, logical, policy)
    if queued is not None:
        for kind, start, rows, flags in queued.result():
            measurer.add(kind, start, rows, flags)
    else:
        for kind, start, rows in run.held():
            measurer.add(kind, start, rows[:side.counts[kind] - start])
    kinds = {name: _Kind(name, rows, side.layout) for name, rows in measurer.result().items()}
    return _judged(variant, side, run, kinds, logical, policy)


def _judged(variant: str, side: GoldenSide, run: Run, kinds: dict[str, _Kind], logical: str,
            policy: Policy) -> Comparison:
    """The comparison of ``run``'s measured rows (``kinds``) under ``policy``."""
    flips, failures, failed = _decisions(kinds, logical, policy)
    accept_changes = _accept_changes(side, run, flips)
    failed |= {c.step for c in accept_changes if not c.allowed}
    verify, prefill = kinds["verify"], kinds["prefill"]
    bad = verify.bad_steps()
    quiet = all(kd.quiet for kd in kinds.values())
    return Comparison(
        variant=variant, prefill_equal=prefill.quiet, mismatched_steps=len(bad), steps=side.steps,
        first_mismatch=verify.first_mismatch(),
        max_abs_diff=0.0 if quiet else _max(np.concatenate(
            [prefill.rows.max_abs, verify.rows.max_abs, kinds["draft"].rows.max_abs[:1] if "draft" in kinds else []])),
        policy=policy, positions=_positions(kinds, side.vocab, quiet),
        prefill_first_mismatch=prefill.first_mismatch(), mismatched_step_list=tuple(bad),
        decision_changes=len(accept_changes),
        passed=(not any(not f.allowed for f in flips) and not any(not c.allowed for c in accept_changes)
                and all(kd.quiet or kd.rows.passed.all() for kd in kinds.values())),
        failed_step_list=tuple(sorted(failed)), first_failure=failures[0][2] if failures else None,
        flips=tuple(flips), accept_changes=tuple(accept_changes), per_step=_per_step(kinds, side.layout, failed),
        rows=_row_list(kinds), summary={kd.name: _summary(kd, flips, side) for kd in kinds.values()},
        measured=all(kd.rows.measured for kd in kinds.values()), **_draft_fields(kinds))


def _positions(kinds: dict[str, _Kind], vocab: int, quiet: bool) -> Positions:
    counts = [0] * POSITION_BINS if quiet else [int(x) for x in np.sum([kd.rows.positions for kd in kinds.values()],
                                                                      axis=0)]
    return Positions(POSITION_BINS, int(vocab), tuple(counts))


def _max(a: np.ndarray) -> float:
    """The largest value, NaN (unknown) when any is."""
    return float(np.max(a, initial=0.0))


def _decisions(kinds: dict[str, _Kind], logical: str, policy: Policy
               ) -> tuple[list[Flip], list[tuple[tuple[int, int], int, Failure]], set[int]]:
    """Every flipped decision, every failing row (sortable in the order rows were computed, with its
    description) and the steps either touches."""
    flips: list[Flip] = []
    failures: list[tuple[tuple[int, int], int, Failure]] = []
    failed: set[int] = set()
    for kd in kinds.values():
        if kd.quiet:
            continue
        r = kd.rows
        decides = np.ones(r.differ.size, dtype=bool)
        if kd.name == "prefill":
            decides[:-1] = False  # the other prefill rows are teacher-forced and decide nothing
        flipped_rows = (r.golden_argmax != r.got_argmax) & decides
        for f in np.flatnonzero(~r.passed | flipped_rows):
            step, row = kd.where(int(f))
            flip = _flip(kd, int(f), logical, policy) if flipped_rows[f] else None
            if flip is not None:
                flips.append(flip)
            if r.passed[f] and (flip is None or flip.allowed):
                continue  # an allowed flip in a row within its tolerance: listed, not a failure
            if step is not None:
                failed.add(step)
            order = (-1 if step is None else step, _ORDER[kd.name] if step is not None else int(kd.name == "draft"))
            failures.append((order, row, Failure(kd.name, step, row, _int(r.first_index[f]),
                                                 *_values(r.first_index[f], r.first_golden[f], r.first_got[f]),
                                                 policy[kd.name].text, flip is not None, bool(r.passed[f]))))
    failures.sort(key=lambda x: (x[0], x[1]))
    return flips, failures, failed


def _flip(kd: _Kind, f: int, logical: str, policy: Policy) -> Flip:
    """Row ``f`` of ``kd``, whose argmax differs from the golden's, as a flip."""
    r = kd.rows
    step, row = kd.where(f)
    units = float(r.margin[f]) / ulp_of(float(r.top1[f]), logical)
    return Flip(kd.name, step, row, int(r.golden_argmax[f]), int(r.got_argmax[f]), float(r.margin[f]), units,
                units <= NEAR_TIE_ULPS, float(r.max_abs[f]), policy.allows_flip(float(r.margin[f])))


def _accept_changes(side: GoldenSide, run: Run, flips: list[Flip]) -> list[AcceptChange]:
    """Each step whose candidate's own argmaxes would accept another number of drafts: the two counts, the
    golden's margin at the row where they part (row min(golden, got) of the step: there one argmax took the
    draft and the other did not) and whether that row's flip is allowed."""
    at = {(f.step, f.row): f for f in flips if f.kind == "verify"}
    out = []
    for i, (a, b) in enumerate(zip(side.accepted.tolist(), run.computed)):
        if a != b:
            f = at.get((i, min(a, b)))
            out.append(AcceptChange(i, int(a), int(b), None if f is None else f.margin, f is not None and f.allowed))
    return out


def _int(x: float) -> int | None:
    return None if np.isnan(x) else int(x)


def _values(index: float, golden: float, got: float) -> tuple[float | None, float | None]:
    """A first differing element's two values; None where its place is unknown (a slim golden's rows not at hand:
    a NaN there read as the model's own NaN, found by a user test)."""
    return (None, None) if np.isnan(index) else (float(golden), float(got))


def _per_step(kinds: dict[str, _Kind], layout: RowLayout, failed: set[int]) -> tuple[StepFigures, ...]:
    """Each step's largest absolute and ULP difference, differing elements, largest KL and argmax agreement
    (and the draft rows' for a drafter golden)."""
    s, v = layout.steps, kinds["verify"]
    cols: dict[str, list] = {"max_abs": [0.0] * s, "max_ulp": [0.0] * s, "n_diff": [0] * s, "max_kl": [0.0] * s,
                             "argmax_agree": [True] * s}
    if not v.quiet:
        r, by = v.rows, (lambda a: layout.by_step("verify", a))
        cols = {"max_abs": by(r.max_abs).max(1).tolist(), "max_ulp": by(r.max_ulp).max(1).tolist(),
                "n_diff": [_int(x) for x in by(r.n_diff).sum(1)], "max_kl": by(r.kl).max(1).tolist(),
                "argmax_agree": (by(r.golden_argmax) == by(r.got_argmax)).all(1).tolist()}
    if "draft" in kinds:
        d = kinds["draft"]
        cols.update(draft_max_abs=[0.0] * s, draft_n_diff=[0] * s)
        if not d.quiet:
            cols.update(draft_max_abs=layout.by_step("draft", d.rows.max_abs).max(1, initial=0.0).tolist(),
                        draft_n_diff=[_int(x) for x in layout.by_step("draft", d.rows.n_diff).sum(1)])
    return tuple(StepFigures(step=i, passed=i not in failed, **{n: c[i] for n, c in cols.items()}) for i in range(s))


def _summary(kd: _Kind, flips: list[Flip], side: GoldenSide) -> KindSummary:
    """One kind's figures: rows that differ, fail and flip, and the largest differences."""
    r = kd.rows
    figures: dict = {"rows_differ": 0, "rows_failed": 0, "argmax_flips": 0, "max_abs": 0.0, "max_ulp": 0.0,
                     "max_kl": 0.0, "n_diff": 0}
    if not kd.quiet:
        figures = {"rows_differ": int(r.differ.sum()), "rows_failed": int((~r.passed).sum()),
                   "argmax_flips": sum(f.kind == kd.name for f in flips), "max_abs": _max(r.max_abs),
                   "max_ulp": _max(r.max_ulp), "max_kl": _max(r.kl), "n_diff": _int(r.n_diff.sum())}
    golden = side.figures(kd.name)
    return KindSummary(rows=int(r.differ.size), **figures, golden_max_abs=golden["golden_max_abs"],
                       golden_min_margin=golden["golden_min_margin"],
                       golden_median_top1_p=golden["golden_median_top1_p"], agreement=agreement(r))


def agreement(r: Rows) -> Agreement | None:
    """A kind's rows against the golden's in the terms llama.cpp's ``--kl-divergence`` reports
    (`vd.replayer.comparison.Agreement`); None for a slim golden, whose rows are not at hand."""
    if not r.measured or not r.differ.size:
        return None
    same_top1 = float((r.golden_argmax == r.got_argmax).mean())
    if not r.differ.any():  # every measure of a row that does not differ is 0: the percentiles below would be too
        return Agreement(kl_mean=0.0, kl_median=0.0, kl_p99=0.0, kl_max=0.0, same_top1=same_top1, dp_mean=0.0,
                         dp_p1=0.0, dp_p5=0.0, dp_p50=0.0, dp_p95=0.0, dp_p99=0.0)
    kl, dp = np.nan_to_num(r.kl, nan=0.0), np.nan_to_num(r.dp, nan=0.0)

    def pct(a: np.ndarray, q: float) -> float:
        return float(np.percentile(a, q))

    return Agreement(kl_mean=float(kl.mean()), kl_median=pct(kl, 50), kl_p99=pct(kl, 99), kl_max=float(kl.max()),
                     same_top1=same_top1, dp_mean=float(dp.mean()),
                     dp_p1=pct(dp, 1), dp_p5=pct(dp, 5), dp_p50=pct(dp, 50), dp_p95=pct(dp, 95), dp_p99=pct(dp, 99))


def _row_list(kinds: dict[str, _Kind]) -> tuple[RowDiff, ...]:
    """Every row that differs, measured, with the golden's and the candidate's statistics (first MAX_ROWS)."""
    out: list[RowDiff] = []
    for kd in kinds.values():
        if kd.quiet:
            continue
        r = kd.rows
        for f in np.flatnonzero(r.differ)[:MAX_ROWS - len(out)]:
            step, row = kd.where(int(f))
            out.append(RowDiff(kind=kd.name, step=step, row=row, passed=bool(r.passed[f]), n_diff=_int(r.n_diff[f]),
                               first_index=_int(r.first_index[f]), max_abs=float(r.max_abs[f]),
                               max_ulp=float(r.max_ulp[f]), kl=float(r.kl[f]),
                               argmax_agree=bool(r.golden_argmax[f] == r.got_argmax[f]),
                               golden_stats=RowStats(int(r.golden_argmax[f]), float(r.top1[f]), float(r.margin[f]),
                                                     float(r.golden_absmax[f]), float(r.top1_p[f])),
                               got_stats=_got_stats(r, int(f))))
    return tuple(out)


def _got_stats(r: Rows, f: int) -> RowStats:
    assert r.got_stats is not None, "a differing row has the candidate's statistics"
    return RowStats(int(r.got_argmax[f]), float(r.got_stats[f, 1]), float(r.got_stats[f, 2]),
                    float(r.got_stats[f, 3]), float(r.got_stats[f, 4]))


def _draft_fields(kinds: dict[str, _Kind]) -> dict:
    """The draft head's fields: its bootstrap row (row 0 of the draft kind) reported on its own."""
    if "draft" not in kinds:
        return {}
    d = kinds["draft"]
    bad = d.bad_steps(skip=1)
    return dict(bootstrap_equal=not bool(d.rows.differ[0]), draft_mismatched_steps=len(bad),
                draft_first_mismatch=d.first_mismatch(skip=1),
                draft_max_abs_diff=0.0 if d.quiet else _max(d.rows.max_abs), draft_mismatched_step_list=tuple(bad))

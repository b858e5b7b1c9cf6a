"""One forward's rows judged against a golden's, as typed values (`Comparison` and its parts), made by
`vd.replayer.judge` and worded by `vd.replayer.words`; they become JSON only at the edge (``to_json``).

The JSON a comparison writes is the report's ``comparisons[]`` entry (report_version 1): the same keys in
the same order as before these values were typed, so reports stay comparable across vd versions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any

from vd.policy import Policy


@dataclass(frozen=True, slots=True)
class Mismatch:
    """Where two sets of rows first differ: step (None for the prefill), row, vocab index, both values."""

    step: int | None
    row: int
    index: int | None  # None where the golden's rows were not at hand
    golden: float | None  # None with the index
    got: float | None


@dataclass(frozen=True, slots=True)
class Flip:
    """A row whose argmax (the decision it drives) differs from the golden's."""

    kind: str
    step: int | None
    row: int
    golden_argmax: int
    got_argmax: int
    margin: float  # the golden's top-1 minus top-2 logit at that row
    margin_ulps: float  # the same in units in the last place of the golden's top-1 value
    near_tie: bool  # margin within NEAR_TIE_ULPS: a tie at the dtype's resolution
    row_max_abs: float  # the candidate row's largest absolute difference
    allowed: bool = False  # below the policy's decisions=margin:X


@dataclass(frozen=True, slots=True)
class Failure:
    """The first row that fails (in the order rows were computed): its kind, step (None for the prefill or
    the draft head's bootstrap row), row, first differing element and the policy it fails."""

    kind: str
    step: int | None
    row: int
    index: int | None
    golden: float | None  # None where the index is (a slim golden's rows not at hand)
    got: float | None
    policy: str
    argmax_flipped: bool
    within: bool = False  # the row is within its policy's SPEC: it fails for its changed argmax alone


@dataclass(frozen=True, slots=True)
class AcceptChange:
    """A step whose candidate rows would accept another number of drafts: both counts, the golden's margin
    at the row where they part (None where that row did not flip) and whether the policy allows it."""

    step: int
    golden: int
    got: int
    margin: float | None
    allowed: bool


@dataclass(frozen=True, slots=True)
class StepFigures:
    """One verify step's largest absolute and ULP difference, differing elements (None: unknown, a slim
    golden), largest KL, argmax agreement and verdict; the draft rows' for a drafter golden."""

    step: int
    max_abs: float
    max_ulp: float
    n_diff: int | None
    max_kl: float
    argmax_agree: bool
    passed: bool
    draft_max_abs: float | None = None  # None: not a drafter golden
    draft_n_diff: int | None = None

    def to_json(self) -> dict:
        out = {n: getattr(self, n) for n in _names(self) or () if not n.startswith("draft_")}
        if self.draft_max_abs is not None:
            out.update(draft_max_abs=self.draft_max_abs, draft_n_diff=self.draft_n_diff)
        return out


@dataclass(frozen=True, slots=True)
class RowStats:
    """A row's statistics as stored beside its digest: argmax, top-1 value, top-1/top-2 margin, largest
    |logit|, top-1 probability."""

    argmax: int
    top1: float
    margin: float
    absmax: float
    top1_p: float


@dataclass(frozen=True, slots=True)
class RowDiff:
    """One row that differs from the golden's, measured (NaN measures: unknown, a slim golden)."""

    kind: str
    step: int | None
    row: int
    passed: bool
    n_diff: int | None
    first_index: int | None
    max_abs: float
    max_ulp: float
    kl: float
    argmax_agree: bool
    golden_stats: RowStats
    got_stats: RowStats


@dataclass(frozen=True, slots=True)
class Agreement:
    """A kind's rows against the golden's in llama.cpp's ``--kl-divergence`` terms: KL divergence (mean,
    median, p99, max), the share of rows with the same top-1 token, and Δp, the candidate's probability of
    the golden's top token minus the golden's (mean and percentiles); equal rows count as 0."""

    kl_mean: float
    kl_median: float
    kl_p99: float
    kl_max: float
    same_top1: float
    dp_mean: float
    dp_p1: float
    dp_p5: float
    dp_p50: float
    dp_p95: float
    dp_p99: float


@dataclass(frozen=True, slots=True)
class KindSummary:
    """One kind's figures: rows that differ, fail and flip, the largest differences, the golden's own
    figures (`vd.policy.sensitivity` reads them) and the agreement (None for a slim golden)."""

    rows: int
    rows_differ: int
    rows_failed: int
    argmax_flips: int
    max_abs: float
    max_ulp: float
    max_kl: float
    n_diff: int | None
    golden_max_abs: float
    golden_min_margin: float
    golden_median_top1_p: float
    agreement: Agreement | None


@dataclass(frozen=True, slots=True)
class Positions:
    """Where in the vocabulary the differing elements sit: ``counts`` per bin of ``vocab / bins`` indices."""

    bins: int
    vocab: int
    counts: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Comparison:
    """One forward's rows against the golden's, for one K, under a policy.

    The bit-level fields (``prefill_equal``, ``mismatched_*``, ``first_mismatch``, ``max_abs_diff``) say
    where bits differ; ``passed`` is the verdict under ``policy`` with decisions checked; ``per_step``,
    ``summary``, ``flips``, ``accept_changes`` and ``positions`` say how. The ``draft_*`` fields and
    ``bootstrap_equal`` compare the MTP head's outputs and are None for a reference golden. ``measured``
    is False when the golden's rows were not at hand (a slim golden): the element measures are unknown.
    """

    variant: str
    prefill_equal: bool
    mismatched_steps: int
    steps: int
    first_mismatch: Mismatch | None
    max_abs_diff: float
    policy: Policy
    positions: Positions
    prefill_first_mismatch: Mismatch | None = None
    mismatched_step_list: tuple[int, ...] = ()
    decision_changes: int = 0  # steps where this run's own argmaxes would have accepted another count
    bootstrap_equal: bool | None = None
    draft_mismatched_steps: int | None = None
    draft_first_mismatch: Mismatch | None = None
    draft_max_abs_diff: float | None = None
    draft_mismatched_step_list: tuple[int, ...] | None = None
    passed: bool = True
    failed_step_list: tuple[int, ...] = ()  # verify or draft rows failing, or a flip
    first_failure: Failure | None = None
    flips: tuple[Flip, ...] = ()
    accept_changes: tuple[AcceptChange, ...] = ()
    per_step: tuple[StepFigures, ...] = ()
    rows: tuple[RowDiff, ...] = ()  # every row that differs or flips, measured (the first MAX_ROWS)
    summary: Mapping[str, KindSummary] = field(default_factory=dict)  # by kind: prefill, verify, draft
    measured: bool = True

    @property
    def equal(self) -> bool:
        return (self.prefill_equal and self.mismatched_steps == 0 and self.bootstrap_equal is not False
                and not self.draft_mismatched_steps)

    @property
    def unallowed_flips(self) -> tuple[Flip, ...]:
        return tuple(f for f in self.flips if not f.allowed)

    @property
    def changed_accepts(self) -> tuple[AcceptChange, ...]:
        """The accept-count changes the policy does not allow."""
        return tuple(a for a in self.accept_changes if not a.allowed)

    def to_json(self) -> dict:
        return {
            "variant": self.variant, "prefill_equal": self.prefill_equal, "mismatched_steps": self.mismatched_steps,
            "steps": self.steps, "first_mismatch": plain(self.first_mismatch), "max_abs_diff": self.max_abs_diff,
            "prefill_first_mismatch": plain(self.prefill_first_mismatch),
            "mismatched_step_list": list(self.mismatched_step_list), "decision_changes": self.decision_changes,
            "bootstrap_equal": self.bootstrap_equal, "draft_mismatched_steps": self.draft_mismatched_steps,
            "draft_first_mismatch": plain(self.draft_first_mismatch), "draft_max_abs_diff": self.draft_max_abs_diff,
            "draft_mismatched_step_list": None if self.draft_mismatched_step_list is None
            else list(self.draft_mismatched_step_list),
            "policy": self.policy.to_json(), "passed": self.passed, "failed_step_list": list(self.failed_step_list),
            "first_failure": plain(self.first_failure), "flips": [plain(f) for f in self.flips],
            "accept_changes": [plain(a) for a in self.accept_changes],
            "per_step": [p.to_json() for p in self.per_step], "rows": [plain(r) for r in self.rows],
            "summary": {kind: plain(s) for kind, s in self.summary.items()},
            "positions": {**plain(self.positions), "counts": list(self.positions.counts)},
            "measured": self.measured,
        }


def plain(value: Any) -> Any:
    """A dataclass value as JSON-ready dicts, what `dataclasses.asdict` gives; None stays None. A report holds
    a few hundred of them (a row's statistics each), and asdict deep-copies every number: this walks the same
    fields (their names kept per class) and leaves immutable scalars as they are, about four times as fast."""
    return None if value is None else _plain(value)


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}
_SCALARS = frozenset((int, float, str, bool, type(None)))


def _names(v: Any) -> tuple[str, ...] | None:
    """The field names of a dataclass instance ``v`` (kept per class), None for anything else."""
    t = type(v)
    names = _FIELD_NAMES.get(t)
    if names is None and is_dataclass(v) and not isinstance(v, type):
        names = _FIELD_NAMES[t] = tuple(f.name for f in fields(v))
    return names


def _plain(v: Any) -> Any:
    t = type(v)
    if t in _SCALARS:
        return v
    if (names := _names(v)) is not None:
        return {n: _plain(getattr(v, n)) for n in names}
    if t is list or t is tuple:
        return t(_plain(x) for x in v)
    if t is dict:
        return {_plain(k): _plain(x) for k, x in v.items()}
    return asdict(_Box(v))["v"]  # anything else (a named tuple, a subclass, an array): asdict's own way


@dataclass(frozen=True)
class _Box:
    v: Any

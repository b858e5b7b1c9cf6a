"""What a replay or a golden-against-golden diff concludes, as typed values (`Report`, `DiffReport` and their
parts) that become JSON only at the edge (``to_json``), worded by `vd.replayer.words`.

The JSON keeps the seed's fields (``graphs``, ``mtp``, ``steps``, ``variants``, ``verify[k, accepted,
comparisons, timings, detection_control]``, ``verdict``, ``reasons``) and adds the golden, model, policy
and its sensitivity, coverage, determinism, both environments and where the replay's time went. Every
reason is a `Reason` that says what it is about (``rows``, ``draft``, ``control``, ``thin``,
``coverage``, ``environment``; a diff's also ``steps``) and which K and forward, so renderers need not
parse its text. Mappings left untyped are metadata passed through as the golden or the machine wrote them
(an environment, an MTP head's description, the reader's counters).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import numpy as np

from vd.batch import slots_text
from vd.coverage import histogram
from vd.equivalence import Equivalence
from vd.policy import Policy
from vd.replayer.comparison import Comparison, Failure, plain
from vd.store.format import DECODE_K

REPORT_VERSION = 1


def golden_name(golden: str) -> str:
    """A golden's short name: its path's or URL's last part without the extension (``smollm2`` for
    ``s3://bucket/goldens/smollm2.zarr``), as JUnit class names and the HTML page use it."""
    return PurePosixPath(golden.rstrip("/")).stem or golden


@dataclass(frozen=True, slots=True)
class Reason:
    """One reason a replay fails: ``what`` it is about, the K and forward it concerns, and its text."""

    what: str  # rows, draft, decode, equivalence, batch, control, thin, coverage, environment; a diff's steps
    text: str
    k: int | None = None
    variant: str | None = None

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True, slots=True)
class Timing:
    """One forward's verify steps' wall times at one K (the golden's own as recorded, or a replay's)."""

    variant: str
    step_ms: tuple[float, ...]

    @property
    def median_ms(self) -> float | None:
        return statistics.median(self.step_ms) if self.step_ms else None

    def to_json(self) -> dict:
        ms = self.step_ms
        return {"variant": self.variant, "steps": len(ms), "step_ms_median": self.median_ms,
                "step_ms_max": max(ms) if ms else None, "total_ms": sum(ms)}


@dataclass(frozen=True, slots=True)
class Judged:
    """One forward's comparison at one K and the reasons it fails (none when it passes)."""

    comparison: Comparison
    reasons: tuple[Reason, ...]

    def to_json(self) -> dict:
        return {**self.comparison.to_json(), "reasons": [r.text for r in self.reasons]}


@dataclass(frozen=True, slots=True)
class Control:
    """The detection control: the run with one draft changed at ``changed_step``, and whether it failed
    there (``fired``) under the active policy where the candidate's own run did not. ``inconclusive``: the
    candidate's own run already fails at that step, so the control shows nothing (its forward fails anyway)."""

    comparison: Comparison
    changed_step: int
    fired: bool
    inconclusive: bool = False

    @property
    def state(self) -> str:
        """``fired``, ``inconclusive`` or ``BLIND``."""
        return "fired" if self.fired else "inconclusive" if self.inconclusive else "BLIND"

    def to_json(self) -> dict:
        return {**self.comparison.to_json(), "changed_step": self.changed_step, "fired": self.fired,
                "inconclusive": self.inconclusive}


@dataclass(frozen=True, slots=True)
class EquivalenceAxis:
    """Verify rows against the decode rows of the same positions at one K (`vd.equivalence`): the golden's own
    as recorded, and each forward's own verify rows against the decode rows it computed itself (under
    ``decode_forward`` where one was named)."""

    golden: Equivalence
    forwards: tuple[tuple[str, Equivalence], ...]
    decode_forward: str | None = None

    def of(self, variant: str) -> Equivalence | None:
        return next((e for name, e in self.forwards if name == variant), None)

    def to_json(self) -> dict:
        return {"golden": plain(self.golden), "decode_forward": self.decode_forward,
                "forwards": [{"variant": name, **plain(e)} for name, e in self.forwards]}


@dataclass(frozen=True, slots=True)
class BatchAxis:
    """One forward's run of a K's steps with the golden's sequence as one member of a batch (`vd.batch`): its
    comparison with the golden, the plan (``n``, ``slot``: None for every slot in turn, ``seed``), the slot of
    each forward call (``slots[0]``: the prefill's; ``slots[s + 1]``: step ``s``'s) and the steps' times."""

    forward: str
    n: int
    slot: int | None
    seed: int
    comparison: Comparison
    slots: tuple[int, ...]
    step_ms: tuple[float, ...] = ()

    @property
    def first_difference(self) -> tuple[int | None, int] | None:
        """(step, slot) of the first row that differs from the golden's (step None: the prefill), or None."""
        c = self.comparison
        step: int | None
        if c.first_failure is not None:
            step = c.first_failure.step
        elif not c.prefill_equal:
            step = None
        elif c.first_mismatch is not None:
            step = c.first_mismatch.step
        else:
            return None
        return step, self.slots[0 if step is None else step + 1]

    @property
    def label(self) -> str:
        return f"batch (N={self.n}, {slots_text(self.slot)})"

    def axis_row(self) -> AxisRow:
        """Its row of the table of axes: its rows against the golden's."""
        return _comparison_row(self.forward, self.label, self.comparison)

    def to_json(self) -> dict:
        first = self.first_difference
        return {"variant": self.forward, "n": self.n, "slot": self.slot, "seed": self.seed,
                "slots": list(self.slots), "comparison": self.comparison.to_json(),
                "first_difference": None if first is None else {"step": first[0], "slot": first[1]},
                "step_ms_median": statistics.median(self.step_ms) if self.step_ms else None}


@dataclass(frozen=True, slots=True)
class AxisRow:
    """One row of a K's table of axes: for a forward (or the golden as recorded), one axis on which greedy
    speculative decoding can stop being lossless (``golden``: its rows against the golden's; ``verify vs
    decode``: its verify rows against the decode rows of the same positions; ``batch (N=…, …)``: its rows run as
    one member of a batch, against the golden's), with the rows compared, how many
    are identical, the largest |Δ|, the argmax flips and what the axis contributes to the verdict (``pass``,
    ``FAIL``, ``reported``: measured and not judged, ``not recorded``)."""

    forward: str
    axis: str
    rows: int | None
    identical: int | None
    max_abs: float | None
    flips: int | None
    verdict: str


def _comparison_row(forward: str, axis: str, c: Comparison) -> AxisRow:
    n = sum(s.rows for s in c.summary.values())
    return AxisRow(forward, axis, n, n - sum(s.rows_differ for s in c.summary.values()), c.max_abs_diff,
                   len(c.flips), "pass" if c.passed else "FAIL")


def _equivalence_row(forward: str, e: Equivalence, golden: bool = False) -> AxisRow:
    """A verify-vs-decode row; the ``golden``'s own pairs are measured under the policy but never judged (the
    verdict is the forwards'), so where they fail it the row says so without a FAIL."""
    verdict = ("reported" if not e.judged else "pass" if e.passed
               else "fails (the golden's own: not judged)" if golden else "FAIL")
    return AxisRow(forward, "verify vs decode", e.rows, e.identical, e.max_abs if e.measured else None, len(e.flips),
                   verdict)


@dataclass(frozen=True, slots=True)
class KResult:
    """One verify width: the golden's accept counts, each forward's comparison and timing, the control."""

    k: int
    accepted: tuple[int, ...]
    comparisons: tuple[Judged, ...]
    timings: tuple[Timing, ...]
    control: Control | None
    # The step where the recording's committed sequence left its engine's own one-token decode (its verify rows
    # chose another token there), None where it did not (or the golden predates the field).
    left_greedy: int | None = None
    equivalence: EquivalenceAxis | None = None  # None: the golden stores no decode rows (before format 7)
    batch: tuple[BatchAxis, ...] = ()  # with --batch: each forward's run in a batch

    @property
    def histogram(self) -> list[int]:
        """How many steps accepted 0, 1, .., K-1 drafts: the golden's coverage of the accept path."""
        return histogram(self.k, self.accepted)

    def axes(self) -> tuple[AxisRow, ...]:
        """The table of axes at this K: the golden's own verify-against-decode row (as recorded), then per forward
        its rows against the golden's, its verify rows against its decode rows and, with ``--batch``, its rows in a
        batch against the golden's."""
        out = []
        if self.equivalence is not None:
            out.append(_equivalence_row("golden (recorded)", self.equivalence.golden, golden=True))
        for j in self.comparisons:
            c = j.comparison
            out.append(_comparison_row(c.variant, "golden", c))
            e = None if self.equivalence is None else self.equivalence.of(c.variant)
            if self.k > 1:  # the decode group's own rows have no verify rows to measure
                out.append(_equivalence_row(c.variant, e) if e is not None else
                           AxisRow(c.variant, "verify vs decode", None, None, None, None, "not recorded"))
            out += [b.axis_row() for b in self.batch if b.forward == c.variant]
        return tuple(out)

    def to_json(self) -> dict:
        hist = self.histogram
        return {"k": self.k, "accepted": list(self.accepted), "accept_histogram": hist,
                "coverage": {"accepted_counts": hist, "missing": [i for i, n in enumerate(hist) if n == 0]},
                "comparisons": [j.to_json() for j in self.comparisons], "timings": [t.to_json() for t in self.timings],
                "detection_control": None if self.control is None else self.control.to_json(),
                "golden_left_greedy_step": self.left_greedy,
                "equivalence": None if self.equivalence is None else self.equivalence.to_json(),
                "batch": [b.to_json() for b in self.batch], "axes": [plain(a) for a in self.axes()]}


@dataclass(frozen=True, slots=True)
class FailureRows:
    """The golden's and the candidate's rows of the first failing step, as stored (a first-divergence
    bundle's ``rows.npz``); ``golden`` is None for a slim golden replayed without its rows; ``text`` is
    the step's tokens decoded, where the model can decode (`vd.protocol.TokenDecoder`). ``first_failure``:
    the first failing row, or for a changed accept count alone the step (``row`` 0, no element)."""

    k: int
    forward: str
    kind: str
    step: int | None
    golden: np.ndarray | None
    candidate: np.ndarray
    tokens: list[int] | None
    first_failure: Failure | None
    text: str | None = None
    # Where the failing rows were computed, beside K and forward: the decode rows (``k`` 1) by this forward
    # (``--decode-forward``'s, else ``forward``), or a run in a batch (its n, slot and seed: ``--batch``).
    decode_forward: str | None = None
    batch: Mapping[str, Any] | None = None

    @property
    def axis(self) -> str:
        """What failed, as a reason's ``what`` names it: ``rows`` (the golden's rows, or its draft rows, at a K),
        ``decode`` (its decode rows), ``batch`` (rows run in a batch) or ``equivalence`` (a verify row judged
        against the decode row of its position)."""
        if self.kind == "equivalence":
            return "equivalence"
        return "batch" if self.batch is not None else "decode" if self.k == DECODE_K else "rows"


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """The golden's model (its SPEC, name and fingerprint), the identity it was ``replayed_with`` and
    ``replayed_spec``: the model SPEC that ran when it was not the golden's own (a plug-in wrapping the
    golden's model, say), else None; ``mismatch_allowed``: whether the replay was told to run a model of
    another fingerprint (``--allow-model-mismatch``), which the command replaying its failure passes again.
    ``ran`` and ``head_file``: the model SPEC and the MTP head file that ran, a file among them as resolved from
    where the replay ran (a golden's spec stored relative to its project is resolved against the folder the
    replay ran in): what a command replaying the failure from any folder passes, made absolute."""

    spec: str
    name: str | None
    fingerprint: str
    replayed_with: str
    replayed_spec: str | None
    mismatch_allowed: bool = False
    ran: str | None = None
    head_file: str | None = None


@dataclass(frozen=True, slots=True)
class Variant:
    """A forward replayed: its name, what it runs, whether it is the golden's own, graphed or eager."""

    name: str
    description: str
    golden: bool
    graphs: str


@dataclass(frozen=True, slots=True)
class Determinism:
    """The determinism settings the recording ``recorded``, those this replay ``applied`` from it, and those
    in force while it ``replayed``."""

    recorded: Mapping[str, Any] | None
    applied: Mapping[str, Any] | None
    replayed: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Sensitivity:
    """One kind's policy and the smallest change it is guaranteed to catch (``catches``), from the golden's
    rows' largest |logit|, smallest margin and median top-1 probability."""

    policy: str
    catches: str
    max_abs: float
    min_margin: float
    median_top1_p: float


@dataclass(frozen=True, slots=True)
class Environments:
    """The recording's and the replay's environments (`vd.env`) and the numerics fields that differ."""

    recorded: Mapping[str, Any]
    replayed: Mapping[str, Any]
    numerics_differences: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RowsSource:
    """Whether the golden is slim, and the full golden whose rows measured it (None: none named)."""

    slim: bool
    source: str | None


@dataclass(frozen=True, slots=True)
class Seconds:
    """Where a replay's time went, by phase, and ``first_step``: from the process's start to its first
    forward of a run (start-up, as a user waits for it; None where unknown). ``started``: from the process's
    start to the replay's (the interpreter, the CLI, torch and vd imported). Within ``load``, ``model_code``
    imports the model's code (transformers, llama.cpp) and the rest builds it; within ``setup``,
    ``fingerprint`` computes the model's fingerprint (hashing its weights, or a generated model's
    checksums); ``prepare`` captures graphs and compiles. ``warm``: the process was forked from a warm server
    (`vd.warm`), so its imports were done before the command started (``started`` counts from the command's
    own start)."""

    first_step: float | None
    open: float
    load: float
    setup: float
    prepare: float
    run: float
    control: float
    compare: float
    write: float
    started: float | None = None
    model_code: float = 0.0
    fingerprint: float = 0.0
    warm: bool = False


@dataclass(frozen=True, slots=True)
class Report:
    """A replay's verdict and everything behind it (see the module's docstring)."""

    golden: str
    model: ModelFacts
    graphs: str  # graphed, eager or mixed
    mtp: bool
    head: Mapping[str, Any] | None  # the golden's MTP head, as it describes itself
    feed: str
    steps: int
    dtype: str
    variants: tuple[Variant, ...]
    determinism: Determinism
    golden_forward: str
    policy: Policy
    sensitivity: Mapping[str, Sensitivity]  # by kind
    require_coverage: bool
    verify: tuple[KResult, ...]
    reasons: tuple[Reason, ...]
    notes: tuple[str, ...]
    environment: Environments
    rows: RowsSource
    seconds: float
    phases: Mapping[str, float]  # seconds by phase (`vd.replayer.replay.PHASES`)
    reader: Mapping[str, Any] | None  # the golden reader's work by who did it, and the file check's seconds
    failure_rows: FailureRows | None = field(default=None, compare=False)
    timing: Seconds | None = field(default=None, compare=False)
    # The decode rows each forward computed against the golden's (its decode group, K = 1); None where the
    # golden stores none.
    decode: KResult | None = None
    # With --batch: the plan (n, slot: None for every slot in turn, seed) and the companions' prompt lengths.
    batch: Mapping[str, Any] | None = None
    # A golden recorded in a batch: that batch (as `batch`), which every one of the replay's runs ran its sequence
    # in again; None for a golden recorded alone.
    golden_batch: Mapping[str, Any] | None = None
    # With --locate: per forward whose rows differ, where the difference starts (`vd.replayer.locate.LocateReport`).
    located: tuple[Any, ...] = ()
    candidate: str | None = None  # where --save-candidate saved this replay's candidate
    # The forward the golden's decode rows were computed with, where another than its own (vd record
    # --decode-forward): a replay's default decode forward.
    golden_decode_forward: str | None = None

    @property
    def verdict(self) -> str:
        return "FAIL" if self.reasons else "PASS"

    @property
    def decoder(self) -> str:
        """The forward a replay computes the decode rows with unless told another: the golden's decode forward
        (`vd record --decode-forward`), else its forward."""
        return self.golden_decode_forward or self.golden_forward

    @property
    def replayed_spec(self) -> str | None:
        """The model SPEC that ran, where it is not the golden's own (see `ModelFacts`)."""
        return self.model.replayed_spec

    def reasons_of(self, what: Sequence[str], k: int | None = None) -> list[Reason]:
        return [r for r in self.reasons if r.what in what and (k is None or r.k == k)]

    def to_json(self) -> dict:
        return {"report_version": REPORT_VERSION, "golden": self.golden, "model": plain(self.model),
                "graphs": self.graphs, "mtp": self.mtp, "head": self.head,
                "warmup": False,  # a process's first propose equals every later one: no discarded warm-up run
                "feed": self.feed, "steps": self.steps, "dtype": self.dtype,
                "variants": [plain(v) for v in self.variants], "determinism": plain(self.determinism),
                "golden_forward": self.golden_forward, "golden_decode_forward": self.golden_decode_forward,
                "policy": self.policy.to_json(),
                "sensitivity": {kind: plain(s) for kind, s in self.sensitivity.items()},
                "require_coverage": self.require_coverage, "verify": [v.to_json() for v in self.verify],
                "verdict": self.verdict, "reasons": [r.text for r in self.reasons], "notes": list(self.notes),
                "environment": {**plain(self.environment),
                                "numerics_differences": list(self.environment.numerics_differences)},
                "rows": plain(self.rows), "seconds": self.seconds, "phases": dict(self.phases),
                "timing": plain(self.timing) or {}, "reader": self.reader,
                "decode": None if self.decode is None else self.decode.to_json(),
                "batch": None if self.batch is None else dict(self.batch),
                "golden_batch": None if self.golden_batch is None else dict(self.golden_batch),
                "locate": [r.to_json() for r in self.located], "candidate": self.candidate}


@dataclass(frozen=True, slots=True)
class Unjudged:
    """A replay that ended before a verdict: the golden, the one-line error and the exit code it ends with
    (2 bad input, 3 an internal error), so ``--report``, ``--junit`` and ``--html`` still say what happened."""

    golden: str
    error: str
    exit_code: int

    @property
    def verdict(self) -> str:
        return "ERROR"

    def to_json(self) -> dict:
        return {"report_version": REPORT_VERSION, "golden": self.golden, "verdict": self.verdict,
                "exit_code": self.exit_code, "error": self.error, "reasons": [self.error]}


@dataclass(frozen=True, slots=True)
class DiffK:
    """One K of a diff: B's rows judged against A's, and the steps whose tokens or accept counts differ."""

    k: int
    comparison: Comparison
    steps_changed: tuple[int, ...]

    def to_json(self) -> dict:
        return {"k": self.k, "comparison": self.comparison.to_json(), "steps_changed": list(self.steps_changed)}


@dataclass(frozen=True, slots=True)
class DiffReport:
    """Golden B judged against golden A (`vd.replayer.diff`): per K a comparison, and the reasons."""

    a: str
    b: str
    policy: Policy
    dtype: str
    environments: tuple[Mapping[str, Any] | None, Mapping[str, Any] | None]  # A's and B's
    verify: tuple[DiffK, ...]
    reasons: tuple[Reason, ...]
    made: tuple[str, ...] = ()  # how A and B were made differently (`vd.replayer.diff.made_differently`)

    @property
    def verdict(self) -> str:
        return "FAIL" if self.reasons else "PASS"

    def to_json(self) -> dict:
        return {"a": self.a, "b": self.b, "policy": self.policy.to_json(), "dtype": self.dtype,
                "environment": {"a": self.environments[0], "b": self.environments[1]}, "made": list(self.made),
                "verify": [v.to_json() for v in self.verify], "verdict": self.verdict,
                "reasons": [r.text for r in self.reasons]}

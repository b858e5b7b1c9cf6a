"""What a replay concludes, as typed values (`Report` and its parts) that become JSON only at the edge
(`Report.to_json`).

The JSON keeps the seed's fields (``graphs``, ``mtp``, ``steps``, ``variants``, ``verify[k, accepted,
comparisons, timings, detection_control]``, ``verdict``, ``reasons``) and adds the golden, model, policy
and its sensitivity, coverage, determinism, both environments and where the replay's time went. Every
reason is a `Reason` that says what it is about (``rows``, ``draft``, ``control``, ``thin``,
``coverage``, ``environment``) and which K and forward, so renderers need not parse its text.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath

import numpy as np

from vd.compare import Comparison
from vd.coverage import histogram
from vd.policy import Policy

REPORT_VERSION = 1


def golden_name(golden: str) -> str:
    """A golden's short name: its path's or URL's last part without the extension (``smollm2`` for
    ``s3://bucket/goldens/smollm2.zarr``), as JUnit class names and the HTML page use it."""
    return PurePosixPath(golden.rstrip("/")).stem or golden


@dataclass(frozen=True, slots=True)
class Reason:
    """One reason a replay fails: ``what`` it is about, the K and forward it concerns, and its text."""

    what: str  # rows, draft, control, thin, coverage, environment
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

    def to_json(self) -> dict:
        ms = self.step_ms
        return {"variant": self.variant, "steps": len(ms), "step_ms_median": statistics.median(ms) if ms else None,
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

    @property
    def histogram(self) -> list[int]:
        """How many steps accepted 0, 1, .., K-1 drafts: the golden's coverage of the accept path."""
        return histogram(self.k, self.accepted)

    def to_json(self) -> dict:
        hist = self.histogram
        return {"k": self.k, "accepted": list(self.accepted), "accept_histogram": hist,
                "coverage": {"accepted_counts": hist, "missing": [i for i, n in enumerate(hist) if n == 0]},
                "comparisons": [j.to_json() for j in self.comparisons], "timings": [t.to_json() for t in self.timings],
                "detection_control": None if self.control is None else self.control.to_json(),
                "golden_left_greedy_step": self.left_greedy}


@dataclass(frozen=True, slots=True)
class FailureRows:
    """The golden's and the candidate's rows of the first failing step, as stored (a first-divergence
    bundle's ``rows.npz``); ``golden`` is None for a slim golden replayed without its rows; ``text`` is
    the step's tokens decoded, where the model can decode (`vd.protocol.TokenDecoder`)."""

    k: int
    forward: str
    kind: str
    step: int | None
    golden: np.ndarray | None
    candidate: np.ndarray
    tokens: list[int] | None
    first_failure: dict
    text: str | None = None


@dataclass(frozen=True, slots=True)
class Report:
    """A replay's verdict and everything behind it (see the module's docstring).

    ``model`` holds the golden's ``spec``, ``name`` and ``fingerprint``, the identity it was
    ``replayed_with`` and ``replayed_spec``: the model SPEC that ran when it was not the golden's own (a
    plug-in wrapping the golden's model, say), else None.
    """

    golden: str
    model: dict
    graphs: str  # graphed, eager or mixed
    mtp: bool
    head: dict | None
    feed: str
    steps: int
    dtype: str
    variants: tuple[dict, ...]
    determinism: dict
    golden_forward: str
    policy: Policy
    sensitivity: dict
    require_coverage: bool
    verify: tuple[KResult, ...]
    reasons: tuple[Reason, ...]
    notes: tuple[str, ...]
    environment: dict
    rows: dict  # the golden's rows: stored, or a slim golden's source (None when none was named)
    seconds: float
    phases: dict
    reader: dict | None
    failure_rows: FailureRows | None = field(default=None, compare=False)
    # Seconds by phase (load, setup, prepare, run, control, compare, write), and ``first_step``: from the
    # process's start to its first forward of a verify run (start-up, as a user waits for it).
    timing: dict = field(default_factory=dict, compare=False)

    @property
    def verdict(self) -> str:
        return "FAIL" if self.reasons else "PASS"

    @property
    def replayed_spec(self) -> str | None:
        """The model SPEC that ran, where it is not the golden's own (see ``model``)."""
        return self.model.get("replayed_spec")

    def reasons_of(self, what: Sequence[str], k: int | None = None) -> list[Reason]:
        return [r for r in self.reasons if r.what in what and (k is None or r.k == k)]

    def to_json(self) -> dict:
        return {"report_version": REPORT_VERSION, "golden": self.golden,
                "model": {**self.model, "replayed_spec": self.replayed_spec}, "graphs": self.graphs,
                "mtp": self.mtp, "head": self.head,
                "warmup": False,  # a process's first propose equals every later one: no discarded warm-up run
                "feed": self.feed, "steps": self.steps, "dtype": self.dtype, "variants": list(self.variants),
                "determinism": self.determinism, "golden_forward": self.golden_forward,
                "policy": self.policy.to_json(), "sensitivity": self.sensitivity,
                "require_coverage": self.require_coverage, "verify": [v.to_json() for v in self.verify],
                "verdict": self.verdict, "reasons": [r.text for r in self.reasons], "notes": list(self.notes),
                "environment": self.environment, "rows": self.rows, "seconds": self.seconds, "phases": self.phases,
                "timing": self.timing, "reader": self.reader}

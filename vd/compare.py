"""Comparing a run's logits rows with a golden's under a policy, the decisions they drive, and the
thin-reference check.

Bits first: a row whose stored bit patterns equal the golden's (a NaN equals only the same NaN, and -0.0
differs from 0.0) costs one comparison on the candidate's device. Rows that differ are measured there
(largest absolute and ULP difference, count of differing elements, first differing index, KL divergence,
where in the vocabulary the differences sit) and judged under the kind's policy (`vd.policy`). Every
row's argmax and every step's accept count are checked too: a flipped decision fails even inside a
tolerance, with the golden's top-1/top-2 margin to tell a near-tie from a real change.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields

import numpy as np
import torch

from vd.gold import Gold, InMemory, int_view, side_stream
from vd.golden import ENCODINGS, TORCH_DTYPES, KRecord
from vd.loop import Run
from vd.policy import KINDS, MANTISSA_BITS, Spec, parse_spec


@dataclass(frozen=True, slots=True)
class Mismatch:
    """Where two sets of rows first differ: step (None for the prefill), row, vocab index, both values."""

    step: int | None
    row: int
    index: int
    golden: float
    got: float


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


NEAR_TIE_ULPS = 4
_ORDER = {"prefill": 0, "verify": 2, "draft": 3}


@dataclass(frozen=True, slots=True)
class Comparison:
    """One forward's rows against the golden's, for one K, under a policy.

    The bit-level fields (``prefill_equal``, ``mismatched_*``, ``first_mismatch``, ``max_abs_diff``) say
    where bits differ; ``passed`` is the verdict under ``policy`` with decisions checked; ``per_step``,
    ``summary``, ``flips``, ``accept_changes`` and ``positions`` say how. The ``draft_*`` fields and
    ``bootstrap_equal`` compare the MTP head's outputs and are None for a reference golden.
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
    policy: dict = field(default_factory=dict)
    passed: bool = True
    failed_step_list: list[int] = field(default_factory=list)  # verify or draft rows failing, or a flip
    first_failure: dict | None = None
    flips: list[Flip] = field(default_factory=list)
    accept_changes: list[dict] = field(default_factory=list)
    per_step: list[dict] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)  # every row that differs or flips, measured (first MAX_ROWS)
    summary: dict = field(default_factory=dict)
    positions: dict = field(default_factory=dict)

    @property
    def equal(self) -> bool:
        return (self.prefill_equal and self.mismatched_steps == 0 and self.bootstrap_equal is not False
                and not self.draft_mismatched_steps)

    def to_json(self) -> dict:
        """As `dataclasses.asdict` (the nested mismatches and flips as dicts) without its deep copy of
        every list and dict, which are this comparison's own (0.47 against 0.015 ms for a 6-step
        comparison on the 2-core machines)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for n in ("first_mismatch", "prefill_first_mismatch", "draft_first_mismatch"):
            if out[n] is not None:
                out[n] = asdict(out[n])
        out["flips"] = [asdict(f) for f in self.flips]
        return out


def _ordered(bits: torch.Tensor) -> torch.Tensor:
    """Integer bit patterns mapped so that adjacent floats are adjacent integers (-0.0 and 0.0 both 0)."""
    b = bits.to(torch.int64)
    low = -(1 << (8 * bits.element_size() - 1))
    return torch.where(b < 0, low - b, b)


@dataclass(slots=True)
class Rows:
    """Per-row measurements of ``R`` candidate rows against the golden's (numpy arrays of length R)."""

    differ: np.ndarray
    passed: np.ndarray
    n_diff: np.ndarray
    first_index: np.ndarray
    first_golden: np.ndarray
    first_got: np.ndarray
    max_abs: np.ndarray
    max_ulp: np.ndarray
    kl: np.ndarray
    golden_argmax: np.ndarray
    got_argmax: np.ndarray
    margin: np.ndarray
    top1: np.ndarray
    golden_absmax: np.ndarray  # the golden row's largest |logit|
    top1_p: np.ndarray  # the golden row's top-token probability
    positions: np.ndarray  # differing elements per vocabulary bin, summed over rows


POSITION_BINS = 64
_MEASURES = ("n_diff", "first_index", "first_golden", "first_got", "max_abs", "max_ulp", "kl")  # per row, 0 if equal
MAX_ROWS = 2000  # rows listed one by one in a comparison; the summaries cover them all


def measure(gold_bits: torch.Tensor, got: torch.Tensor, logical: str, spec: Spec) -> Rows:
    """Candidate rows ``[R, V]`` measured against golden bit patterns ``[R, V]`` (`measure_kinds` for one
    kind of rows held in memory)."""
    v = got.shape[-1]
    rec = KRecord(k=1, bootstrap=0, tokens=np.zeros((0, 1), np.int32), accepted=np.zeros(0, np.int32),
                  prefill=gold_bits.cpu().numpy().view(ENCODINGS[logical][0]).reshape(-1, v),
                  logits=np.zeros((0, 1, v), ENCODINGS[logical][0]), step_ms=np.zeros(0))
    return measure_kinds(InMemory(rec), got.reshape(-1, v), logical, {"prefill": spec, "verify": spec})["prefill"]


def measure_kinds(gold: Gold, got: torch.Tensor, logical: str, specs: Mapping[str, Spec],
                  flags: np.ndarray | None = None) -> dict[str, Rows]:
    """Each kind's candidate rows measured against the golden's, on the candidate's device: ``got`` is
    ``[R, V]``, every kind's rows in ``gold.counts``' order (`vd.loop.Run.flat_rows`); ``flags``, when
    given, say which differ (`Queued`).

    Which rows differ (`vd.gold.Gold.differ`: their bits, or their digests) comes back in one read-back;
    the golden's statistics of each row (argmax, margin, ...) are the golden's own (`vd.gold.Gold.stats`:
    stored, or computed from its rows), and a row equal to the golden's has the golden's argmax. Only
    rows that differ are fetched from the golden (from its store, for a golden known by digests),
    measured element by element and judged under their kind's spec.
    """
    differ_all = gold.differ(got).cpu().numpy() if flags is None else flags
    out, at = {}, 0
    for name, n in gold.counts.items():
        differ = differ_all[at:at + n]
        c = got[at:at + n]
        at += n
        golden = gold.stats(name, got.device)
        zero = np.zeros(n, dtype=np.float64)  # every measure of a row whose bits are equal
        host = dict.fromkeys(_MEASURES, zero)
        passed, got_argmax = ~differ, golden["argmax"]
        positions = np.zeros(POSITION_BINS, dtype=np.int64)
        if differ.any():
            host = {m: zero.copy() for m in _MEASURES}
            got_argmax = got_argmax.copy()
            idx = np.flatnonzero(differ)
            vals, ok, c_arg, positions = _measure_differing(gold.rows(name, idx, got.device), c[idx], logical,
                                                            specs[name])
            for m in _MEASURES:
                host[m][idx] = vals[m]
            passed[idx] = ok
            got_argmax[idx] = c_arg
        out[name] = Rows(differ=differ, passed=passed, golden_argmax=golden["argmax"], got_argmax=got_argmax,
                         margin=golden["margin"], top1=golden["top1"], golden_absmax=golden["absmax"],
                         top1_p=golden["top1_p"], positions=positions, **host)
    return out


def _measure_differing(gb: torch.Tensor, got: torch.Tensor, logical: str, spec: Spec
                       ) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
    """Rows that differ, measured (`_MEASURES`), judged under ``spec`` and their argmax taken, on the
    device: golden bits ``gb`` and candidate rows ``got``, both ``[D, V]``; with the histogram of their
    differing elements over the vocabulary. One read-back."""
    v = got.shape[1]
    cb = int_view(got)
    gd, cd, dm = gb.view(TORCH_DTYPES[logical]).float(), got.float(), gb != cb
    first = dm.to(torch.int8).argmax(dim=1)
    nan = gd.isnan() | cd.isnan()
    absd = torch.where(dm, (gd - cd).abs(), 0.0)
    absd = torch.where(dm & nan, torch.inf, absd)
    ulp = (_ordered(gb) - _ordered(cb)).abs().to(torch.float64)
    ulp = torch.where(dm & nan, torch.inf, ulp)
    kl = (torch.softmax(gd, 1) * (torch.log_softmax(gd, 1) - torch.log_softmax(cd, 1))).sum(1)
    kl = torch.nan_to_num(kl.to(torch.float64), nan=torch.inf).clamp_min(0.0)
    cols = dm.nonzero()[:, 1]
    positions = torch.bincount(cols * POSITION_BINS // v, minlength=POSITION_BINS)
    rows_at = torch.arange(gb.shape[0], device=got.device)
    c_arg = cd.argmax(1)
    vals = {"n_diff": dm.sum(1), "first_index": first, "first_golden": gd[rows_at, first],
            "first_got": cd[rows_at, first], "max_abs": absd.max(1).values, "max_ulp": ulp.max(1).values, "kl": kl}
    if spec.name == "ulp":
        ok = ulp.max(1).values <= spec.n
    elif spec.name == "close":
        ok = ~(absd > spec.atol + spec.rtol * gd.abs()).any(1)
    elif spec.name == "argmax":
        ok = gd.argmax(1) == c_arg
    elif spec.name == "topk":
        n = min(spec.n, v)
        ok = (gd.topk(n, 1).indices.sort(1).values == cd.topk(n, 1).indices.sort(1).values).all(1)
    elif spec.name == "kl":
        ok = kl <= spec.kl
    else:
        ok = torch.zeros(gb.shape[0], dtype=torch.bool, device=got.device)
    packed = torch.cat([torch.stack([vals[n].to(torch.float64) for n in _MEASURES]),
                        torch.stack([ok.double(), c_arg.double()])]).cpu().numpy()
    m = len(_MEASURES)
    return ({n: packed[i] for i, n in enumerate(_MEASURES)}, packed[m] != 0, packed[m + 1].astype(np.int64),
            positions.cpu().numpy())


def ulp_of(x: float, logical: str) -> float:
    """One unit in the last place of ``x`` in the logical dtype."""
    x = abs(x) if math.isfinite(x) and x != 0 else 2.0 ** -126
    return 2.0 ** (math.floor(math.log2(x)) - MANTISSA_BITS[logical])


@dataclass(slots=True)
class _Kind:
    """One kind's rows laid out as steps × rows-per-step (the prefill is one "step" of P rows)."""

    name: str
    rows: Rows
    per_step: int
    stepped: bool  # False: the prefill (its rows have no step)
    offset: int = 0  # the bootstrap row precedes the draft rows of step 0

    def where(self, flat: int) -> tuple[int | None, int]:
        flat -= self.offset
        if flat < 0:
            return None, 0  # the bootstrap row
        return (flat // self.per_step if self.stepped else None), flat % self.per_step


def _first_mismatch(kind: _Kind, skip: int = 0) -> Mismatch | None:
    """The first differing element of a kind's rows, past its first ``skip`` rows."""
    r = kind.rows
    bad = np.flatnonzero(r.differ[skip:]) + skip
    if not bad.size:
        return None
    f = int(bad[0])
    step, row = kind.where(f)
    return Mismatch(step, row, int(r.first_index[f]), float(r.first_golden[f]), float(r.first_got[f]))


class Queued:
    """Which of a run's rows differ from the golden's, asked of the GPU while it still runs the run's last
    step (`vd.loop.run_verify`'s ``on_last``): the rows gathered, compared (`vd.gold.Gold.differ`) and
    the answer copied back to page-locked memory on a side stream behind that step's forward, nothing
    waited for; `compare_run` takes it instead of doing the same after the run. On the H200 that host
    work took 0.1-0.5 ms after a run (tools/h200/bench_gpu_history.json), where the GPU waited for it."""

    def __init__(self, gold: Gold, run: Run, last: torch.Tensor):
        device = last.device
        self.stream = side_stream(device)
        self.stream.wait_stream(torch.cuda.current_stream(device))  # behind the forward just issued
        with torch.cuda.stream(self.stream):
            flat, self.counts = run.flat_rows(last)
            self.rows = flat[:sum(gold.counts.values())]
            flags = gold.differ(self.rows)
            self.flags = torch.empty(flags.shape, dtype=torch.bool, pin_memory=True)
            self.flags.copy_(flags, non_blocking=True)
            self.done = self.stream.record_event()

    def result(self) -> tuple[torch.Tensor, np.ndarray]:
        """The rows (for the current stream) and which of them differ, once the side stream is done."""
        self.done.synchronize()
        self.rows.record_stream(torch.cuda.current_stream(self.rows.device))
        return self.rows, self.flags.numpy()


def compare_run(variant: str, golden: Gold | KRecord, run: Run, logical: str,
                policy: Mapping[str, str] | None = None, queued: Queued | None = None) -> Comparison:
    """Measure every row of ``run`` (its prefill, each step's K rows and, for an MTP golden, the bootstrap
    decode row and the head's draft rows) against ``golden`` (a `vd.gold.Gold`; a `KRecord` is taken as
    `vd.gold.InMemory`), judge them under ``policy`` (exact by default), and check every decision: each
    row's argmax, and each step's accept count. ``queued``: which rows differ, asked of the GPU during
    the run's last step (`Queued`)."""
    gold = InMemory(golden) if isinstance(golden, KRecord) else golden
    policy = dict(policy or {k: "exact" for k in KINDS})
    specs = {k: parse_spec(policy.get(k, "exact")) for k in KINDS}
    flags = None
    if queued is not None:
        (got, flags), counts = queued.result(), queued.counts
    else:
        got, counts = run.flat_rows()
    assert {n: counts[n] for n in gold.counts} == gold.counts, "shapes checked on load"
    assert list(counts)[:len(gold.counts)] == list(gold.counts), "kinds in one order"
    s, k = gold.steps, gold.k
    shape = {"prefill": (gold.counts["prefill"], False, 0), "verify": (k, True, 0)}
    mtp = "draft" in gold.counts
    if mtp:  # the bootstrap row, then each step's K-1 draft rows, as `KRecord.rows_by_kind` lays them out
        shape["draft"] = (k - 1, True, 1)
    measured = measure_kinds(gold, got[:sum(gold.counts.values())], logical, specs, flags)
    kinds = [_Kind(n, measured[n], *shape[n]) for n in gold.counts]
    by = {kd.name: kd for kd in kinds}

    # A kind none of whose rows differ has every measure zero and its golden's argmax everywhere: its
    # rows cannot fail or flip, and its figures below are zeros (the common case, kept cheap).
    quiet = {kd.name: not kd.rows.differ.any() for kd in kinds}
    flips, failed_steps, failures = [], set(), []
    for kd in kinds:
        if quiet[kd.name]:
            continue
        r = kd.rows
        # A row's argmax is a decision where generation acts on it: every verify row (acceptance and the
        # bonus token), every draft row (the draft itself), and the prefill's last row (the first token);
        # the other prefill rows are teacher-forced and decide nothing.
        decides = np.ones(r.differ.size, dtype=bool)
        if kd.name == "prefill":
            decides[:-1] = False
        flipped_rows = (r.golden_argmax != r.got_argmax) & decides
        for f in np.flatnonzero(~r.passed | flipped_rows):
            step, row = kd.where(int(f))
            if step is not None:
                failed_steps.add(step)
            flipped = bool(flipped_rows[f])
            if flipped:
                top1 = float(r.top1[f])
                units = float(r.margin[f]) / ulp_of(top1, logical)
                flips.append(Flip(kd.name, step, row, int(r.golden_argmax[f]), int(r.got_argmax[f]),
                                  float(r.margin[f]), units, units <= NEAR_TIE_ULPS, float(r.max_abs[f])))
            # In the order the rows were computed: prefill, bootstrap, then each step's verify and draft rows.
            order = (-1 if step is None else step, _ORDER[kd.name] if step is not None else int(kd.name == "draft"))
            failures.append((order, row, {"kind": kd.name, "step": step, "row": row,
                                          "index": int(r.first_index[f]), "golden": float(r.first_golden[f]),
                                          "got": float(r.first_got[f]), "policy": policy[kd.name],
                                          "argmax_flipped": flipped}))
    first_failure = min(failures, key=lambda x: (x[0], x[1]))[2] if failures else None
    accept_changes = [{"step": i, "golden": int(a), "got": int(b)}
                      for i, (a, b) in enumerate(zip(gold.accepted.tolist(), run.computed)) if a != b]
    failed_steps |= {c["step"] for c in accept_changes}

    ver, pre = by["verify"].rows, by["prefill"].rows

    def steps_of(a: np.ndarray, per: int, skip: int = 0) -> np.ndarray:  # [S, per] rows of each step
        return a[skip:skip + s * per].reshape(s, per)

    if quiet["verify"]:
        cols = {"max_abs": [0.0] * s, "max_ulp": [0.0] * s, "n_diff": [0] * s, "max_kl": [0.0] * s,
                "argmax_agree": [True] * s}
    else:
        cols = {"max_abs": steps_of(ver.max_abs, k).max(1).tolist(),
                "max_ulp": steps_of(ver.max_ulp, k).max(1).tolist(),
                "n_diff": steps_of(ver.n_diff, k).sum(1).astype(np.int64).tolist(),
                "max_kl": steps_of(ver.kl, k).max(1).tolist(),
                "argmax_agree": (steps_of(ver.golden_argmax, k) == steps_of(ver.got_argmax, k)).all(1).tolist()}
    drafts = {}
    if mtp and quiet["draft"]:
        drafts = {"draft_max_abs": [0.0] * s, "draft_n_diff": [0] * s}
    elif mtp:
        d = by["draft"].rows
        drafts = {"draft_max_abs": steps_of(d.max_abs, k - 1, 1).max(1, initial=0.0).tolist(),
                  "draft_n_diff": steps_of(d.n_diff, k - 1, 1).sum(1).astype(np.int64).tolist()}
    per_step = [{"step": i, **{n: c[i] for n, c in cols.items()}, "passed": i not in failed_steps,
                 **{n: c[i] for n, c in drafts.items()}} for i in range(s)]
    summary = {}
    for kd in kinds:
        r = kd.rows
        if quiet[kd.name]:
            figures = {"rows_differ": 0, "rows_failed": 0, "argmax_flips": 0, "max_abs": 0.0, "max_ulp": 0.0,
                       "max_kl": 0.0, "n_diff": 0}
        else:
            figures = {"rows_differ": int(r.differ.sum()), "rows_failed": int((~r.passed).sum()),
                       "argmax_flips": int(sum(f.kind == kd.name for f in flips)),
                       "max_abs": float(r.max_abs.max(initial=0.0)), "max_ulp": float(r.max_ulp.max(initial=0.0)),
                       "max_kl": float(r.kl.max(initial=0.0)), "n_diff": int(r.n_diff.sum())}
        summary[kd.name] = {"rows": int(r.differ.size), **figures, **gold.figures(kd.name, got.device)}
    row_list = []
    for kd in kinds:
        if quiet[kd.name]:
            continue
        r = kd.rows
        for f in np.flatnonzero(r.differ)[: MAX_ROWS - len(row_list)]:
            step, row = kd.where(int(f))
            row_list.append({"kind": kd.name, "step": step, "row": row, "passed": bool(r.passed[f]),
                             "n_diff": int(r.n_diff[f]), "first_index": int(r.first_index[f]),
                             "max_abs": float(r.max_abs[f]), "max_ulp": float(r.max_ulp[f]), "kl": float(r.kl[f]),
                             "argmax_agree": bool(r.golden_argmax[f] == r.got_argmax[f])})
    positions = {"bins": POSITION_BINS, "vocab": int(gold.vocab),
                 "counts": [0] * POSITION_BINS if all(quiet.values())
                 else [int(x) for x in sum(kd.rows.positions for kd in kinds)]}

    vbad = [] if quiet["verify"] else sorted({by["verify"].where(int(f))[0] for f in np.flatnonzero(ver.differ)})
    extra = {}
    if mtp:
        d = by["draft"].rows
        # Row 0 of the draft kind is the bootstrap row, reported on its own.
        dbad = sorted({by["draft"].where(int(f))[0] for f in np.flatnonzero(d.differ[1:]) + 1})
        extra = dict(bootstrap_equal=not bool(d.differ[0]), draft_mismatched_steps=len(dbad),
                     draft_first_mismatch=_first_mismatch(by["draft"], skip=1),
                     draft_max_abs_diff=float(d.max_abs.max(initial=0.0)),
                     draft_mismatched_step_list=dbad)
    return Comparison(
        variant=variant,
        prefill_equal=not pre.differ.any(),
        mismatched_steps=len(vbad),
        steps=s,
        first_mismatch=_first_mismatch(by["verify"]),
        max_abs_diff=max(float(pre.max_abs.max(initial=0.0)), float(ver.max_abs.max(initial=0.0)),
                         float(by["draft"].rows.max_abs[0]) if mtp else 0.0),
        prefill_first_mismatch=_first_mismatch(by["prefill"]),
        mismatched_step_list=vbad,
        decision_changes=len(accept_changes),
        policy=policy,
        passed=not flips and not accept_changes and all(quiet[kd.name] or kd.rows.passed.all() for kd in kinds),
        failed_step_list=sorted(failed_steps),
        first_failure=first_failure,
        flips=flips,
        accept_changes=accept_changes,
        per_step=per_step,
        rows=row_list,
        summary=summary,
        positions=positions,
        **extra,
    )


def thin_reason(k: int, accepted: Sequence[int]) -> str | None:
    """Why a reference is too thin to trust (it must hold a full and a partial accept), or None."""
    full = sum(1 for a in accepted if a == k - 1)
    if full == 0 or full == len(accepted):
        return (f"verify K={k}: the reference accepted {list(accepted)}; "
                "it needs both full and partial accepts")
    return None


def coverage_reason(k: int, hist: Sequence[int]) -> str:
    """Why a golden misses part of the accept path: the accept counts no step had."""
    missing = [i for i, n in enumerate(hist) if n == 0]
    return (f"coverage K={k}: no step accepted {', '.join(map(str, missing))} draft(s) "
            f"(steps per accept count 0..{k - 1}: {list(hist)})")


def histogram(k: int, accepted: Sequence[int]) -> list[int]:
    """How many steps accepted 0, 1, .., K-1 drafts."""
    out = [0] * k
    for a in accepted:
        out[a] += 1
    return out

"""From a difference to the first module that makes it (``vd locate``, ``vd replay --locate``).

A forward runs a golden's stored steps (its tokens, accept counts and rewinds, as a replay drives them) at each
K, and the first forward call whose rows differ (the prefill, the bootstrap decode, or a step) is found; then:

* **against a traced golden** (``vd record --trace``): the calls up to it run again with every traced module's
  output digested (`vd.tracing`), and the first call and module, in the order the forward computes them, whose
  output rows' digests differ from the golden's are named, with the golden's and this run's max |x| and norm
  there (the golden's values are not stored, so no |Δ|);
* **between two forwards** (``--between B``): that call runs under both with every traced output kept, and the
  first module whose output differs is named with the largest |Δ| between them.

Everything before the named module is bit-identical, so it is where the difference starts. The path of the
difference through the layers (per layer, its first differing module) comes with it. Only the points both
traces hold are compared (a compiled step is traced at its compiled regions' edges: `vd.models.lean`). The
traced pass runs the forward's kernels without CUDA graphs; ``reproduces`` says whether its rows equalled the
plain pass's, without which its module outputs are not that forward's.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from vd import protocol
from vd.batch import BatchPlan, BatchView, batched
from vd.digest import summarise
from vd.equivalence import decode_map
from vd.errors import UsageError
from vd.layout import RowLayout
from vd.loop import generated
from vd.models import check_device, check_forward_names, load_model, require_forwards
from vd.models.specs import golden_dir, stored
from vd.preflight import BATCH, DECODE, axis, batch_size, untraced
from vd.protocol import VerifyModel, require_model
from vd.replayer.session import check_model
from vd.store import Golden, Location, open_golden
from vd.store.format import DECODE_K
from vd.tracing import Call, Point, Traced, check_traceable, steps_run


@dataclass(frozen=True, slots=True)
class Module:
    """One traced point where outputs differ: its path, what it is, and how they differ: the largest |Δ| (between
    two forwards), or how many of its rows differ and the golden's and this run's max |x| and norm there."""

    name: str
    what: str
    max_abs: float | None = None
    rows: tuple[int, int] = (0, 0)  # rows that differ, of the call's rows
    absmax: tuple[float, float] | None = None  # (golden, now): the largest over the differing rows
    norm: tuple[float, float] | None = None

    @property
    def layer(self) -> int | None:
        m = re.search(r"\.layers\.(\d+)(\.|$)", self.name)
        return int(m.group(1)) if m else None

    def to_json(self) -> dict:
        return {"name": self.name, "what": self.what, "layer": self.layer, "max_abs": self.max_abs,
                "rows_differ": self.rows[0], "rows": self.rows[1],
                "absmax": None if self.absmax is None else {"golden": self.absmax[0], "now": self.absmax[1]},
                "norm": None if self.norm is None else {"golden": self.norm[0], "now": self.norm[1]}}


@dataclass(frozen=True, slots=True)
class Located:
    """One K: the first call whose rows differ (``step`` None and ``call`` 0: the prefill; ``found`` False: none),
    the call and first module whose output differs there (``module_step``: where the module first differs, which
    can be before the rows do), how many points before it are identical, per layer the first differing module (the
    path of the difference), and whether the traced pass reproduced the plain pass's rows."""

    k: int
    found: bool
    step: int | None = None
    call: str = ""
    rows_max_abs: float | None = None
    first: Module | None = None
    module_call: str = ""
    identical_before: int = 0
    path: tuple[Module, ...] = ()
    reproduces: bool | None = None
    note: str = ""
    compared: int = 0  # points both traces hold
    profile: tuple[tuple[str, str, int | None, float], ...] = ()  # every compared point: name, what, layer, size

    def to_json(self) -> dict:
        return {"k": self.k, "differs": self.found, "step": self.step, "call": self.call,
                "rows_max_abs": self.rows_max_abs, "module_call": self.module_call,
                "first_module": None if self.first is None else self.first.to_json(),
                "identical_before": self.identical_before, "points_compared": self.compared,
                "path": [m.to_json() for m in self.path], "traced_pass_reproduces": self.reproduces,
                "note": self.note or None,
                "profile": [{"name": n, "what": w, "layer": lay, "size": v} for n, w, lay, v in self.profile]}


@dataclass(frozen=True, slots=True)
class LocateReport:
    golden: str
    forwards: tuple[str, ...]  # one: against the golden's traces; two: between them
    ks: tuple[Located, ...] = field(default_factory=tuple)
    notes: tuple[str, ...] = ()
    decoder: str | None = None  # with --between decode: the forward that computed the decode rows, where another

    @property
    def found(self) -> bool:
        return any(x.found for x in self.ks)

    def _held(self) -> tuple[str, str]:
        """What the forward was held against: the JSON's ``against``, and the words the terminal and page use."""
        if len(self.forwards) == 1:
            return "golden traces", "the golden's traces"
        other = self.forwards[1]
        if other == DECODE:
            return "decode rows", "its own decode rows" if self.decoder is None else f"{self.decoder}'s decode rows"
        if axis(other):
            return f"batch of {batch_size(other)}", f"itself in a batch of {batch_size(other)}"
        return "between forwards", other

    @property
    def against(self) -> str:
        """What the forward was held against, in words: the golden's traces, its own decode rows, itself in a
        batch of N, or another forward."""
        return self._held()[1]

    def to_json(self) -> dict:
        return {"golden": self.golden, "forwards": list(self.forwards), "against": self._held()[0],
                "differs": self.found, "verify": [x.to_json() for x in self.ks], "notes": list(self.notes)}


def _calls(lay: RowLayout) -> list[tuple[str, np.ndarray, int | None]]:
    """A run's forward calls in order: (name, their flat row indices in ``lay``, the step or None)."""
    out: list[tuple[str, np.ndarray, int | None]] = [("the prefill", np.arange(lay.prompt), None)]
    if lay.drafted:
        out.append(("the bootstrap decode", np.array([lay.offset("draft")]), None))
    out += [(f"step {s}", lay.offset("verify") + lay.step_rows("verify", s), s) for s in range(lay.steps)]
    return out


def _first_call(lay: RowLayout, differ: np.ndarray) -> int | None:
    """The first forward call (`_calls`) with a row flagged in ``differ``."""
    return next((i for i, (_, rows, _) in enumerate(_calls(lay)) if differ[rows].any()), None)


def _digests(model: VerifyModel, g: Golden, k: int) -> np.ndarray:
    """The row digests of K's stored steps (or the decode group's) run through ``model`` (`vd.tracing.steps_run`)."""
    lay = g.layout(k)
    return summarise(steps_run(model, g.prompt, g.log(k), lay.steps, lay.drafted).rows_by_kind())[0]


def _traced(model: VerifyModel, g: Golden, k: int, upto: int, plain: np.ndarray, keep: bool) -> tuple[Traced, bool]:
    """Calls 0 .. ``upto`` of K run again traced: the tracer, and whether the traced pass's rows of those calls
    equal the plain pass's (``plain``: its rows' digests)."""
    lay = g.layout(k)
    steps = max(0, upto - lay.drafted)
    traced = Traced(model, protocol.tracer(model), range(upto + 1), keep)  # type: ignore[arg-type]
    run = steps_run(traced, g.prompt, g.log(k), steps, lay.drafted)
    digests = summarise(run.rows_by_kind())[0]
    short = RowLayout(lay.prompt, steps, k, lay.drafted)
    # (the first ``upto + 1`` calls of each: a drafter's run of no steps still makes its bootstrap decode)
    mine = np.concatenate([rows for _, rows, _ in _calls(short)[: upto + 1]])
    theirs = np.concatenate([rows for _, rows, _ in _calls(lay)[: upto + 1]])
    return traced, bool(np.array_equal(digests[mine], plain[theirs]))


def locate_k(model: VerifyModel, g: Golden, k: int, forwards: Sequence[str]) -> Located:
    """The first module where ``forwards[0]`` parts from the golden's traces (one forward) or from
    ``forwards[1]`` (two), on the golden's steps at ``k`` (`Located`). At the decode group against the golden's
    traces, ``forwards[0]`` is the forward that computes the decode rows (`_decoder`)."""
    if len(forwards) == 2 and forwards[1] == DECODE:
        return _decode_axis(model, g, k, forwards[0])
    if len(forwards) == 2 and forwards[1].startswith(BATCH):
        return _batch_axis(model, g, k, forwards[0], batch_size(forwards[1]))
    plain = []
    for name in forwards:
        model.set_forward(name)
        plain.append(_digests(model, g, k))
    if len(forwards) == 2:
        return _between(model, g, k, forwards, plain)
    return _against_golden(model, g, k, forwards[0], plain[0])


def _between(model: VerifyModel, g: Golden, k: int, forwards: Sequence[str], plain: list[np.ndarray]) -> Located:
    def run(i: int) -> VerifyModel:
        model.set_forward(forwards[i])
        return model

    return _two(g, k, run, plain)


def _batch_axis(model: VerifyModel, g: Golden, k: int, forward: str, n: int) -> Located:
    """``--between batch:N``: under ``forward``, the golden's sequence alone against it as one member of a batch of
    ``n`` (`vd.batch`: every slot in turn, companions from seed 0), traced at the first call whose rows differ."""
    if g.info.drafted_at(k):
        raise UsageError("--between batch:N runs the reference feed's steps in a batch: a drafter golden has none")
    forward = _decoder(g, forward) if k == DECODE_K else forward  # (decode rows are the decode forward's)
    model.set_forward(forward)
    batched(model, forward)
    view = BatchView(model, BatchPlan(n, None, 0), g.prompt, generated(g.info.steps, g.ks))
    check_traceable(view, forward, f"--between batch:{n}")
    plain = [_digests(m, g, k) for m in (model, view)]
    return _two(g, k, lambda i: (model, view)[i], plain)


def _two(g: Golden, k: int, run: Callable[[int], VerifyModel], plain: list[np.ndarray]) -> Located:
    """Two runs of the golden's steps (``run(0)``, ``run(1)``: the models that make them; ``plain``: their rows'
    digests) traced at the first call whose rows differ, and compared point by point."""
    calls = _calls(g.layout(k))
    hit = _first_call(g.layout(k), (plain[0] != plain[1]).any(1))
    if hit is None:
        return Located(k, False)
    traces, same = [], True
    for i, rows in enumerate(plain):
        t, ok = _traced(run(i), g, k, hit, rows, keep=True)
        traces.append(t.traced[hit])
        same = same and ok
    first, before, path, compared, profile = _compare_rows(*traces)
    name, _, step = calls[hit]
    rows_max = _logits_max(*traces)
    return Located(k, True, step, name, rows_max, first, name, before, path, same, compared=compared,
                   profile=profile)


def _decoder(g: Golden, forward: str) -> str:
    """The forward that computes the decode rows ``forward``'s verify rows are held against: the golden's decode
    forward (`vd record --decode-forward`), as a replay's, else ``forward``."""
    return g.decode_forward or forward


def _set(model: VerifyModel, forward: str) -> VerifyModel:
    model.set_forward(forward)
    return model


def _decode_axis(model: VerifyModel, g: Golden, k: int, forward: str) -> Located:
    """``--between decode``: under ``forward``, the first verify row (in step order) whose decode row (the same
    tokens at the same positions, one-token decode: `vd.equivalence.decode_map`) differs from it, and the first
    module whose output differs between that row of the verify call and the decode call."""
    if not g.decoded:
        raise UsageError(f"{g.url} stores no decode rows (recorded before format 7): --between decode needs them")
    decoder = _decoder(g, forward)
    if decoder != forward:
        check_traceable(model, decoder, "--between decode")
    lay, dlay = g.layout(k), g.layout(DECODE_K)
    plain, dplain = _digests(_set(model, forward), g, k), _digests(_set(model, decoder), g, DECODE_K)
    mapping = decode_map(g.log(k), lay.prompt, g.log(DECODE_K).tokens[:, 0].tolist(), dlay.steps)
    at = np.flatnonzero(mapping >= 0)
    differ = (plain[lay.offset("verify") + at] != dplain[dlay.offset("verify") + mapping[at]]).any(1)
    if not differ.any():
        return Located(k, False, note=f"{at.size} verify rows have a decode row; all bit-identical")
    row = int(at[np.argmax(differ)])
    s, i, j = row // k, row % k, int(mapping[row])
    verify, ok_v = _traced(_set(model, forward), g, k, s + 1 + lay.drafted, plain, keep=True)
    decode, ok_d = _traced(_set(model, decoder), g, DECODE_K, j + 1, dplain, keep=True)
    mine = verify.traced[s + 1 + lay.drafted]
    one = Call(mine.points, rows=[r[i:i + 1] for r in mine.rows])
    first, before, path, compared, profile = _compare_rows(one, decode.traced[j + 1])
    rows_max = _logits_max(one, decode.traced[j + 1])
    name = f"step {s} row {i} (against decode step {j})"
    return Located(k, True, s, name, rows_max, first, name, before, path, ok_v and ok_d, compared=compared,
                   profile=profile)


def _against_golden(model: VerifyModel, g: Golden, k: int, forward: str, plain: np.ndarray) -> Located:
    calls = _calls(g.layout(k))
    differ = (plain != g.summary(k)[0]).any(1)
    hit = _first_call(g.layout(k), differ)
    if hit is None:
        if differ.any():  # only the draft head's rows: its modules are not traced
            return Located(k, True, note="only the draft head's rows differ; its modules are not traced")
        return Located(k, False)
    model.set_forward(forward)
    traced, reproduces = _traced(model, g, k, hit, plain, keep=False)
    gd, gs = g.trace(k)
    name, _, step = calls[hit]
    if not set(g.trace_points(k)) & set(traced.points()):
        return Located(k, True, step, name, reproduces=reproduces,
                       note="the rows differ, but the golden's traces and this run's share no traced point (another "
                            "adapter's points?): nothing to compare")
    found = _compare_golden(g.trace_points(k), gd, gs, traced, calls)
    if found is None:
        return Located(k, True, step, name, reproduces=reproduces,
                       note="the rows differ but no traced module's output does")
    at, first, before, path, compared, profile = found
    return Located(k, True, step, name, None, first, calls[at][0], before, path, reproduces,
                   compared=compared, profile=profile)


def _compare_golden(points: list[Point], gd: np.ndarray, gs: np.ndarray, traced: Traced, calls) -> tuple | None:
    """The first traced call (in order) where a point both traces hold differs from the golden's, and there the
    first such point, how many are identical before it, per layer the first, how many points are compared, and
    each compared point's |Δ max|x|| (0 where identical)."""
    common: list[tuple[int, int]] = []
    for c in sorted(traced.traced):
        index = {p: i for i, p in enumerate(traced.traced[c].points)}  # this call's own points
        common = [(j, index[p]) for j, p in enumerate(points) if p in index]
        d, s = traced.traced[c].arrays()
        rows = calls[c][1]
        first, before, path, profile = None, 0, [], []
        seen: set = set()
        for j, i in common:
            bad = np.flatnonzero((gd[rows, j] != d[:, i]).any(1))
            size = float(np.abs(gs[rows, j, 0] - s[:, i, 0]).max()) if bad.size else 0.0
            m = Module(*points[j])
            profile.append((m.name, m.what, m.layer, size))
            if not bad.size:
                before += first is None
                continue
            m = Module(points[j][0], points[j][1], None, (int(bad.size), len(rows)),
                       (float(gs[rows[bad], j, 0].max()), float(s[bad, i, 0].max())),
                       (float(gs[rows[bad], j, 1].max()), float(s[bad, i, 1].max())))
            first = first or m
            if m.layer not in seen:
                seen.add(m.layer)
                path.append(m)
        if first is not None:
            return c, first, before, tuple(path), len(common), tuple(profile)
    return None


def _logits_max(a: Call, b: Call) -> float | None:
    """The largest |Δ| between two kept calls' LM head outputs (their rows), None where one did not trace it."""
    x, y = (dict(zip(c.points, c.rows)).get(("lm_head", "LM head")) for c in (a, b))
    return None if x is None or y is None else (x.float() - y.float()).abs().max().item()


def _compare_rows(a: Call, b: Call) -> tuple[Module | None, int, tuple[Module, ...], int, tuple]:
    """Two forwards' kept outputs of one call: the first point both hold whose output differs, how many are
    identical before it, per layer the first one, how many points are compared, each one's max |Δ|."""
    index = {p: i for i, p in enumerate(b.points)}
    first, before, path, seen, profile, compared = None, 0, [], set(), [], 0
    for p, x in zip(a.points, a.rows):
        if p not in index:
            continue
        compared += 1
        y = b.rows[index[p]]
        same = x.shape == y.shape and torch.equal(x, y)
        size = 0.0 if same else (x.float() - y.float()).abs().max().item() if x.shape == y.shape else float("inf")
        m = Module(p[0], p[1], size, (int((x != y).any(-1).sum()) if x.shape == y.shape else x.shape[0], x.shape[0]))
        profile.append((m.name, m.what, m.layer, size))
        if same:
            before += first is None
            continue
        first = first or m
        if m.layer not in seen:
            seen.add(m.layer)
            path.append(m)
    return first, before, tuple(path), compared, tuple(profile)


def _model(g: Golden, spec: str | None, device: str | None, forwards: Sequence[str],
           allow_mismatch: bool = False, decoders: Sequence[str] = ()) -> VerifyModel:
    """The golden's model (or ``spec``), checked to trace each forward (and the decode rows' ``decoders``) and, as a
    replay checks it, to be the golden's (its vocabulary; its fingerprint unless ``allow_mismatch``)."""
    golden_spec, head = stored(g.meta["model"], golden_dir(g.location))
    forwards = list(dict.fromkeys(f for f in (*forwards, *decoders) if not axis(f)))
    check_forward_names(spec or golden_spec, forwards, device or g.info.device)  # before the model loads
    model = load_model(spec or golden_spec, device=check_device(device or g.info.device), dtype=g.logical,
                       head=head if spec is None else None)
    require_forwards(model, forwards)
    check_model(g, model, allow_mismatch)  # (another vocabulary crashed; another model's traces all differ)
    for f in forwards:
        check_traceable(model, f, "vd locate")
    return model


def check_locatable(g: Golden, between: str | None) -> None:
    """A golden ``vd locate`` can run on without ``--between``: one recorded with ``--trace``."""
    if between is None and not g.traced:
        raise untraced(g.url)


def locate(where: str | os.PathLike | Location, forward: str, between: str | None = None, *,
           model_spec: str | None = None, ks: Sequence[int] = (), device: str | None = None,
           model: VerifyModel | None = None, on_k: Callable[[Located], None] | None = None,
           allow_model_mismatch: bool = False) -> LocateReport:
    """``forward`` through the golden at ``where``, each K (or ``ks``), against the golden's module traces or
    against ``between``; see the module. The model loaded (not a ``model`` passed in) must be the golden's, as a
    replay's must (`vd.replayer.session.check_model`): another fingerprint only with ``allow_model_mismatch``."""
    require_model(model, "vd.replayer.locate.locate()")
    g = open_golden(where)
    try:
        check_locatable(g, between)
        widths = tuple(ks) or tuple(g.ks)
        bad = [k for k in widths if k not in g.ks]
        if bad:
            raise UsageError(f"{g.url} has no K={bad[0]} (it holds {', '.join(map(str, g.ks))})")
        forwards = (forward,) if between is None else (forward, between)
        decode = g.decoded and (g.traced_at(DECODE_K) if between is None else between.startswith(BATCH))
        widths = (DECODE_K, *widths) if decode else widths  # the decode rows first, whatever --k, as a replay
        g.check_files()  # every stored byte against the manifest: no verdict from a damaged golden
        decoders = (_decoder(g, forward),) if between is None and decode else ()
        m = model or _model(g, model_spec, device, forwards, allow_model_mismatch, decoders)
        out = []
        with torch.inference_mode():
            for k in widths:
                out.append(locate_k(m, g, k, decoders if k == DECODE_K and decoders else forwards))
                if on_k is not None:
                    on_k(out[-1])
        batch, decoder = g.meta.get("batch"), g.decode_forward
        runs_decode = decode or (len(forwards) == 2 and axis(forwards[1]))
        notes = (() if not batch else (f"{g.url} was recorded as one member of a batch of {batch['n']}; vd locate "
                                       "runs its sequence alone (vd replay runs it in that batch)",)) \
            + (() if not decoder or not runs_decode else
               (f"{g.url}'s decode rows are {decoder}'s (vd record --decode-forward): they are run with it",)) \
            + (() if between is not None or not g.decoded or decode else
               (f"{g.url} was traced before vd traced the decode rows: located at its K alone (vd record GOLDEN "
                "--refresh traces them)",))
        held = _decoder(g, forward) if between == DECODE else forward
        return LocateReport(g.url, forwards, tuple(out), notes, None if held == forward else held)
    finally:
        g.close()

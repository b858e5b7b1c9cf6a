"""One K of a replay (`replay_k`): every forward asked for runs the golden's steps through the shared loop and
is judged (`vd.replayer.judge`), then, under the last forward, the detection control, then the golden's own
checks at that K (thin, coverage). Before the K's, a golden's decode rows (`replay_decode`): each forward (or
``--decode-forward``) runs the greedy continuation's one-token decodes, judged against the golden's decode
rows, and keeps them, so that each K's verify rows are measured against the decode rows of the same positions
(`vd.equivalence`) as the run lets them go. Each returns its values; nothing is kept between K's but the
session and those decode rows.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vd import env, protocol
from vd.coverage import coverage_reason, thin_reason
from vd.dtypes import to_float, to_storage
from vd.equivalence import Accumulator, DecodeRows, Equivalence, FailingPair, KeptDecode, decode_map
from vd.layout import Step
from vd.loop import (
    DrafterFeed,
    Hold,
    ReplayFeed,
    Run,
    hold_bytes,
    mismatched_drafts,
    prepare,
    reference_accepts,
    run_verify,
)
from vd.protocol import VerifyModel
from vd.replayer import words
from vd.replayer.comparison import Comparison, Failure
from vd.replayer.judge import Queued, compare_run
from vd.replayer.measure import Measurer
from vd.replayer.report import BatchAxis, Control, EquivalenceAxis, FailureRows, Judged, KResult, Reason, Timing
from vd.replayer.session import OWN_EQUIVALENCE, Clock, Session
from vd.store.format import DECODE_K
from vd.store.side import GoldenSide


@dataclass(frozen=True, slots=True)
class KOutcome:
    """One K replayed: its result, the reasons it fails (in order: each forward's, the control's, the golden's
    own) and the rows of its first failing step, if a forward failed."""

    result: KResult
    reasons: tuple[Reason, ...]
    failure: FailureRows | None


@dataclass(frozen=True, slots=True)
class _Ran:
    """One run of a K's steps under the selected forward: its comparison, the run, the golden's side of that
    K and the candidate's rows of each kind's first failing step (`vd.replayer.measure.Measurer.kept`)."""

    comparison: Comparison
    run: Run
    side: GoldenSide
    kept: dict


def control_steps(steps: Sequence[Step], vocab: int) -> list[Step]:
    """The detection control's input: the last draft of step ``len(steps) // 2`` bumped by one."""
    changed = list(steps)
    at = len(steps) // 2
    tokens = list(changed[at].tokens)
    tokens[-1] = (tokens[-1] + 1) % vocab
    changed[at] = Step(tuple(tokens), changed[at].accepted)
    return changed


def replay_k(s: Session, k: int, decoded: Mapping[str, DecodeRows]) -> KOutcome:
    """Every forward at ``k`` (its verify rows measured against its own decode rows, ``decoded``, where the golden
    stores decode rows), then the control, then the golden's own checks at ``k``."""
    g = s.golden
    log = g.log(k)  # the metadata's copy; the arrays are read and checked beside the run
    judged: list[Judged] = []
    timings = [Timing(f"{g.info.forward} (golden)", tuple(log.step_ms.tolist()))]
    reasons: list[Reason] = []
    failure: FailureRows | None = None
    equivalent: list[tuple[str, Equivalence]] = []
    batches: list[BatchAxis] = []
    for name in s.forwards:
        s.progress.phase(f"K={k} {name}", g.info.steps)
        acc = _accumulator(s, k, decoded.get(name))
        ran = _forward(s, k, name, log.steps, None if acc is None else acc.observe)
        why = tuple(words.comparison_reasons(k, name, ran.comparison)) + _draft_tokens(k, name, ran.run)
        if acc is not None:
            equivalent.append((name, acc.result()))
            why += tuple(words.equivalence_reasons(k, name, equivalent[-1][1], s.policy))
        reasons += why
        judged.append(Judged(ran.comparison, why))
        timings.append(Timing(name, tuple(ran.run.step_ms)))
        if wanted(failure, 0) and not ran.comparison.passed:
            failure = first_of(failure, failure_rows(k, name, ran, protocol.decoder(s.model)))
        if failure is None and acc is not None and acc.acc.pair is not None:  # its verify rows against its decode's
            failure = pair_rows(s, k, name, log.steps, acc.acc.pair)
        if s.candidate is not None:
            s.candidate.keep(k, ran.run)
        if s.batch is not None:
            in_batch, batch_failure = batch_axis(s, k, name, log.steps)
            batches.append(in_batch)
            reasons += words.batch_reasons(k, f"verify K={k}", in_batch)
            failure = first_of(failure, batch_failure)
    control = _control(s, k, log.steps, judged[-1].comparison) if s.settings.control else None
    if control is not None and not control.fired and not control.inconclusive:
        reasons.append(words.control_reason(k, control.changed_step, s.policy))
    reasons += _own_checks(s, k, log.accepted.tolist())
    left = (g.meta.get("left_greedy") or {}).get(str(k))
    axis = _axis(s, k, equivalent)
    return KOutcome(KResult(k, tuple(log.accepted.tolist()), tuple(judged), tuple(timings), control, left, axis,
                            tuple(batches)), tuple(reasons), failure)


class _Observed:
    """A K run's verify rows handed to an equivalence `Accumulator` as the run lets them go."""

    def __init__(self, acc: Accumulator):
        self.acc = acc

    def observe(self, kind: str, start: int, rows: torch.Tensor) -> None:
        if kind == "verify":
            self.acc.add(start, rows)

    def result(self) -> Equivalence:
        return self.acc.result()


def _accumulator(s: Session, k: int, decode: DecodeRows | None) -> _Observed | None:
    """The equivalence of a forward's verify rows at ``k`` with its decode rows (None: no decode rows)."""
    if decode is None:
        return None
    g = s.golden
    greedy = g.log(DECODE_K).tokens[:, 0].tolist()
    mapping = decode_map(g.log(k), len(g.prompt), greedy, g.layout(DECODE_K).steps)
    return _Observed(Accumulator(k, mapping, decode, g.logical, s.policy.equivalence))


def _axis(s: Session, k: int, equivalent: list[tuple[str, Equivalence]]) -> EquivalenceAxis | None:
    """K's verify-against-decode axis: the golden's own (from its stored digests, rows read only where a pair
    differs) and each forward's; None where the golden stores no decode rows."""
    own = s.reader.value(k, OWN_EQUIVALENCE) if s.golden.decoded else None  # read with the golden (`set_up`)
    if not isinstance(own, Equivalence):
        return None
    return EquivalenceAxis(own, tuple(equivalent), s.settings.decode_forward)


def replay_decode(s: Session) -> tuple[KOutcome | None, dict[str, DecodeRows]]:
    """The golden's decode rows replayed: each forward (or ``--decode-forward``) runs the greedy continuation's
    one-token decodes (a run at K = 1), judged against the golden's decode rows; the rows each computed, kept
    for the K's equivalence axis. (None, {}) where the golden stores no decode rows."""
    g = s.golden
    if not g.decoded:
        return None, {}
    log = g.log(DECODE_K)
    judged: list[Judged] = []
    reasons: list[Reason] = []
    kept: dict[str, DecodeRows] = {}
    batches: list[BatchAxis] = []
    timings = [Timing(f"{g.info.forward} (golden)", tuple(log.step_ms.tolist()))]
    failure: FailureRows | None = None
    ran_by: dict[str, DecodeRows] = {}  # per decode forward: run once, whichever forwards it serves
    for name in s.forwards:
        decode_forward = s.settings.decoder(name)
        if decode_forward in ran_by:  # (--decode-forward F with several --forward: F's decode rows run once)
            kept[name] = ran_by[decode_forward]
            continue
        s.progress.phase(f"decode {decode_forward}", g.layout(DECODE_K).steps)
        rows = KeptDecode()
        ran = _forward(s, DECODE_K, decode_forward, log.steps, rows.observe)
        served = s.served_by(decode_forward)  # its rows serve them
        why = tuple(words.decode_reasons(", ".join(served), decode_forward, ran.comparison))
        reasons += why
        judged.append(Judged(ran.comparison, why))
        timings.append(Timing(decode_forward, tuple(ran.run.step_ms)))
        kept[name] = ran_by[decode_forward] = rows.result()
        if wanted(failure, DECODE_RANK) and not ran.comparison.passed:
            failure = failure_rows(DECODE_K, name, ran, protocol.decoder(s.model), decode_forward=decode_forward)
        if s.candidate is not None:
            s.candidate.keep(DECODE_K, ran.run)
        if s.batch is not None:
            in_batch, batch_failure = batch_axis(s, DECODE_K, decode_forward, log.steps, served=name)
            batches.append(in_batch)
            reasons += words.batch_reasons(DECODE_K, "decode rows", in_batch)
            failure = first_of(failure, batch_failure)
    result = KResult(DECODE_K, tuple(log.accepted.tolist()), tuple(judged), tuple(timings), None,
                     batch=tuple(batches))
    return KOutcome(result, tuple(reasons), failure), kept


def batch_axis(s: Session, k: int, name: str, steps: list[Step], served: str | None = None
               ) -> tuple[BatchAxis, FailureRows | None]:
    """Forward ``name``'s run of ``steps`` at ``k`` with the golden's sequence one member of the model's batch
    (``s.batch``, `vd.batch`), judged against the golden like any run; its time counted as the batch's. With
    the rows of its first failing step, where it fails (a first-divergence bundle's): decode rows as the ones
    forward ``served`` is measured against, computed with ``name``."""
    view = s.batch
    assert view is not None, "a batch axis is run only with --batch"
    t = time.perf_counter()
    s.model.set_forward(name)
    s.progress.phase(f"{'decode' if k == DECODE_K else f'K={k}'} {name} in a batch of {view.plan.n}",
                     s.golden.layout(k).steps)
    ran = _execute(s, k, steps, name, Clock(), model=view)
    s.clock.phases["batch"] += time.perf_counter() - t
    p = view.plan
    failure = None if ran.comparison.passed else failure_rows(
        k, served or name, ran, protocol.decoder(s.model), decode_forward=name if k == DECODE_K else None,
        batch=p.to_json())
    return BatchAxis(name, p.n, p.slot, p.seed, ran.comparison, tuple(view.slots), tuple(ran.run.step_ms)), failure


def _own_checks(s: Session, k: int, accepted: list[int]) -> list[Reason]:
    """The golden's own checks at ``k``: too thin, and (when asked) an accept count missing."""
    found = [("thin", thin_reason(k, accepted)),
             ("coverage", coverage_reason(k, accepted, None if s.golden.info.drafted_at(k) else reference_accepts(k))
              if s.settings.require_coverage else None)]
    return [Reason(what, text, k) for what, text in found if text is not None]


def _forward(s: Session, k: int, name: str, steps: list[Step],
             observe: Callable[[str, int, torch.Tensor], None] | None = None) -> _Ran:
    """Forward ``name`` selected and prepared (graphs captured, caches sized), then its run at ``k``."""
    t = time.perf_counter()
    s.model.set_forward(name)
    s.reader.pause()  # no reader work beside a graph capture
    g = s.golden
    # A reference replay decodes one token at a time only where the golden stores decode rows.
    prepare(s.model, len(g.prompt), g.info.steps, g.ks, decode=g.info.drafted or g.decoded)
    s.reader.ready()  # what is left of the golden's reading and hashing, before the run: none of it beside a step
    s.reader.check_files()  # a damaged file, named, before a run it would be judged by
    s.clock.phases["prepare"] += time.perf_counter() - t
    return _execute(s, k, steps, name, s.clock, keep=s.candidate is not None, observe=observe)


def _execute(s: Session, k: int, steps: list[Step], variant: str, clock: Clock, keep: bool = False,
             observe: Callable[[str, int, torch.Tensor], None] | None = None, model: VerifyModel | None = None
             ) -> _Ran:
    """One run of ``steps`` under the selected forward (of ``model``, default the session's runner: the model or
    the batch the golden was recorded in; a batch's view, `vd.batch.BatchView`) and its comparison, timed into
    ``clock``. Rows are
    measured as the run lets them go (`vd.loop.Hold`), so its memory stays flat in steps (a run whose
    candidate is kept, ``keep``, holds them all); on CUDA the comparison of the rows still held is queued
    behind the last step while it runs."""
    g, reader = s.golden, s.reader
    queued: list[Queued] = []
    model = model or s.runner
    on_last = ((lambda run, rows: queued.append(Queued(reader.side(k), run, rows)))
               if model.device.type == "cuda" else None)
    measurer = Measurer(lambda: reader.side(k), g.logical, s.policy, observe)
    hold = None if keep else Hold(hold_bytes(model.device), measurer.add)
    if s.clock.first_step is None:
        s.clock.first_step = env.process_age()
    t1 = time.perf_counter()
    log, n = g.log(k), g.layout(k).steps
    feed = ReplayFeed(steps, log.bootstrap, log.decoded)
    run = run_verify(model, g.prompt, k, n, DrafterFeed(k, n, feed) if g.info.drafted_at(k) else feed,
                     on_step=s.progress.step, on_last=on_last, hold=hold)
    t2 = time.perf_counter()
    side = reader.side(k)  # made before the run on CUDA (`Prefetcher.ready`)
    t3 = time.perf_counter()
    c = compare_run(variant, side, run, g.logical, s.policy, queued[0] if queued else None, measurer)
    for name, dt in (("run", t2 - t1), ("wait_golden", t3 - t2), ("compare", time.perf_counter() - t3)):
        clock.phases[name] += dt
    return _Ran(c, run, side, measurer.kept)


def _control(s: Session, k: int, steps: list[Step], own: Comparison) -> Control:
    """The detection control under the last forward (still selected; ``own``: its comparison): it must fail at
    the very step whose draft changed, under the active policy or by a changed decision, where that forward's
    own run did not. Where its own run fails there already, it is inconclusive: a replay that differs
    everywhere does not show it would see a change (and fails anyway)."""
    t = time.perf_counter()
    s.progress.phase(f"K={k} control", s.golden.info.steps)
    ran = _execute(s, k, control_steps(steps, s.model.vocab_size), f"{s.forwards[-1]}, one draft changed",
                   Clock())  # counted as the control's time alone
    at = s.golden.info.steps // 2
    inconclusive = at in own.failed_step_list
    fired = at in ran.comparison.failed_step_list and not inconclusive
    s.clock.phases["control"] += time.perf_counter() - t
    return Control(ran.comparison, at, fired, inconclusive)


def _draft_tokens(k: int, name: str, run: Run) -> tuple[Reason, ...]:
    """The reason a run's draft head proposed tokens its own draft rows do not imply, if it did."""
    bad = mismatched_drafts(run)
    if not bad:
        return ()
    s, implied = bad[0]
    return (words.draft_token_reason(k, name, [b for b, _ in bad], len(run.drafts), list(run.drafts[s]), implied),)


def pair_rows(s: Session, k: int, name: str, steps: Sequence[Step], pair: FailingPair) -> FailureRows:
    """A first-divergence bundle's rows for a forward whose verify rows fail the policy's ``equivalence=`` (its
    rows matched the golden's): the first failing verify row as ``candidate``, and as ``golden`` the decode row of
    the same position it is judged against (``--decode-forward``'s, else the forward's own)."""
    at, spec = pair.place, s.policy.equivalence
    differ = np.flatnonzero(pair.verify != pair.decode)
    i = int(differ[0]) if differ.size else None
    v, d = (to_float(a, s.golden.logical) for a in (pair.verify, pair.decode))
    first = Failure("equivalence", at.step, at.row, i, math.nan if i is None else float(d[i]),
                    math.nan if i is None else float(v[i]), spec.text if spec is not None else "?", pair.flipped)
    tokens = list(steps[at.step].tokens)
    decoder = protocol.decoder(s.model)
    return FailureRows(k=k, forward=name, kind="equivalence", step=at.step, golden=pair.decode[None],
                       candidate=pair.verify[None], tokens=tokens, first_failure=first,
                       text=None if decoder is None else decoder.decode(tokens),
                       decode_forward=s.settings.decoder(name))


# Which failure a first-divergence bundle shows, by its `FailureRows.axis` (the first here, then the first found):
# the golden's rows differing at a K, then its decode rows, then rows in a batch, then a verify row failing the
# policy's equivalence= against its decode row: a regression before a property the golden may well share.
_SHOWN_FIRST = ("rows", "decode", "batch", "equivalence")
DECODE_RANK = _SHOWN_FIRST.index("decode")


def rank(f: FailureRows) -> int:
    """Where ``f`` stands in `_SHOWN_FIRST`."""
    return _SHOWN_FIRST.index(f.axis)


def wanted(found: FailureRows | None, r: int) -> bool:
    """Whether a failure of rank ``r`` would be shown before ``found``."""
    return found is None or rank(found) > r


def first_of(*found: FailureRows | None) -> FailureRows | None:
    """The failure among ``found`` a bundle shows (`rank`)."""
    return min((f for f in found if f is not None), key=rank, default=None)


def failure_rows(k: int, name: str, ran: _Ran, decoder: protocol.TokenDecoder | None = None, *,
                 decode_forward: str | None = None, batch: dict | None = None) -> FailureRows | None:
    """The golden's and the candidate's rows of the first failing step (for a first-divergence bundle); where
    they were computed beside ``k`` and forward ``name`` (`FailureRows`)."""
    c, side = ran.comparison, ran.side
    f = c.first_failure
    if f is not None:
        kind, step = f.kind, f.step
    elif c.changed_accepts:  # a changed accept count alone: keep its step's verify rows
        kind, step = "verify", c.changed_accepts[0].step
    else:
        return None
    if kind not in ran.kept or ran.kept[kind][0] != step:
        return None
    idx = side.layout.step_rows(kind, step)
    tokens = side.tokens[step].tolist() if step is not None else None
    return FailureRows(k=k, forward=name, kind=kind, step=step,
                       golden=side.host_rows(kind, idx) if side.has_rows else None,
                       candidate=to_storage(ran.kept[kind][1]), tokens=tokens, first_failure=f,
                       text=None if decoder is None or tokens is None else decoder.decode(tokens),
                       decode_forward=decode_forward, batch=batch)

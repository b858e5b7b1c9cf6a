"""Replay a golden against a model and judge it (`replay`): a `vd.replayer.report.Report`, PASS or FAIL with
reasons.

A replay is a pipeline of steps that return values: the golden opened and checked against the settings,
the model set up and checked against the golden (`vd.replayer.session`), then each K replayed
(`vd.replayer.runs`): for each forward asked for, the shared loop runs the replay feed (the stored tokens,
accept counts and bootstrap token, so every run verifies the same inputs and commits the same prefixes) and
every row is judged against the golden under the policy (byte for byte unless the golden or the caller says
otherwise), every decision checked (`vd.replayer.judge`). A drafter golden replays with the model's MTP head
still running, so its drafts and draft logits are judged too. Then, under the last forward, the detection
control changes the last draft of step ``steps // 2`` and must fail there under the same policy; a
reference without both a full and a partial accept at every K fails as too thin (and, if asked, one
missing an accept count). The report is built last (`report_of`). This module leaves out wording
(`vd.replayer.words`) and rendering (`vd.replayer.render`); the command line prints.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Sequence

import torch

from vd import env, protocol, warm
from vd.errors import GoldenError
from vd.models.specs import golden_dir, names_stored
from vd.policy import Policy, sensitivity
from vd.progress import SILENT, Progress
from vd.protocol import VerifyModel, require_model
from vd.replayer import words
from vd.replayer.locate import LocateReport, locate_k
from vd.replayer.report import (
    Determinism,
    Environments,
    KResult,
    ModelFacts,
    Reason,
    Report,
    RowsSource,
    Seconds,
    Sensitivity,
    Variant,
)
from vd.replayer.runs import KOutcome, control_steps, first_of, replay_decode, replay_k
from vd.replayer.session import (
    PHASES,
    Clock,
    Opened,
    ReplaySettings,
    Session,
    model_to_load,
    open_for_replay,
    open_golden_for,
    set_up,
)
from vd.store import Location
from vd.store.format import DECODE_K

__all__ = ["PHASES", "ReplaySettings", "control_steps", "open_for_replay", "replay"]


def replay(golden: str | os.PathLike | Location | Opened, settings: ReplaySettings = ReplaySettings(), *,
           model: VerifyModel | None = None, progress: Progress = SILENT) -> Report:
    """Replay the golden at ``golden`` (a directory, a ``.zip`` file or an ``s3://`` URL, or one opened and being
    read already by `open_for_replay` with the same settings) and judge it.

    Bad input (a missing or damaged golden, an unknown model or forward, a fingerprint mismatch, a policy a
    slim golden cannot judge) raises a `vd.errors.VdError` before any comparison.
    """
    require_model(model, "vd.replayer.replay()")
    clock = Clock()
    opened = golden if isinstance(golden, Opened) else clock.timed("open", lambda: open_golden_for(golden, settings))
    try:
        s = set_up(opened, settings, model, progress, clock)  # (a refusal there stops the golden's reader)
    except BaseException:
        opened.golden.close()
        raise
    try:
        decode, decoded = replay_decode(s)  # first: each K's verify rows are measured against these
        outcomes = [replay_k(s, k, decoded) for k in s.ks]
        s.reader.check_files()  # no damaged golden reaches a verdict
        notes = _save_candidate(s, outcomes)
        located = _located(s, outcomes, decode) if s.settings.locate and s.golden.traced else ()
        return dataclasses.replace(report_of(s, outcomes, notes, decode), located=located)
    except GoldenError:
        s.reader.check_files()  # a damaged file, named, before whatever it broke
        raise
    finally:
        if s.candidate is not None:
            s.candidate.abort()
        s.golden.close()  # a refresh in this process may then remove the version replayed


def _located(s: Session, outcomes: Sequence[KOutcome], decode: KOutcome | None) -> tuple[LocateReport, ...]:
    """``--locate``: the first module whose output differs from the golden's traces (`vd.replayer.locate`), per
    forward at each K where its rows are not the golden's bit for bit, and per decode forward at the decode rows
    where its are not (a golden whose decode rows were traced), first: with the forward's own report where it
    computed them, else in a report of its own."""
    out, decoders = [], _decode_located(s, decode)
    for name in s.forwards:
        differ = [o.result.k for o in outcomes for j in o.result.comparisons
                  if j.comparison.variant == name and not j.comparison.equal]
        own = decoders.pop(name, None)
        if differ:
            s.progress.phase(f"locating {name}", 0)
            with torch.inference_mode():
                ks = tuple(locate_k(s.model, s.golden, k, (name,)) for k in differ)
            out.append(LocateReport(s.golden.url, (name,), ks) if own is None else
                       dataclasses.replace(own, ks=own.ks + ks))
        elif own is not None:
            out.append(own)
    return (*decoders.values(), *out)


def _decode_located(s: Session, decode: KOutcome | None) -> dict[str, LocateReport]:
    """Per decode forward whose decode rows differ: where they part from the golden's traces (or, for a golden
    traced before its decode rows were, a note that they are not located)."""
    out: dict[str, LocateReport] = {}
    for j in () if decode is None else decode.result.comparisons:
        decoder = j.comparison.variant
        if j.comparison.equal or decoder in out:
            continue
        served = s.served_by(decoder)
        why = "the golden's decode forward" if decoder == s.golden.decode_forward else "--decode-forward"
        notes = () if served == [decoder] else (
            f"the decode rows {decoder} computes for {', '.join(served)}'s verify rows ({why})",)
        if not s.golden.traced_at(DECODE_K):
            out[decoder] = LocateReport(s.golden.url, (decoder,), (), notes + (
                f"its decode rows differ, but {s.golden.url} was traced before vd traced the decode rows: they are "
                "not located (vd record GOLDEN --refresh traces them)",))
            continue
        s.progress.phase(f"locating {decoder}'s decode rows", 0)
        with torch.inference_mode():
            out[decoder] = LocateReport(s.golden.url, (decoder,), (locate_k(s.model, s.golden, DECODE_K, (decoder,)),),
                                        notes)
    return out


def _save_candidate(s: Session, outcomes: Sequence[KOutcome]) -> list[str]:
    """Publish the kept candidate, with each K's control result (`vd.replayer.candidate`); its note."""
    if s.candidate is None:
        return []
    t = time.perf_counter()
    controls = {o.result.k: o.result.control is not None and o.result.control.fired for o in outcomes}
    inconclusive = [o.result.k for o in outcomes if o.result.control is not None and o.result.control.inconclusive]
    failed = any(o.reasons for o in outcomes)
    s.candidate.publish(s.model, s.settings.model or s.golden.meta["model"]["spec"], s.forwards[0], controls,
                        "FAIL" if failed else "PASS", inconclusive, s.settings.decode_forward)
    s.clock.phases["write"] += time.perf_counter() - t
    return [f"candidate saved: {s.candidate.url} (review with vd diff, promote with vd refresh --from)"]


def report_of(s: Session, outcomes: Sequence[KOutcome], notes: Sequence[str], decode: KOutcome | None = None
              ) -> Report:
    """The replay's report: the decode rows' and every K's result and reasons, the environment's differences
    where rows fail."""
    t = time.perf_counter()
    g, model, verify = s.golden, s.model, [o.result for o in outcomes]
    replayed_env = env.of_model(model)
    graphed = [protocol.uses_graphs(model, n) for n in s.forwards]
    reasons = ([] if decode is None else list(decode.reasons)) + [r for o in outcomes for r in o.reasons]
    reasons += _environment_reasons(s, replayed_env, verify)
    m = g.meta["model"]
    source = g.rows_source
    finish = time.perf_counter() - t
    return Report(
        golden=g.url,
        model=ModelFacts(m["spec"], m.get("name"), m["fingerprint"], model.identity().name, _replayed_spec(s),
                         s.settings.allow_model_mismatch, *model_to_load(g, s.settings)),
        graphs="graphed" if all(graphed) else "eager" if not any(graphed) else "mixed",
        mtp=g.info.drafted, head=g.meta.get("mtp"), feed=g.info.feed, steps=g.info.steps, dtype=g.logical,
        variants=tuple(Variant(n, s.offered[n], n == g.info.forward, "graphed" if gr else "eager")
                       for n, gr in zip(s.forwards, graphed)),
        determinism=Determinism(g.meta.get("determinism"), s.determinism, env.determinism()),
        golden_forward=g.info.forward, policy=s.policy, sensitivity=_sensitivity(s.policy, g.logical, verify),
        require_coverage=s.settings.require_coverage, verify=tuple(verify), reasons=tuple(reasons),
        notes=s.notes + tuple(notes),
        environment=Environments(s.recorded_env, replayed_env,
                                 tuple(env.numerics_differences(dict(s.recorded_env), replayed_env))),
        rows=RowsSource(g.slim, None if source is None else source.url),
        seconds=sum(s.clock.phases[n] for n in PHASES if n not in ("open", "load", "setup", "write")),
        phases={**s.clock.phases, "finish": finish}, timing=_timing_of(s.clock, finish),
        reader=s.reader.summary(),
        failure_rows=first_of(*(o.failure for o in [*outcomes, *([decode] if decode else [])])),
        decode=None if decode is None else decode.result,
        batch=None if s.batch is None else s.batch.describe(),
        golden_batch=None if s.recorded_batch is None else s.recorded_batch.describe(),
        candidate=None if s.candidate is None else s.candidate.url,
        golden_decode_forward=g.decode_forward)


def _replayed_spec(s: Session) -> str | None:
    """``--model`` where it is not the golden's own model SPEC: neither as stored nor naming the same file (the
    absolute path a command replaying a failure passes for a spec stored relative to its project)."""
    asked, g = s.settings.model, s.golden
    return None if asked is None or names_stored(asked, g.meta["model"], golden_dir(g.location)) else asked


def _environment_reasons(s: Session, replayed_env: dict, verify: Sequence[KResult]) -> list[Reason]:
    """Where rows fail and the environment's numerics differ from the recording's, a reason saying so."""
    recorded = dict(s.recorded_env)
    differences = env.numerics_differences(recorded, replayed_env)
    if not differences or all(j.comparison.passed for v in verify for j in v.comparisons):
        return []
    return [words.environment_reason(differences, env.same_kernels_hint(recorded, replayed_env))]


def _timing_of(clock: Clock, finish: float) -> Seconds:
    p = clock.phases
    return Seconds(first_step=clock.first_step, open=p["open"], load=p["load"], setup=p["setup"],
                   prepare=p["prepare"], run=p["run"], control=p["control"], compare=p["compare"] + p["wait_golden"],
                   write=p["write"] + finish, started=clock.started, model_code=clock.within.get("model_code", 0.0),
                   fingerprint=clock.within.get("fingerprint", 0.0), warm=warm.forked())


def _sensitivity(policy: Policy, logical: str, verify: Sequence[KResult]) -> dict[str, Sensitivity]:
    """Per kind: the smallest change the active policy is guaranteed to catch, from the golden's rows."""
    out = {}
    for kind in ("prefill", "verify", "draft"):
        stats = [j.comparison.summary[kind] for v in verify for j in v.comparisons if kind in j.comparison.summary]
        if not stats:
            continue
        agg = {"max_abs": max(x.golden_max_abs for x in stats), "min_margin": min(x.golden_min_margin for x in stats),
               "median_top1_p": statistics.median(x.golden_median_top1_p for x in stats)}
        out[kind] = Sensitivity(policy[kind].text, sensitivity(policy[kind], logical, agg, policy.margin), **agg)
    return out

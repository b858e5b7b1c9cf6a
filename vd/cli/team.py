"""The commands of a team's workflow (`vd.workflow`): the suite behind ``vd record --suite`` and ``vd replay
--suite``, and ``vd refresh``, ``vd history`` and ``vd status``. A suite is declared in ``vd.toml`` or under
``[tool.vd]`` in ``pyproject.toml`` (found from the working directory, or named with ``--config``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from vd.cli import options as opt
from vd.cli import ranks
from vd.cli.common import (
    CONFIG_HELP,
    EXIT_FAIL,
    EXIT_PASS,
    Command,
    app,
    check_distinct,
    check_no_golden,
    check_writable,
    err,
    examples,
    golden_path,
    note_journal,
    out,
    reading_environment,
    reporting,
    resumable,
    write_json,
)
from vd.errors import GoldenError, Terminated, UsageError
from vd.outputs import check_bundle_place, write_text
from vd.preflight import recovered
from vd.workflow.declare import check_pin_writable, check_recordable, declared, entry_for, recording_refusal


def _suite(config: Path | None):
    from vd.workflow.declare import load_suite

    return load_suite(config)


def record_entry(target: str, config: Path | None):
    """The declared golden a recording of one golden names (`vd.workflow.declare.declared`), whose declared
    settings it records, changed by the flags given; with ``config``, one that file must declare (else a usage
    error naming the declared goldens)."""
    entry = declared(target, config)
    if entry is None and config is not None:
        suite = _suite(config)
        raise UsageError(f"{target}: {suite.file} declares no golden of that name or path (it declares "
                         f"{', '.join(suite.entries) or 'none'}); leave --config out to record from the flags alone")
    return entry


# -- record and replay a suite (called by `vd record --suite`, `vd replay --suite`) ------------------------
def record_suite(names: list[str], config: Path | None, refresh: bool, reason: str | None,
                 summary: Path | None) -> int:
    """Record the named (or all) goldens of the suite: missing ones, and with ``refresh`` existing ones."""
    if refresh and not reason:
        raise UsageError("--refresh of a suite needs --reason TEXT: it goes into each golden's history")
    entries = _suite(config).select(names)  # the declaration, checked before anything heavy is imported
    check_writable("--summary", summary, [e.path for e in entries])
    for e in entries:  # a declared golden inside another is never written (itself: --refresh's to replace)
        check_no_golden(e.name, e.path, replace=True)
        check_pin_writable(e)  # (before anything is published: a pin it could not write)
        check_recordable(e)
    from vd.replayer import words
    from vd.store import locate
    from vd.workflow.suite import Models, exit_code, record_key
    from vd.workflow.suite import record_suite as do_record

    models, outcomes = Models([record_key(e) for e in entries]), []  # each model let go after its last golden
    with reporting() as progress:
        for e in entries:  # each golden's pin set and its line printed as it is published: a suite cut short
            if locate(e.path).state() != "golden":  # recorded afresh: a cut-short one's journal is replaced
                note_journal(e.path)
            with resumable(e.path), published_if_cut_short(e, e.path):  # Ctrl-C, a CI timeout: said, pinned
                [o] = do_record([e], refresh_existing=refresh, reason=reason or "first recording", models=models,
                                progress=progress)
            progress.end(failed=o.verdict == "ERROR")  # its last phase's line before the golden's own
            for line in words.outcome_lines(o.name, o.verdict, o.path, o.seconds,
                                            o.reasons or ([o.error] if o.error else [])):
                out.print(line)
            if o.verdict in ("RECORDED", "REFRESHED"):  # (said after the golden's line: its pin, under it)
                repin(e, e.path)
            outcomes.append(o)
    if summary is not None:
        write_text(summary, words.record_summary(reason, [(o.name, o.verdict, o.reasons or [o.error or ""],
                                                          o.changes) for o in outcomes]))
    return exit_code(outcomes)


def replay_suite(names: list[str], config: Path | None, asked: dict, shard: str | None, report: Path | None,
                 junit: Path | None, html: Path | None, bundle: Path | None) -> int:
    """Replay the named (or all) goldens of the suite, or shard I/N of them; one verdict for all. ``asked``:
    the `vd.replayer.ReplaySettings` fields the flags give."""
    import time

    from vd.workflow.declare import shard as take

    suite = _suite(config)  # the declaration and the shard, checked before anything heavy is imported
    selected = suite.select(names)
    entries = take(selected, shard)
    outputs = {"--report": report, "--junit": junit, "--html": html, "--bundle": bundle}
    check_distinct(outputs)
    for flag, path in outputs.items():
        check_writable(flag, path, [e.path for e in entries], directory=flag == "--bundle")
    _check_bundle_places(bundle, [e.name for e in entries], outputs, [e.path for e in entries])
    from vd.replayer import ReplaySettings, render, words
    from vd.workflow.suite import Models, SuiteReport, for_entry, replay_plan
    from vd.workflow.suite import replay_suite as do_replay

    settings = ReplaySettings(**asked)
    models, outcomes, t = Models(replay_plan(entries, settings)), [], time.perf_counter()
    with reporting() as progress, reading_environment() as environ:  # (what bundles' command.sh sets again)
        for e in entries:
            outcomes += do_replay([e], for_entry(settings, e), models=models, progress=progress)
            progress.end(failed=outcomes[-1].verdict == "ERROR")  # (a golden that could not be replayed)
    done = SuiteReport(str(suite.file), shard, models.loads, time.perf_counter() - t, tuple(outcomes))
    if report is not None:
        write_json(report, done.to_json())
    listed = [(o.name, o.report, o.error) for o in outcomes]
    if junit is not None:
        render.write_suite_junit(junit, listed)
    bundles: dict[str, str] = {}
    for o in outcomes:
        if bundle is not None:
            render.clear_bundle(bundle / o.name)  # an earlier suite replay's
        if bundle is not None and o.report is not None and o.report.failure_rows is not None:
            bundles[o.name] = str(render.write_bundle(bundle / o.name, o.report, _bundle_args(settings),
                                                      environ).parent)
    if html is not None:  # (after the bundles: each golden's next step names its own)
        render.write_suite_html(html, listed, command=["vd", *sys.argv[1:]], bundles=bundles)
    _print_outcomes(outcomes, done)
    out.print(words.suite_total(done.verdict, [o.verdict for o in outcomes], models.loads, shard, len(selected)),
              style="bold")
    _print_next_steps(outcomes, bundles, entries)
    return done.code


def _print_outcomes(outcomes, done) -> None:
    """Each golden's verdict and reasons, and where its forwards part from its traces (``--locate``)."""
    from vd.cli.locate import reports_lines
    from vd.replayer import words

    for o in outcomes:
        for line in words.outcome_lines(o.name, o.verdict, o.path, o.seconds, done.details(o), bullet="- "):
            out.print(line)
        for line in reports_lines(() if o.report is None else o.report.located):
            out.print(f"    {line}")


def _print_next_steps(outcomes, bundles: dict[str, str], entries) -> None:
    """What to do about each golden of a suite replay that failed, or is not there (`pytest --vd` says the same):
    record it, or, where `vd record` would refuse its declaration here, why."""
    from vd.replayer import words

    for o, e in zip(outcomes, entries, strict=True):
        lines = [] if o.report is None else words.next_lines(o.report, o.name, bundles.get(o.name))
        if o.report is None and "://" not in o.path and not os.path.lexists(o.path):
            why = recording_refusal(e)
            lines = ["next step:", f"  - record it: vd record --suite {o.name}" if why is None else
                     f"  - change its declaration: {why}"]
        for line in lines:
            out.print(f"{o.name}: {line}" if line == "next step:" else line)


def _check_bundle_places(bundle: Path | None, names: list[str], outputs: dict, goldens: list[str]) -> None:
    """Each golden's bundle place, a folder of its name in ``bundle``: neither a golden nor inside one (``DIR``
    holding golden ``NAME`` at ``DIR/NAME``: its bundle went into that golden), and as `vd.outputs.check_bundle_place`
    asks."""
    for place in [bundle / name for name in names] if bundle is not None else []:
        check_writable("--bundle", place, goldens, directory=True)
        why = check_bundle_place(f"--bundle {place}", place, {**outputs, "--bundle": None})
        if why is not None:
            raise UsageError(why)


def _bundle_args(settings) -> dict:
    """What a suite golden's command.sh passes again: the model, head, device and threads the suite asked for."""
    return {"model": settings.model, "head": settings.head, "device": settings.device, "threads": settings.threads,
            "allow_model_mismatch": settings.allow_model_mismatch}


# -- refresh, history, status -------------------------------------------------------------------------------
def refresh_golden(target: str, config: Path | None, reason: str, summary: Path | None, overrides: dict,
                   candidate: str | None = None, allow_slim: bool = False) -> int:
    """Refresh the golden ``target`` names: its declaration's settings (or, undeclared, the golden's own) with
    ``overrides``; or promote ``candidate`` (a slim one over a full golden only with ``allow_slim``). Prints
    the change summary; exit 1 when refused."""
    if allow_slim and candidate is None:
        raise UsageError("vd refresh: --allow-slim goes with --from CANDIDATE")

    entry = entry_for(target, config)
    path = _existing(target, entry, config)
    check_writable("--summary", summary, (path, candidate))
    check_pin_writable(entry)
    _check_not_slim(path, candidate)
    from vd.workflow import refresh as R

    name = entry.name if entry is not None else None
    with published_if_cut_short(entry, path):
        if candidate is not None:
            done = R.promote(candidate, path, reason=reason, name=name, allow_slim=allow_slim)
        else:
            with reporting() as progress:
                done = R.refresh(path, settings_for(path, entry, overrides), reason=reason, name=name,
                                 progress=progress)
    if done.refused:
        for why in done.refused:
            err.print(f"vd: {why}")
        err.print(f"vd: refresh refused; {done.url} is unchanged")
        return EXIT_FAIL
    for warning in done.warnings:
        err.print(f"vd: warning: {warning}")
    out.print(done.summary, end="")
    if summary is not None:
        write_text(summary, done.summary)
    out.print(f"refreshed {done.url} to version {done.version}")
    repin(entry, path)
    note_stale(entry)
    return EXIT_PASS


def _check_not_slim(path: str, candidate: str | None) -> None:
    """A refresh of a slim golden, or a full candidate's promotion over it, refused before torch is imported (from
    the root metadata of both; the refresh itself checks again, for what a local read cannot see: S3)."""
    from vd import preflight

    seen = preflight.peek(path)
    if seen.state != "golden" or seen.meta is None:
        return
    if candidate is not None:
        cand = preflight.peek(candidate)
        if cand.state != "golden" or cand.meta is None or not preflight.stored_rows(cand.meta):
            return  # a slim candidate over a slim golden is no refusal of this kind; anything else, the refresh's
    refusal = preflight.slim_refusal(path, seen.meta, candidate)
    if refusal is not None:
        raise refusal


def note_stale(entry) -> None:
    """A golden just recorded or refreshed that flags took away from its declaration: said on stderr, since
    `vd status` and a suite replay will call it stale until the declaration says the same."""
    if entry is None:
        return
    from vd.workflow.suite import stale_now

    stale = stale_now(entry)
    if stale:
        err.print(f"vd: note: {entry.name} now differs from its declaration ({'; '.join(stale)}); vd status and "
                  "vd replay --suite call it stale until the declaration says the same")


def repin(entry, path: str) -> None:
    """A refreshed golden whose declaration pins it: the pin set to its new content digest in the declaration
    file, so the change is in the same review as the golden's (`vd.workflow.declare.repin`), and said."""
    from vd.workflow.declare import repin as write_pin

    digest = write_pin(entry, path)
    if digest is not None:
        out.print(f"pin of {entry.name} in {entry.file}: {digest}")


@contextlib.contextmanager
def published_if_cut_short(entry, path: str):
    """Around a recording or refresh of the golden at ``path``: cut short (Ctrl-C, a signal) after it published
    its new version (or left it complete beside its path, which the next reader puts in place), the line the
    interruption prints says so, with where its history shows it, since the command printed nothing of it; and
    a declared pin is written all the same, so no published golden is refused by its own pin. Only a version
    this command published counts: the golden's version or content digest must have moved from what they were
    when it began (read from its root metadata)."""
    if "://" in path:
        yield
        return
    before = _version(path)
    try:
        yield
    except (KeyboardInterrupt, Terminated) as e:
        with contextlib.suppress(Exception):  # (the interruption is what the command reports)
            recovered(path)
            after = _version(path)
            if after is not None and after != before:
                e.add_note(f"{path} was published before it (version {after[0]}: vd history {shlex.quote(path)})")
                if before is None or after[1] != before[1]:  # (its content moved: `repin` writes a pinned one's)
                    repin(entry, path)
        raise


def _version(path: str) -> tuple[int, str | None] | None:
    """The version (its history's length) and content digest of the golden at ``path``, from its root metadata;
    None where it holds none."""
    from vd.preflight import peek

    seen = peek(path)
    if seen.state != "golden" or seen.meta is None:
        return None
    return len(seen.meta.get("history") or ()), seen.meta.get("content_digest")


def _next_beside(path: Path) -> bool:
    """Whether a publish cut short left a complete version of ``path`` beside it (``.NAME.next-*``, which a reader
    puts in place: `vd.store.atomic.recover`)."""
    try:
        return any(n.startswith(f".{path.name}.next-") for n in os.listdir(path.parent))
    except OSError:
        return False


def _existing(target: str, entry, config: Path | None) -> str:
    """The golden ``target`` names (a declared golden, else a path or URL), which must exist: a refresh never
    records a new golden (`vd record` does); else a usage error naming the declared goldens."""
    from vd import preflight
    from vd.workflow.declare import find, load_suite

    path = entry.path if entry is not None else target
    state = preflight.peek(path).state
    if state not in ("absent", "remote"):  # a local path that holds something: torch not imported
        return path
    cut_short = state == "absent" and _next_beside(Path(path))
    if state == "remote" or cut_short:
        from vd.store import locate

        if locate(path).state() != "absent":  # (an object store asked; a publish cut short installed)
            return path
    if entry is not None:
        raise UsageError(f"vd refresh: {entry.name!r} is declared but not recorded yet ({path} does not exist); "
                         f"record it with vd record --suite {entry.name}")
    declared = ""
    if config is not None or find() is not None:
        suite = load_suite(config)
        declared = f"; {suite.file} declares {', '.join(suite.entries) or 'none'}"
    raise UsageError(f"vd refresh: {target!r} is neither a declared golden nor a golden on disk{declared} "
                     "(a new golden is recorded with vd record)")


def settings_for(path: str, entry, overrides: dict):
    """What a refresh records: the declaration's settings, or the golden's own, with ``overrides``."""
    from vd.recorder import RecordSettings
    from vd.store import locate, open_golden
    from vd.workflow.suite import record_settings

    if entry is not None:
        base = record_settings(entry)
    elif locate(path).state() == "golden":
        # (its root metadata alone: a damaged golden is refreshed as its declared one is, `vd.workflow.refresh`)
        try:
            base = RecordSettings.of_golden(open_golden(path, sizes=False, volatile=False).meta)
        except GoldenError as e:  # an undeclared golden's settings are its metadata's: none to refresh it with
            raise type(e)(f"{e}; an undeclared golden is refreshed with the settings its metadata holds, so this "
                          "one cannot be: restore it (version control, a copy), or remove it and record it afresh "
                          f"(vd record {shlex.quote(path)} with the flags that made it)") from e
    else:
        base = RecordSettings()
    merged = dataclasses.replace(base, **overrides)
    try:
        merged.check()
    except UsageError as e:  # a flag at odds with a setting the refresh keeps, which the user never typed
        default = RecordSettings()
        kept = [name for name in _KEPT_NAMED if name not in overrides and getattr(base, name) != getattr(default, name)
                and _passes(dataclasses.replace(merged, **{name: getattr(default, name)}))]  # the ones at odds
        if overrides and kept:
            whose = "its declaration's" if entry is not None else "the golden's own"
            raise UsageError(f"{e} (a refresh keeps {whose} settings the flags given do not change: "
                             + ", ".join(f"{name} {getattr(base, name)}" for name in kept) + "; "
                             + ", ".join(_KEPT_NAMED[name] for name in kept) + " changes it)") from None
        raise
    return merged


def _passes(settings) -> bool:
    try:
        settings.check()
    except UsageError:
        return False
    return True


# Settings a refresh keeps that can be at odds with a flag given (`settings_for` names them when they are).
_KEPT_NAMED = {"trace": "--no-trace", "batch": "--batch N (or --no-batch)", "slot": "--slot I",
               "batch_seed": "--batch-seed S", "feed": "--feed", "head": "--head FILE"}


@app.command(cls=Command, epilog=examples(
    'vd refresh smollm2-default --reason "fused attention kernel, reviewed in #123" --summary changes.md',
    'vd refresh goldens/smollm2.zarr --from candidate.zarr --reason "accept the SDPA numbers"'))
@ranks.tensor_parallel
def refresh(
    target: Annotated[str, typer.Argument(metavar="NAME|GOLDEN", help="A declared golden's name, or a golden.")],
    reason: Annotated[str, typer.Option(metavar="TEXT", help="Why the golden changes (kept in its history).")],
    from_: Annotated[str | None, typer.Option("--from", metavar="CANDIDATE", help="Promote this candidate (saved "
                                              "by vd replay --save-candidate) instead of recording.")] = None,
    summary: Annotated[Path | None, typer.Option(metavar="PATH", help="Write the change summary (Markdown) "
                                                 "here.")] = None,
    config: Annotated[Path | None, typer.Option(metavar="FILE", help=CONFIG_HELP)] = None,
    allow_slim: Annotated[bool, typer.Option("--allow-slim", help="With --from: promote a slim candidate over "
                                             "a full golden, dropping its rows.")] = False,
    tp: opt.Tp = None,  # (taken by ranks.tensor_parallel)
) -> int:
    """Re-record a golden (or promote a candidate) with a reason and a change summary.

    It records what the golden's declaration says (or, undeclared, what recorded it), replays the new
    recording once, and publishes it with its history; refused (exit 1, the old golden kept) if the new
    recording is thin, does not replay its own rows, or its detection control is blind (its verify rows failing
    the policy's equivalence= against its decode rows are a warning, as vd record gives). A golden recorded over
    tensor-parallel ranks is recorded over as many again (--tp N: another degree)."""
    return refresh_golden(target, config, reason, summary, {}, candidate=from_, allow_slim=allow_slim)


@app.command(cls=Command, epilog=examples("vd history smollm2-default", "vd history goldens/smollm2.zarr"))
def history(
    target: Annotated[str, typer.Argument(metavar="NAME|GOLDEN", help="A declared golden's name, or a golden.")],
    config: Annotated[Path | None, typer.Option(metavar="FILE", help=CONFIG_HELP)] = None,
) -> int:
    """Print a golden's history: each version's reason, time, user and host, environment and changes.

    Every file is checked against the manifest first, as ``vd show`` does: a damaged golden exits 2 naming the
    first damage, its history not shown as the golden's."""
    from vd.store import history as H
    from vd.store import open_golden

    g = open_golden(golden_path(target, config))
    try:  # (closed here: a reader's hold on this version would keep a refresh from removing it)
        g.check_files()
        lines = H.lines(g.history)
        out.print(f"{g.url}: {len(g.history)} version(s), content {g.content_digest()}")
    finally:
        g.close()
    for line in lines or ["(no history: recorded before format 5)"]:
        out.print(line)
    return EXIT_PASS


@app.command(cls=Command, epilog=examples("vd status", "vd status --report suite.json --no-models",
                                          "vd status --prune --yes"))
def status(
    names: Annotated[list[str] | None, typer.Argument(metavar="NAME", help="Declared goldens (default: all).")]
    = None,
    config: Annotated[Path | None, typer.Option(metavar="FILE", help=CONFIG_HELP)] = None,
    report: Annotated[Path | None, typer.Option(metavar="PATH", help="A suite report (vd replay --suite --report) "
                                                "to show each golden's last result from.")] = None,
    no_models: Annotated[bool, typer.Option("--no-models", help="Do not load models to check fingerprints.")]
    = False,
    prune: Annotated[bool, typer.Option("--prune", help="Remove orphan goldens (on disk, declared by none), once "
                                        "confirmed: asked on a terminal, else --yes.")] = False,
    yes: Annotated[bool, typer.Option("--yes", help="With --prune: remove the orphans without asking.")] = False,
    json_out: Annotated[Path | None, typer.Option("--json", metavar="PATH", help="Write the status as JSON.")]
    = None,
) -> int:
    """List the declared goldens: missing, stale or current, what recorded them; and orphans.

    Stale: the declaration (prompt, K, steps, model SPEC, ...) changed since the golden was recorded, or its
    model's fingerprint moved. Exit 1 when any golden is missing, unreadable, stale or orphaned."""
    from vd.workflow import status as S

    suite = _suite(config)
    check_writable("--json", json_out, [e.path for e in suite.entries.values()])
    with reporting() as progress:
        states = S.status(suite, suite.select(names or []), check_models=not no_models,
                          report=None if report is None else str(report), progress=progress)
    for s in states:  # what `vd record --suite` would say of a missing one, said now
        why = recording_refusal(suite.entries[s.name]) if s.state == "missing" else None
        if why is not None:
            s.reasons.append(f"vd record --suite would refuse it: {why}")
    orphans = S.orphans(suite) if not names else []
    _print_status(states, orphans, no_models, suite.file.parent, prune)
    if prune and orphans and _prune_confirmed(orphans, yes):
        S.prune(orphans)
        out.print(f"removed {len(orphans)} orphan golden(s)")
        orphans = []
    if json_out is not None:
        write_json(json_out, {"suite": str(suite.file), "goldens": [s.to_json() for s in states], "orphans": orphans})
    return EXIT_FAIL if orphans or any(s.state != "current" for s in states) else EXIT_PASS


def _prune_confirmed(orphans: list[str], yes: bool) -> bool:
    """Whether to remove ``orphans`` (listed already): ``--yes``, or a yes at the terminal's question; without a
    terminal and ``--yes``, refused (`vd.errors.UsageError`). An orphan is any golden beside a declared one that
    no declaration names, a golden the suite never recorded among them: nothing is removed unseen."""
    if yes:
        return True
    if not sys.stdin.isatty():
        raise UsageError(f"--prune would remove {len(orphans)} golden(s) declared by none (listed above); add --yes "
                         "to remove them")
    return typer.confirm(f"remove these {len(orphans)} golden(s)?", default=False, err=True)


def _print_status(states, orphans: list[str], no_models: bool, base: Path, prune: bool = False) -> None:
    def shown(path: str) -> str:  # paths relative to the declaring file, as declared
        return path if "://" in path else os.path.relpath(path, base)

    t = Table(title_justify="left", title="goldens" + (" (fingerprints not checked)" if no_models else ""))
    for col in ("name", "state", "version", "forward", "fingerprint", "recorded with", "last replay", "path"):
        t.add_column(col)
    for s in states:
        r, env = s.recorded, s.recorded.get("environment") or {}
        made = ", ".join(f"{k} {env[k]}" for k in ("torch", "transformers", "gpu_name", "cpu_model") if env.get(k))
        forward = (r.get("forward") or "-") + (f" (decode {r['decode_forward']})" if r.get("decode_forward") else "")
        t.add_row(s.name, s.state, str(r.get("version") or "-"), forward,
                  (r.get("fingerprint") or "-")[:19], made or "-", s.last or "-", shown(s.path))
    out.print(t)
    for s in states:
        for why in s.reasons:
            out.print(f"  {s.name}: {why}")
    for path in orphans:
        out.print(f"  orphan: {shown(path)} (declared by none" + ("" if prune else "; vd status --prune removes it")
                  + ")")

"""The golden commands: record, replay, show, slim, diff, models, forwards (the suite commands, refresh,
history and status, are `vd.cli.team`'s). Command bodies are a few lines over `vd.recorder.record`,
`vd.replayer.replay`, `vd.replayer.diff` and `vd.store`; `vd.cli.common` holds what they share.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from vd import preflight
from vd.cli import options as o
from vd.cli import ranks
from vd.cli.common import (
    EXIT_BAD,
    EXIT_FAIL,
    EXIT_INTERNAL,
    EXIT_PASS,
    GOLDEN_OR_NAME,
    Command,
    Dtype,
    Feed,
    app,
    check_distinct,
    check_golden,
    check_model,
    check_no_golden,
    check_outside,
    check_replay,
    check_tolerances,
    check_writable,
    default_bundle,
    err,
    examples,
    foreign_vd,
    golden_path,
    note_journal,
    out,
    reading_environment,
    reporting,
    resumable,
    write_json,
)
from vd.errors import Terminated, UsageError, VdError
from vd.outputs import check_bundle_place, size_text
from vd.preflight import check_threads


@app.command(cls=Command, epilog=examples(
    "vd record goldens/smollm2.zarr --refresh",
    "vd record goldens/smollm2-mtp.zarr --model smollm2-mtp --feed mtp",
    'vd record --suite --refresh --reason "fused attention kernel (PR 123)" --summary changes.md'))
@ranks.tensor_parallel
def record(
    ctx: typer.Context,
    targets: o.RecordTargets = None,
    model: o.RecordModel = "smollm2",
    prompt: o.Prompt = None,
    k: o.RecordWidths = "2,3,4",  # type: ignore[assignment]  # typer parses the default as it parses --k
    steps: o.Steps = 16,
    forward: o.RecordForward = None,
    decode_forward: o.RecordDecodeForward = None,
    feed: o.FeedOpt = Feed.reference,
    head: o.RecordHead = None,
    device: o.RecordDevice = "cpu",
    dtype: o.DtypeOpt = Dtype.bfloat16,
    threads: o.RecordThreads = None,
    tp: o.Tp = None,
    refresh: o.Refresh = False,
    allow_nonfinite: o.AllowNonfinite = False,
    allow_thin: o.AllowThin = False,
    deterministic: o.Deterministic = False,
    tolerance: o.Tolerances = None,
    require_coverage: o.RecordCoverage = False,
    batch: o.RecordBatch = None,
    slot: o.Slot = None,
    batch_seed: o.BatchSeed = None,
    no_batch: o.NoBatch = False,
    trace: o.RecordTrace = False,
    reason: o.Reason = None,
    summary: o.Summary = None,
    suite: o.Suite = False,
    config: o.Config = None,
    resume: o.Resume = False,
) -> int:
    """Record a golden: the reference (or MTP drafter) feed at each K, every logits row, in a zarr store.

    With --refresh over an existing golden it re-records what the golden (or its declaration) says, changed
    only by the flags given, and prints what changed (as vd refresh does). An OUT a suite declares (by its name
    or path; the declaration found from here, or --config's) is recorded with its declared settings, changed
    by the flags given. With --suite it records the declared goldens that are missing (and with --refresh the
    rest); --tolerance sets the default policy."""
    if suite:
        from vd.cli import team

        return team.record_suite(targets or [], config, refresh, reason, summary)
    out_path, entry = _record_target(_one(targets, "OUT"), config)
    if resume:
        return _resumed(ctx, out_path)
    _check_record(ctx, out_path, entry, summary, (forward, decode_forward), tolerance)
    preflight.check_record_widths(k)
    _check_batch(batch, slot, batch_seed, no_batch, feed == Feed.mtp)
    return _record_one(ctx, out_path, refresh, reason, summary, config, entry)


def _check_batch(batch: int | None, slot: int | None, batch_seed: int | None, no_batch: bool, drafted: bool) -> None:
    """A recording's batch flags: ``--no-batch`` (alone) with none of the others, the others as a replay's."""
    if no_batch and (given := [f for f, v in (("--batch", batch), ("--slot", slot), ("--batch-seed", batch_seed))
                               if v is not None]):
        raise UsageError(f"--no-batch records the sequence alone: it does not go with {', '.join(given)}")
    preflight.check_batch(batch, slot, batch_seed, drafted, recording=True)


def _model_of(ctx: typer.Context, out_path: str, entry) -> str:
    """The model SPEC a recording's forwards are checked against up front: ``--model``, else the declaration's,
    else (a refresh) the golden's own, else the default."""
    model = ctx.params["model"]
    if _given(ctx, "model"):
        return model
    if entry is not None:
        return entry.model or model
    peek = preflight.peek(out_path) if ctx.params["refresh"] else None
    if peek is None or peek.meta is None or not isinstance(peek.meta.get("model"), Mapping):
        return model
    from vd.models.specs import stored

    return stored(peek.meta["model"], Path(os.path.abspath(out_path)).parent)[0]


def _record_target(target: str, config: Path | None):
    """Where one golden is recorded, and its declaration's entry: a declared golden (by its NAME or path) is
    recorded at its declared path with its declared settings, changed by the flags given."""
    from vd.cli.team import record_entry

    entry = record_entry(target, config)
    return (target, None) if entry is None else (entry.path, entry)


def _check_record(ctx: typer.Context, out_path: str, entry, summary: Path | None,
                  forwards: tuple[str | None, str | None], tolerance: list[str] | None) -> None:
    """A recording's arguments checked before anything heavy is imported: the destination and --summary, the
    model SPEC (`_model_of`) and its forwards (``forwards``: the recording's and the decode rows', each where one
    is named), the device, the thread count and the policy."""
    refresh, device, threads = ctx.params["refresh"], ctx.params["device"], ctx.params["threads"]
    model = _model_of(ctx, out_path, entry)
    if summary is not None and not refresh:  # (one golden's first recording writes none)
        raise UsageError("--summary describes what a refresh changed: give it with --refresh (or --suite)")
    check_writable("--summary", summary, (out_path,))
    preflight.check_target(out_path, preflight.peek(out_path).state, refresh)
    check_no_golden("OUT", out_path, replace=True)  # OUT itself: check_target's (--refresh replaces it)
    from vd.models import check_recording

    check_recording(model, [f for f in forwards if f is not None], device, threads)
    check_tolerances(tolerance)


def _record_one(ctx: typer.Context, out_path: str, refresh: bool, reason: str | None, summary: Path | None,
                config: Path | None, entry) -> int:
    """Record one golden from the flags given (``ctx``), over its declaration's settings where a declaration
    names it (``entry``), or refresh the golden at ``out_path``; a declared pin is set to what was recorded."""
    from vd.cli import team
    from vd.store import locate
    from vd.workflow.declare import check_pin_writable

    named = [name for name in _SETTINGS if _given(ctx, name)]  # the setting flags given
    flags = {_SETTINGS[name]: _value(ctx.params[name]) for name in named}
    if ctx.params["no_batch"]:  # alone: no batch, so neither a slot nor a seed of the others
        flags.update(batch=None, slot=None, batch_seed=None)
    if refresh and locate(out_path).state() == "golden":
        if entry is not None and not reason:  # as vd refresh and a suite's refresh ask it
            raise UsageError(f"--refresh of {entry.name}, which {entry.file} declares, needs --reason TEXT: it goes "
                             "into the golden's history")
        return team.refresh_golden(out_path, config, reason or "vd record --refresh", summary, flags)
    from vd.recorder import RecordSettings
    from vd.recorder import record as do_record

    if entry is not None:
        settings = team.settings_for(out_path, entry, flags)
        changed = ", ".join("--" + name.replace("_", "-") for name in named)
        out.print(f"recording {entry.name} as {entry.file} declares it"
                  + (f", changed by {changed}" if changed else ""))
    else:
        given = {name: v for name, v in ctx.params.items() if v is not None}  # None: the setting's default
        settings = RecordSettings(**{field: _value(given[name]) for name, field in _SETTINGS.items() if name in given})
    check_pin_writable(entry)
    note_journal(out_path)
    with reporting() as progress, resumable(out_path), team.published_if_cut_short(entry, out_path):
        r = do_record(out_path, settings, refresh=refresh, progress=progress, reason=reason or "first recording")
    code = _recorded(r)
    if code == EXIT_PASS:
        team.repin(entry, out_path)
        team.note_stale(entry)
    return code


# The record flags that are settings, by the `vd.recorder.RecordSettings` field each sets.
_SETTINGS = {"model": "model", "prompt": "prompt", "k": "ks", "steps": "steps", "forward": "forward",
             "decode_forward": "decode_forward", "feed": "feed",
             "head": "head", "device": "device", "dtype": "dtype", "threads": "threads", "allow_thin": "allow_thin",
             "allow_nonfinite": "allow_nonfinite",
             "deterministic": "deterministic", "tolerance": "tolerances", "require_coverage": "require_coverage",
             "batch": "batch", "slot": "slot", "batch_seed": "batch_seed", "trace": "trace"}


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether flag ``name`` was given (on the command line or by an environment variable), not defaulted."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def _value(v):
    """A flag's value as the settings hold it: an enum's value, a list as a tuple."""
    return v.value if hasattr(v, "value") else tuple(v) if isinstance(v, list | tuple) else v


def _one(targets: list[str] | None, what: str) -> str:
    if not targets or len(targets) != 1:
        raise UsageError(f"give one {what} (or --suite with declared golden names); got {len(targets or [])}")
    return targets[0]


def _resumed(ctx: typer.Context, out_path: str) -> int:
    """``--resume``: the journal's recording continued with the settings it started with (any other flag refused:
    it would be ignored without a word)."""
    from vd.recorder import record as do_record

    given = [name for name in ctx.params if name not in ("targets", "resume", "config") and _given(ctx, name)]
    if given:
        raise UsageError(f"--resume continues the cut-short recording with the settings it started with; "
                         f"{', '.join('--' + n.replace('_', '-') for n in given)} cannot change them (record "
                         "afresh without --resume to change them)")
    with reporting() as progress, resumable(out_path):
        return _recorded(do_record(out_path, resume=True, progress=progress))


def _recorded(r) -> int:
    """Print what a recording did (`vd.recorder.RecordResult`'s lines); its exit code."""
    for line in r.accept_lines():
        out.print(line)
    for line in r.problems():
        err.print(f"vd: {line}")
    stored = r.stored_line()
    if stored is not None:
        out.print(stored)
    return EXIT_PASS if stored is not None else EXIT_FAIL



def print_table(table) -> None:
    """A `vd.replayer.words.TextTable` on stdout."""
    t = Table(title=table.title, title_justify="left")
    for col in table.columns:
        t.add_column(col)
    for row in table.rows:
        t.add_row(*row)
    out.print(t)


@app.command(cls=Command, epilog=examples(
    "vd replay goldens/smollm2.zarr --report report.json",
    "vd replay goldens/smollm2.zarr --forward eager --forward sdpa --tolerance verify=ulp:2",
    "vd replay --suite --shard 1/2 --junit vd.xml --html vd.html"))
@ranks.tensor_parallel
def replay(
    targets: o.ReplayTargets = None,
    model: o.ReplayModel = None,
    head: o.ReplayHead = None,
    forward: o.ReplayForwards = None,
    decode_forward: o.DecodeForward = None,
    batch: o.Batch = None,
    slot: o.Slot = None,
    batch_seed: o.BatchSeed = None,
    report: o.ReportPath = None,
    k: o.ReplayWidths = None,
    device: o.ReplayDevice = None,
    threads: o.ReplayThreads = None,
    tp: o.Tp = None,
    allow_model_mismatch: o.AllowModelMismatch = False,
    tolerance: o.Tolerances = None,
    require_coverage: o.ReplayCoverage = False,
    rows: o.Rows = None,
    bundle: o.Bundle = None,
    junit: o.Junit = None,
    html: o.Html = None,
    save_candidate: o.SaveCandidate = None,
    locate: o.Locate = False,
    verify: o.ReplayVerify = False,
    suite: o.Suite = False,
    shard: o.Shard = None,
    config: o.Config = None,
) -> int:
    """Replay a golden's steps through a forward and diff every row: PASS (0) or FAIL (1).

    Replay defaults to everything the golden recorded (its model, forward, device, threads and policy,
    which --tolerance overrides). With --suite, every declared golden (or those named), each model loaded
    once: one verdict, report, JUnit file and HTML page, and exit 2 where a golden could not be judged."""
    golden = _check_outputs(targets, suite, config, rows, {"--report": report, "--junit": junit, "--html": html,
                                                   "--bundle": bundle, "--save-candidate": save_candidate})
    asked = dict(model=model, head=head, forwards=tuple(forward or ()), ks=tuple(k or ()), device=device,
                 threads=threads, allow_model_mismatch=allow_model_mismatch, tolerances=tuple(tolerance or ()),
                 require_coverage=require_coverage, rows=rows, save_candidate=save_candidate,
                 decode_forward=decode_forward, batch=batch, slot=slot, batch_seed=batch_seed, locate=locate,
                 verify=verify)
    if suite:
        from vd.cli import team

        _check_inputs(None, asked)
        return team.replay_suite(targets or [], config, asked, shard, report, junit, html, bundle)
    if shard is not None:  # else every shard of a CI matrix would replay the one golden, none saying so
        raise UsageError(f"--shard {shard} splits a suite's goldens between jobs: it goes with --suite")
    assert golden is not None  # one golden without --suite (_check_outputs)
    return _replay_golden(golden, asked, config, report, bundle, junit, html)


def _replay_golden(golden: str, asked: dict, config: Path | None, report: Path | None, bundle: Path | None,
                   junit: Path | None, html: Path | None) -> int:
    """`replay` of one golden: the flags checked, the replay, its outputs written (or the error, where asked)."""
    try:
        _check_inputs(golden, asked)  # before anything heavy is imported
        entry = _declared(golden, config)
        asked = {**asked, "pin": None if entry is None else entry.pin}
        with reading_environment() as environ:  # what the bundle's command.sh sets again
            result = _replay_one(golden, _settings(asked))
    except Exception as e:  # written where asked, so a CI dashboard shows why there is no verdict; then raised
        _error_outputs(golden, e, report, junit, html, bundle)
        raise
    _note_stale(entry)
    args = {key: asked[key] for key in ("model", "head", "device", "threads", "rows", "allow_model_mismatch")}
    args["environ"] = environ  # with the flags above, what command.sh passes again
    declared = _name_here(entry, config)  # (the next step declares and refreshes it by name)
    return _replayed(result, _write_outputs(result, args, report, bundle, junit, html, declared), declared)


def _declared(golden: str, config: Path | None):
    """The suite declaration (``--config``, else the one found from here) of the golden at this path, if any
    (`vd.workflow.declare.declared`): its pin is checked, and its staleness said."""
    from vd.workflow.declare import declared

    return declared(golden, config)


def _name_here(entry, config: Path | None) -> str | None:
    """The NAME commands run here take for the declared golden ``entry``: where the declaration they read
    (``--config``, else the one found from here) declares it; None where only the golden's own folder's does (a
    command here names it by its path)."""
    from vd.workflow.declare import find

    here = config if config is not None else find()
    if entry is None or entry.file is None or here is None:
        return None
    return entry.name if Path(here).resolve() == Path(entry.file).resolve() else None


def _note_stale(entry) -> None:
    """A declared golden replayed alone whose declaration has moved past it: said on stderr (a suite replay calls
    it an ERROR, `vd status` stale; a replay of the golden as stored goes on to its verdict)."""
    if entry is None:
        return
    from vd.workflow.suite import stale_now

    try:
        stale = stale_now(entry)
    except VdError:  # (the golden just replayed: nothing to say that its verdict does not)
        return
    if stale:
        err.print(f"vd: note: {entry.name} is stale against its declaration ({'; '.join(stale)}): replayed as "
                  f"stored; vd replay --suite calls it an ERROR until vd record --suite {entry.name} --refresh "
                  "--reason TEXT records it as declared")


def _settings(asked: dict):
    """`vd.replayer.ReplaySettings` from the flags (the replayer imported here: it imports torch)."""
    from vd.replayer import ReplaySettings

    return ReplaySettings(**asked)


def _replay_one(golden: str, settings):
    from vd.replayer import replay as do_replay

    with reporting() as progress:
        return do_replay(golden, settings, progress=progress)


def _error_outputs(golden: str, e: Exception, report: Path | None, junit: Path | None, html: Path | None,
                   bundle: Path | None = None) -> None:
    """``--report``, ``--junit`` and ``--html`` of a replay that ended before a verdict: the error, its exit code;
    an earlier replay's bundle in the bundle's place cleared (`vd.replayer.render.clear_bundle`)."""
    if report is None and junit is None and html is None:
        return
    from vd.errors import VdError, system_refusal
    from vd.replayer import render
    from vd.replayer.report import Unjudged, golden_name

    if (bundle := bundle or default_bundle(report)) is not None:
        render.clear_bundle(bundle)

    bad_input = isinstance(e, VdError | OSError)
    text = system_refusal(e) if isinstance(e, OSError) and not isinstance(e, VdError) else str(e)
    first = text.splitlines()[0] if text else ""
    done = Unjudged(golden, first if bad_input else f"internal error: {type(e).__name__}: {first}",
                    EXIT_BAD if bad_input else EXIT_INTERNAL)
    if report is not None:
        write_json(report, done.to_json())
    if junit is not None:
        render.write_error_junit(junit, golden_name(golden), done.error)
    if html is not None:
        render.write_error_html(html, golden_name(golden), done.error, command=["vd", *sys.argv[1:]])


def _check_outputs(targets, suite: bool, config: Path | None, rows, outputs: dict) -> str | None:
    """A replay's targets and output paths checked first (before the replay, not after it); the golden (None
    with --suite; given by a declared golden's name, its path)."""
    if suite and rows is not None:
        raise UsageError("--rows names one slim golden's rows; it does not go with --suite")
    golden = None if suite else golden_path(_one(targets, "GOLDEN"), config)
    check_distinct(outputs)
    candidate = outputs.pop("--save-candidate")
    for flag, path in outputs.items():
        check_writable(flag, path, (golden, rows), directory=flag == "--bundle")
    beside = default_bundle(outputs["--report"])
    if outputs["--bundle"] is None and beside is not None:  # the bundle's default place, beside the report
        check_no_golden("--report", beside)
    place = None if suite else outputs["--bundle"] or beside  # (a suite's go in folders of their own: its check)
    what = f"--bundle {place}" if outputs["--bundle"] else f"the bundle's place beside --report, {place},"
    why = check_bundle_place(what, place, {**outputs, "--save-candidate": candidate, "--bundle": None})
    if why is not None:
        raise UsageError(why)
    check_outside("--save-candidate", candidate, (golden, rows))
    # an earlier candidate is replaced (`vd.replayer.candidate`); any other golden never is
    earlier = not suite and candidate is not None and "candidate" in (preflight.peek(candidate).meta or {})
    check_no_golden("--save-candidate", candidate, replace=earlier)
    return golden


def _check_inputs(golden: str | None, asked: dict) -> None:
    """The goldens, model SPEC, forwards, widths, device, threads and tolerances checked before anything heavy
    is imported (with --suite, ``golden`` None: what the flags say alone)."""
    if asked["rows"] is not None:
        check_golden(asked["rows"])
    meta = check_golden(golden) if golden is not None else None
    twice = sorted({f for f in asked["forwards"] if asked["forwards"].count(f) > 1})
    if twice:  # (it ran twice: two rows of the table, two JUnit cases of one name)
        raise UsageError(f"--forward {twice[0]} given twice: each forward runs once (give each once)")
    forwards = list(asked["forwards"]) + ([asked["decode_forward"]] if asked["decode_forward"] else [])
    if asked["decode_forward"] and meta is not None and meta.get("decode") is None:  # (a suite's golden: a note)
        raise UsageError(f"--decode-forward measures verify rows against decode rows, and {golden} stores none "
                         "(recorded before format 7): record it again to store them")
    preflight.check_batch(asked["batch"], asked["slot"], asked["batch_seed"],
                          meta is not None and meta.get("feed") == "mtp")
    if asked["locate"] and asked["batch"] is not None:
        raise UsageError("--locate runs the sequence alone: it does not go with --batch")
    if asked["locate"] and meta is not None and meta.get("trace") is None:
        raise preflight.untraced(str(golden), "--locate")
    if golden is not None:
        check_replay(golden, meta, asked["ks"], asked["model"], forwards, asked["device"], asked["threads"])
    else:
        check_threads(asked["threads"])
        if asked["model"] is not None:
            check_model(asked["model"], forwards)
        if asked["device"] is not None:
            from vd.models.device import check_device_name

            check_device_name(asked["device"])
    check_tolerances(list(asked["tolerances"]))


def _replayed(result, data: dict, declared: str | None = None) -> int:
    """Print a replay's summary (`vd.replayer.words`; ``declared``: the golden's name in its declaration, which its
    next step uses, as a suite replay's does); its exit code."""
    from vd.replayer import words

    print_table(words.replay_table(result))
    print_table(words.axes_table(result))
    for line in words.replay_lines(result):
        out.print(line)
    if result.located:
        from vd.cli.locate import reports_lines

        for line in reports_lines(result.located):
            out.print(line)
    out.print(result.verdict, style="bold")
    if data.get("bundle"):
        out.print(words.bundle_line(data["bundle"]))
    for line in words.next_lines(result, declared, data.get("bundle")):
        out.print(line)
    return EXIT_PASS if result.verdict == "PASS" else EXIT_FAIL


def _write_outputs(result, args: dict, report: Path | None, bundle: Path | None, junit: Path | None,
                   html: Path | None, declared: str | None = None) -> dict:
    """A replay's bundle (on failure), JSON report, JUnit XML and HTML page, those asked for; the JSON."""
    from vd.replayer import render  # imported here as the replayer is, for a quick `vd --help`

    data = {**result.to_json(), "bundle": None}  # the bundle's folder where one is written (the key always there)
    if bundle is None:
        bundle = default_bundle(report)
    if bundle is not None:
        render.clear_bundle(bundle)  # an earlier replay's, beside a report it no longer describes
    if result.verdict == "FAIL" and result.failure_rows is not None and bundle is not None:
        data["bundle"] = str(render.write_bundle(bundle, result, args, args.get("environ")).parent)
    if report is not None:
        write_json(report, data)
    if junit is not None:
        render.write_junit(junit, result)
    if html is not None:
        render.write_html(html, result, command=["vd", *sys.argv[1:]], bundle=data.get("bundle"), declared=declared)
    return data


@app.command(cls=Command, epilog=examples("vd show goldens/smollm2.zarr", "vd show s3://bucket/smollm2.zarr"))
def show(golden: Annotated[str, typer.Argument(metavar="GOLDEN", help=f"Golden to describe ({GOLDEN_OR_NAME}).")]
         ) -> int:
    """Print a golden's model, environment, settings, steps and accept counts; check every row's digest."""
    golden = golden_path(golden)
    check_golden(golden)
    from vd.describe import describe

    for line in describe(golden):
        out.print(line)
    return EXIT_PASS


@app.command(cls=Command, epilog=examples("vd verify goldens/smollm2.zarr", "vd verify s3://bucket/smollm2.zarr"))
def verify(golden: Annotated[str, typer.Argument(metavar="GOLDEN", help=f"Golden to check ({GOLDEN_OR_NAME}).")]
           ) -> int:
    """Check a golden whole, as fsck does: exit 0 intact, exit 2 naming the first damaged file or row.

    Every file against the manifest's size and hash and the metadata against the golden's ID (format 6),
    every field against what a golden may hold, every step log against the vocabulary and the accept-count
    range, every chunk against its checksum and every row against its digest and statistics; the content digest
    and each step's accept count against the rows' digests and argmaxes, the history's versions chained."""
    golden = golden_path(golden)
    check_golden(golden)
    from vd.store import open_golden

    g = open_golden(golden)
    try:  # (closed here: a reader's hold on this version would keep a refresh from removing it)
        g.check_whole()
        files = f"{len(g.manifest)} files match the manifest, ID {g.meta['golden_id']}" if g.manifest is not None \
            else f"format {g.info.version}: no manifest; every chunk and row checked"
        out.print(f"intact: {g.url} ({files}; {sum(g.layout(k).total for k in g.groups)} rows"
                  f"{'' if g.slim else ' match their digests'})")
    finally:
        g.close()
    return EXIT_PASS


@app.command(cls=Command, epilog=examples("vd slim goldens/smollm2.zarr goldens/smollm2-slim.zarr",
                                            "vd slim s3://bucket/smollm2.zarr smollm2-slim.zip --refresh"))
def slim(
    golden: Annotated[str, typer.Argument(metavar="GOLDEN", help=f"The full golden ({GOLDEN_OR_NAME}).")],
    out_path: Annotated[str, typer.Argument(metavar="OUT", help="The slim golden to write.")],
    refresh: Annotated[bool, typer.Option("--refresh", help="Replace the slim form at OUT of this golden (or of an "
                                          "earlier version of it); any other golden there is refused.")] = False,
) -> int:
    """Write a golden's slim form: step logs, row digests and statistics, no rows (about 1 % of the size)."""
    golden = golden_path(golden)
    check_golden(golden)
    check_outside("OUT", out_path, (golden,))
    check_no_golden("OUT", out_path, replace=True)  # OUT itself: the store's check (--refresh replaces it)
    from vd.store import open_golden
    from vd.store import slim as do_slim

    where = do_slim(golden, out_path, refresh=refresh)
    full = open_golden(golden).location.nbytes()
    size = where.nbytes()
    out.print(f"wrote {where.url} ({size / 1e3:.1f} kB, {size / full:.2%} of {full / 1e6:.1f} MB); replay it with "
              f"--rows {golden} to measure rows that differ")
    return EXIT_PASS


@app.command(cls=Command, epilog=examples("vd pack goldens/smollm2.zarr smollm2.zip",
                                            "vd pack s3://bucket/smollm2.zarr goldens/smollm2.zarr --refresh"))
def pack(
    golden: Annotated[str, typer.Argument(metavar="GOLDEN", help=f"The golden to copy ({GOLDEN_OR_NAME}).")],
    out_path: Annotated[str, typer.Argument(metavar="OUT", help="Where to copy it: a directory, a .zip file or "
                                            "s3://bucket/prefix.")],
    refresh: o.Refresh = False,
) -> int:
    """Copy a golden into another store (a directory into a .zip, and back), every file checked against its
    manifest (vd verify checks its contents too); the same golden."""
    golden = golden_path(golden)
    check_golden(golden)
    check_outside("OUT", out_path, (golden,))
    check_no_golden("OUT", out_path, replace=True)  # OUT itself: the store's check (--refresh replaces it)
    from vd.store import open_golden
    from vd.store.pack import pack as do_pack

    where = do_pack(golden, out_path, refresh=refresh)
    g = open_golden(where)
    out.print(f"wrote {where.url} ({size_text(where.nbytes())}, {len(g.manifest or {})} files checked against its "
              f"manifest); golden ID {g.meta['golden_id']}, the source's")
    return EXIT_PASS


@app.command(cls=Command, epilog=examples("vd migrate tests/data/tiny-llama-v1.zarr tiny-v7.zarr"))
def migrate(
    golden: Annotated[str, typer.Argument(metavar="OLD", help=f"A golden of an earlier format ({GOLDEN_OR_NAME}).")],
    out_path: Annotated[str, typer.Argument(metavar="NEW", help="The golden to write in the current format.")],
    refresh: Annotated[bool, typer.Option("--refresh", help="Replace an existing golden at NEW.")] = False,
) -> int:
    """Rewrite a golden of an earlier format in the current one, every row checked; its numbers unchanged."""
    golden = golden_path(golden)
    check_golden(golden)
    check_outside("NEW", out_path, (golden,))
    check_no_golden("NEW", out_path, replace=True)  # NEW itself: the store's check (--refresh replaces it)
    from vd.store import migrate as do_migrate
    from vd.store import open_golden

    where = do_migrate(golden, out_path, refresh=refresh)
    old, new = open_golden(golden), open_golden(where)
    same = "unchanged" if old.content_digest() == new.content_digest() else "CHANGED"
    out.print(f"wrote {where.url} (format {new.info.version} from {old.info.version}); content {same}: "
              f"{new.content_digest()}")
    return EXIT_PASS if same == "unchanged" else EXIT_FAIL


@app.command(cls=Command, epilog=examples("vd diff goldens/smollm2.zarr h200/smollm2.zarr --report diff.json",
                                            "vd diff goldens/smollm2.zarr h200/smollm2.zarr --tolerance verify=ulp:2"))
def diff(
    a: Annotated[str, typer.Argument(metavar="A", help=f"The reference golden ({GOLDEN_OR_NAME}).")],
    b: Annotated[str, typer.Argument(metavar="B", help="The golden to judge against it (the same recording, "
                                     "elsewhere; a path or a declared golden's name).")],
    tolerance: o.Tolerances = None,
    report: o.ReportPath = None,
) -> int:
    """Compare two goldens of the same recording without a model: PASS (0) or FAIL (1) (default policy: A's)."""
    a, b = golden_path(a), golden_path(b)
    check_writable("--report", report, (a, b))
    for where in (a, b):
        check_golden(where)
    check_tolerances(tolerance)
    from vd.replayer import words
    from vd.replayer.diff import diff as do_diff

    result = do_diff(a, b, tolerances=tolerance or ())
    if report is not None:
        write_json(report, result.to_json())
    for line in words.diff_lines(result):
        out.print(line)
    out.print(result.verdict, style="bold")
    return EXIT_PASS if result.verdict == "PASS" else EXIT_FAIL


@app.command(cls=Command, epilog=examples("vd models"))
def models() -> int:
    """List the model presets and the SPEC forms --model accepts."""
    from vd.models import PRESETS

    t = Table(title="presets", title_justify="left")
    t.add_column("name")
    t.add_column("what it is")
    for p in PRESETS.values():
        t.add_row(p.name, p.summary)
    out.print(t)
    out.print("Other SPECs: a local HF checkpoint directory; a .gguf file; 'llamacpp:PATH.gguf' (the GGUF run by "
              "llama.cpp, vd-goldens[llamacpp]); a plug-in 'package.module:factory' or 'path/to/file.py:factory' "
              "returning a vd.protocol.VerifyModel.")
    return EXIT_PASS


@app.command(cls=Command, epilog=examples("vd forwards", "vd forwards --model tiny-llama --device cpu"))
def forwards(
    model: Annotated[str, typer.Option(metavar="SPEC", help="Model.")] = "smollm2",
    device: o.ForwardsDevice = None,
) -> int:
    """List the forwards a model offers on this machine and what each runs."""
    check_model(model, [])
    import torch

    from vd.models import check_device, forwards_of, spec_kind
    from vd.models.device import CUDA_ONLY

    dev = check_device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    offered = forwards_of(model, device=str(dev))
    # A built-in model's CUDA-only forwards are left out on the CPU; a plug-in lists what its device runs.
    left_out = [] if dev.type == "cuda" or spec_kind(model) == "plugin" else [n for n in offered if n in CUDA_ONLY]
    for name, desc in offered.items():
        if name not in left_out:
            out.print(f"{name:<15} {desc}")
    if left_out:
        why = "--device cpu" if torch.cuda.is_available() else "this machine has no CUDA device"
        out.print(f"left out: {', '.join(left_out)} (they run on CUDA only; {why})")
    return EXIT_PASS


def main() -> None:
    """Console entry point. SIGTERM (what CI timeouts send), and SIGHUP (a closed terminal) unless it is ignored
    (``nohup``), end the process as an exception would, so a recording's staging folder is removed and its
    writer lock released; the exit code is 128 + the signal's number (143, 129)."""
    signal.signal(signal.SIGTERM, _terminated)
    if signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:
        signal.signal(signal.SIGHUP, _terminated)
    clash = foreign_vd()
    if clash is not None:
        err.print(f"vd: error: {clash}")
        sys.exit(EXIT_BAD)
    if ranks.ranks() > 1:  # one of the ranks torchrun started (vd record/replay --tp, or torchrun itself)
        ranks.ranked(app)
    app()


def _terminated(signum, frame) -> None:
    raise Terminated(128 + signum)

"""The golden commands: record, replay, show, slim, diff, models, forwards (the suite commands, refresh,
history and status, are `vd.cli.team`'s). Command bodies are a few lines over `vd.recorder.record`,
`vd.replayer.replay`, `vd.replayer.diff` and `vd.store`; `vd.cli.common` holds what they share.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from vd.cli import ranks
from vd.cli.common import (
    DEVICE_METAVAR,
    EXIT_FAIL,
    EXIT_PASS,
    GOLDEN_HELP,
    AllowNonfinite,
    AllowThin,
    Command,
    Config,
    Deterministic,
    Dtype,
    Feed,
    Reason,
    Resume,
    Suite,
    Summary,
    Tolerances,
    Tp,
    Widths,
    app,
    check_golden,
    check_model,
    check_outside,
    check_tolerances,
    check_writable,
    err,
    examples,
    out,
    parse_device,
    parse_widths,
    reporting,
    write_json,
)
from vd.errors import UsageError


@app.command(cls=Command, epilog=examples(
    "vd record goldens/smollm2.zarr --refresh",
    "vd record goldens/smollm2-mtp.zarr --model smollm2-mtp --feed mtp",
    'vd record --suite --refresh --reason "fused attention kernel (PR 123)" --summary changes.md'))
@ranks.tensor_parallel
def record(
    ctx: typer.Context,
    targets: Annotated[list[str] | None, typer.Argument(metavar="OUT|NAME", help=f"Golden to write "
                                                        f"({GOLDEN_HELP}); with --suite, declared goldens "
                                                        "(default: all).")] = None,
    model: Annotated[str, typer.Option(metavar="SPEC", help="Model: preset, checkpoint dir, .gguf, module:factory "
                                       "(`vd models`).")] = "smollm2",
    prompt: Annotated[str | None, typer.Option(metavar="TEXT", help="Prompt (default: vd's own).")] = None,
    k: Annotated[Widths, typer.Option("--k", metavar="K,K,...", parser=parse_widths, help="Verify widths.")] = "2,3,4",
    steps: Annotated[int, typer.Option(metavar="N", min=1, help="Verify steps per K.")] = 16,
    forward: Annotated[str | None, typer.Option(metavar="NAME", help="Forward to record with (default: the "
                                                "model's; `vd forwards`).")] = None,
    feed: Annotated[Feed, typer.Option(help="reference: greedy drafts, one corrupted on odd steps; mtp: drafts "
                                       "from the model's MTP head.")] = Feed.reference,
    head: Annotated[str | None, typer.Option(metavar="FILE", help="Attach this MTP head (.safetensors) to an HF "
                                             "model.")] = None,
    device: Annotated[str, typer.Option(metavar=DEVICE_METAVAR, parser=parse_device, help="Device.")] = "cpu",
    dtype: Annotated[Dtype, typer.Option(help="Dtype the model computes in.")] = Dtype.bfloat16,
    threads: Annotated[int | None, typer.Option(metavar="N", min=1, help="CPU threads (default: torch's).")] = None,
    tp: Tp = None,
    refresh: Annotated[bool, typer.Option("--refresh", help="Replace an existing golden.")] = False,
    allow_nonfinite: AllowNonfinite = False,
    allow_thin: AllowThin = False,
    deterministic: Deterministic = False,
    tolerance: Tolerances = None,
    require_coverage: Annotated[bool, typer.Option("--require-coverage", help="Refuse to store a golden unless "
                                                   "every K has steps accepting each of 0..K-1 drafts.")] = False,
    reason: Reason = None,
    summary: Summary = None,
    suite: Suite = False,
    config: Config = None,
    resume: Resume = False,
) -> int:
    """Record a golden: the reference (or MTP drafter) feed at each K, every logits row, in a zarr store.

    With --refresh over an existing golden it re-records what the golden (or its declaration) says, changed
    only by the flags given, and prints what changed (as vd refresh does). With --suite it records the
    declared goldens that are missing (and with --refresh the rest); --tolerance sets the default policy."""
    from vd.cli import team

    if suite:
        return team.record_suite(targets or [], config, refresh, reason, summary)
    out_path = _one(targets, "OUT")
    if resume:
        return _resumed(out_path)
    check_model(model, [forward] if forward else [])
    check_tolerances(tolerance)
    from vd.store import locate

    if refresh and locate(out_path).state() == "golden":
        given = {field: _value(ctx.params[name]) for name, field in _SETTINGS.items() if _given(ctx, name)}
        return team.refresh_golden(out_path, config, reason or "vd record --refresh", summary, given)
    from vd.recorder import RecordSettings
    from vd.recorder import record as do_record

    given = {name: v for name, v in ctx.params.items() if v is not None}  # None: the setting's default
    settings = RecordSettings(**{field: _value(given[name]) for name, field in _SETTINGS.items() if name in given})
    with reporting() as progress:
        r = do_record(out_path, settings, refresh=refresh, progress=progress, reason=reason or "first recording")
    return _recorded(r)


# The record flags that are settings, by the `vd.recorder.RecordSettings` field each sets.
_SETTINGS = {"model": "model", "prompt": "prompt", "k": "ks", "steps": "steps", "forward": "forward", "feed": "feed",
             "head": "head", "device": "device", "dtype": "dtype", "threads": "threads", "allow_thin": "allow_thin",
             "allow_nonfinite": "allow_nonfinite",
             "deterministic": "deterministic", "tolerance": "tolerances", "require_coverage": "require_coverage"}


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


def _resumed(out_path: str) -> int:
    from vd.recorder import record as do_record

    with reporting() as progress:
        return _recorded(do_record(out_path, resume=True, progress=progress))


def _recorded(r) -> int:
    """Print what a recording did; its exit code."""
    for kk, acc in r.accepted.items():
        same = "" if r.committed_is_greedy[kk] else (
            f"  (committed sequence left the greedy continuation at step {r.left_greedy.get(kk)}: there the verify "
            "rows chose another token than the engine's own one-token decode)")
        out.print(f"K={kk}: accepted {acc}{same}")
    if r.location is None:
        for reason in r.thin + r.short:
            err.print(f"vd: {reason}")
        err.print("vd: reference too thin or short of coverage; nothing written" +
                  ("" if r.short else " (pass --allow-thin to store it anyway)"))
        return EXIT_FAIL
    for reason in r.thin:
        err.print(f"vd: warning: {reason}")
    resumed = f"; resumed: {r.resumed_checked} journaled blocks computed again and equal" if r.resumed_checked else ""
    out.print(f"recorded {r.location.url} ({r.location.nbytes() / 1e6:.1f} MB) in {sum(r.seconds.values()):.1f} s"
              f"{resumed}")
    return EXIT_PASS



def _flips(c) -> str:
    """The flips column: how many, and how many of them the policy's decisions=margin:X allowed."""
    allowed = sum(f.allowed for f in c.flips)
    return f"{len(c.flips)}" + (f" ({allowed} allowed)" if allowed else "")


def _summary(report) -> None:
    t = Table(title=f"vd replay {report.golden}  (policy: {report.policy.describe()})", title_justify="left")
    cols = ["K", "forward", "prefill", "steps differ", "first mismatch", "max |Δ|", "flips", "judged", "step ms",
            "control"]
    if report.mtp:
        cols[4:4] = ["drafts differ"]
    for col in cols:
        t.add_column(col)
    for v in report.verify:
        control = "-" if v.control is None else v.control.state
        for j, tm in zip(v.comparisons, v.timings[1:]):
            c, m = j.comparison, j.comparison.first_mismatch
            first = "-" if m is None else f"step {m.step} row {m.row}" + ("" if m.index is None else f" [{m.index}]")
            cells = [str(v.k), c.variant, "equal" if c.prefill_equal else "DIFFERS", f"{c.mismatched_steps}/{c.steps}",
                     first, f"{c.max_abs_diff:.4g}", _flips(c), "pass" if c.passed else "FAIL",
                     f"{tm.to_json()['step_ms_median']:.2f}", control]
            if report.mtp:
                cells[4:4] = [f"{c.draft_mismatched_steps}/{c.steps}{'' if c.bootstrap_equal else ' +bootstrap'}"]
            t.add_row(*cells)
    out.print(t)
    for v in report.verify:
        for j in v.comparisons:
            line = _agreement(v.k, j.comparison)
            if line:
                out.print(line)
        if v.left_greedy is not None:
            out.print(f"  K={v.k}: the recording's committed sequence left its engine's own one-token decode at step "
                      f"{v.left_greedy} (its verify rows chose another token there)")
    for reason in report.reasons:
        out.print(f"  - {reason}")
    out.print(report.verdict, style="bold")


def _agreement(k: int, c) -> str | None:
    """One line of a forward's verify rows in llama.cpp's terms (`vd.compare.agreement`), where rows differ."""
    a = c.summary["verify"].get("agreement")
    if not a or not c.summary["verify"]["rows_differ"]:
        return None
    return (f"  K={k} {c.variant} verify: KL mean {a['kl_mean']:.3g}, median {a['kl_median']:.3g}, p99 "
            f"{a['kl_p99']:.3g}, max {a['kl_max']:.3g}; same top-1 {100 * a['same_top1']:.1f} %; Δp of the golden's "
            f"top token p1 {a['dp_p1']:+.3g}, median {a['dp_p50']:+.3g}, p99 {a['dp_p99']:+.3g}")


@app.command(cls=Command, epilog=examples(
    "vd replay goldens/smollm2.zarr --report report.json",
    "vd replay goldens/smollm2.zarr --forward eager --forward sdpa --tolerance verify=ulp:2",
    "vd replay --suite --shard 1/2 --junit vd.xml --html vd.html"))
@ranks.tensor_parallel
def replay(
    targets: Annotated[list[str] | None, typer.Argument(metavar="GOLDEN|NAME", help=f"Golden to replay "
                                                        f"({GOLDEN_HELP}); with --suite, declared goldens "
                                                        "(default: all).")] = None,
    model: Annotated[str | None, typer.Option(metavar="SPEC", help="Model (default: the golden's).")] = None,
    head: Annotated[str | None, typer.Option(metavar="FILE", help="MTP head file to attach (default: the "
                                             "golden's).")] = None,
    forward: Annotated[list[str] | None, typer.Option(metavar="NAME", help="Forward to replay; repeat for several "
                                                      "(default: the golden's).")] = None,
    report: Annotated[Path | None, typer.Option(metavar="PATH", help="Write the JSON report here.")] = None,
    k: Annotated[Widths | None, typer.Option("--k", metavar="K,K,...", parser=parse_widths,
                                             help="Replay only these verify widths (default: all).")] = None,
    device: Annotated[str | None, typer.Option(metavar=DEVICE_METAVAR, parser=parse_device,
                                               help="Device (default: the golden's).")] = None,
    threads: Annotated[int | None, typer.Option(metavar="N", min=1, help="CPU threads (default: recorded).")] = None,
    tp: Tp = None,
    allow_model_mismatch: Annotated[bool, typer.Option("--allow-model-mismatch", help="Compare even if the model's "
                                                       "fingerprint differs.")] = False,
    tolerance: Tolerances = None,
    require_coverage: Annotated[bool, typer.Option("--require-coverage", help="Fail unless every K has steps "
                                                   "accepting each of 0..K-1 drafts.")] = False,
    rows: Annotated[str | None, typer.Option(metavar="FULL", help="For a slim golden: the full golden it was made "
                                             "from, whose rows measure the rows that differ.")] = None,
    bundle: Annotated[Path | None, typer.Option(metavar="DIR", help="On failure, write the first-divergence bundle "
                                                "here (default: REPORT's name + .bundle, when --report is given).")]
    = None,
    junit: Annotated[Path | None, typer.Option(metavar="PATH", help="Write JUnit XML here.")] = None,
    html: Annotated[Path | None, typer.Option(metavar="PATH", help="Write a self-contained HTML page here.")] = None,
    save_candidate: Annotated[str | None, typer.Option(metavar="PATH", help="Keep the replayed forward's rows as a "
                                                       "golden here (with --suite, a folder: PATH/NAME.zarr); review "
                                                       "with vd diff, promote with vd refresh --from.")] = None,
    suite: Suite = False,
    shard: Annotated[str | None, typer.Option(metavar="I/N", help="With --suite: replay every N-th golden by name, "
                                              "from the I-th (1..N).")] = None,
    config: Config = None,
) -> int:
    """Replay a golden's steps through a forward and diff every row: PASS (0) or FAIL (1).

    Replay defaults to everything the golden recorded (its model, forward, device, threads and policy,
    which --tolerance overrides). With --suite, every declared golden (or those named), each model loaded
    once: one verdict, report, JUnit file and HTML page, and exit 2 where a golden could not be judged."""
    golden = _check_replay(targets, suite, rows, model, forward, tolerance,
                           {"--report": report, "--junit": junit, "--html": html, "--bundle": bundle})
    check_outside("--save-candidate", save_candidate, (golden, rows))
    from vd.replayer import ReplaySettings
    from vd.replayer import replay as do_replay

    settings = ReplaySettings(model=model, head=head, forwards=tuple(forward or ()), ks=tuple(k or ()),
                              device=device, threads=threads, allow_model_mismatch=allow_model_mismatch,
                              tolerances=tuple(tolerance or ()), require_coverage=require_coverage, rows=rows,
                              save_candidate=save_candidate)
    if suite:
        from vd.cli import team

        return team.replay_suite(targets or [], config, settings, shard, report, junit, html, bundle)
    with reporting() as progress:
        result = do_replay(golden, settings, progress=progress)
    args = {"model": model, "head": head, "device": device, "threads": threads, "rows": rows,
            "allow_model_mismatch": allow_model_mismatch}  # what the bundle's command.sh passes again
    return _replayed(result, _write_outputs(result, args, report, bundle, junit, html))


def _check_replay(targets, suite: bool, rows, model, forward, tolerance, outputs: dict) -> str | None:
    """A replay's arguments checked before anything heavy; the golden (None with --suite)."""
    if suite and rows is not None:
        raise UsageError("--rows names one slim golden's rows; it does not go with --suite")
    golden = None if suite else _one(targets, "GOLDEN")
    for flag, path in outputs.items():
        check_writable(flag, path, (golden, rows))  # before the replay, not after it
    for where in (golden, rows):
        if where is not None:
            check_golden(where)
    if model is not None:  # the golden's own model is known once the golden is open
        check_model(model, forward or [])
    check_tolerances(tolerance)
    return golden


def _replayed(result, data: dict) -> int:
    """Print a replay's summary; its exit code."""
    _summary(result)
    if data.get("bundle"):
        out.print(f"first-divergence bundle: {data['bundle']} (command.sh reproduces it)")
    return EXIT_PASS if result.verdict == "PASS" else EXIT_FAIL


def _write_outputs(result, args: dict, report: Path | None, bundle: Path | None, junit: Path | None,
                   html: Path | None) -> dict:
    """A replay's bundle (on failure), JSON report, JUnit XML and HTML page, those asked for; the JSON."""
    from vd.replayer import render  # imported here as the replayer is, for a quick `vd --help`

    data = result.to_json()
    if bundle is None and report is not None:
        bundle = report.with_name(report.name + ".bundle")
    if result.verdict == "FAIL" and result.failure_rows is not None and bundle is not None:
        data["bundle"] = str(render.write_bundle(bundle, result, args).parent)
    if report is not None:
        write_json(report, data)
    if junit is not None:
        render.write_junit(junit, result)
    if html is not None:
        render.write_html(html, result, command=["vd", *sys.argv[1:]])
    return data


@app.command(cls=Command, epilog=examples("vd show goldens/smollm2.zarr", "vd show s3://bucket/smollm2.zarr"))
def show(golden: Annotated[str, typer.Argument(metavar="GOLDEN", help=f"Golden to describe ({GOLDEN_HELP}).")]
         ) -> int:
    """Print a golden's model, environment, settings, steps and accept counts; check every row's digest."""
    check_golden(golden)
    from vd.coverage import histogram
    from vd.store import open_golden

    g = open_golden(golden)
    g.check_files()  # every file against the manifest (format 6), before anything is shown as the golden's
    m = g.meta
    e = m.get("environment") or {}
    out.print(f"{g.url}  (format {m['format_version']}, created {m.get('created')})")
    if g.manifest is not None:
        out.print(f"golden ID {m['golden_id']}  ({len(g.manifest)} files, each checked against the manifest)")
    out.print(f"content   {g.content_digest()}  (history: {len(g.history)} version(s); vd history)")
    out.print(f"model     {m['model'].get('name')}  [{m['model']['spec']}]")
    out.print(f"          {m['model']['fingerprint']}")
    out.print(f"forward   {m['forward']}: {m.get('forward_description', '')}")
    if m.get("compiled"):
        c = m["compiled"]
        out.print(f"compiled  Inductor artifacts {c['bytes'] / 1e6:.1f} MB (torch {c.get('torch')}), loaded by a "
                  "compiled forward's replay before it compiles")
    if m.get("mtp"):
        h = m["mtp"]
        out.print(f"MTP head  {h.get('name')} ({h.get('source')}, {h.get('block')})  {h['fingerprint']}")
        out.print(f"          hidden: {h.get('hidden')}")
        out.print(f"          trim: {h.get('trim')}")
    out.print(f"settings  feed {g.info.feed}, dtype {g.logical}, device {g.info.device}, K {g.ks}, "
              f"{g.info.steps} steps, vocab {g.info.vocab}, prompt {len(g.prompt)} tokens")
    out.print(f"prompt    {m.get('prompt_text', '')!r}")
    from vd.policy import Policy

    out.print(f"policy    {Policy.parse((), m.get('policy')).describe()}")
    out.print(f"recorded  vd {e.get('vd')}, torch {e.get('torch')}, transformers {e.get('transformers')}, "
              f"zarr {e.get('zarr')}, python {e.get('python')} on {e.get('host')}")
    gpu = f", GPU {e.get('gpu_name')} (CUDA {e.get('cuda')}, driver {e.get('driver')})" if e.get("gpu_name") else ""
    isa = e.get("cpu_capability") if not e.get("onednn_isa") else f"{e.get('cpu_capability')}, oneDNN {e['onednn_isa']}"
    out.print(f"          CPU {e.get('cpu_model')} ({isa}), {e.get('threads')} threads{gpu}")
    if (e.get("tp") or 1) > 1:
        out.print(f"          tensor parallel over {e['tp']} ranks ({e.get('collectives')})")
    if isinstance(e.get("engine"), dict):
        out.print("          engine " + ", ".join(f"{k} {v}" for k, v in e["engine"].items()))
    out.print(f"storage   {g.location.nbytes() / 1e6:.1f} MB; {_rows_text(g)}")
    d = m.get("digest")
    for k in g.ks:
        if not g.slim:
            g.verify_rows(k)  # every row against its digest, every chunk against its checksum
        acc = g.checked_log(k).accepted.tolist()
        hist = ", ".join(f"{i}:{n}" for i, n in enumerate(histogram(k, acc)))
        flag = "" if g.checked_log(k).committed_is_greedy in (True, None) else "  (left the greedy continuation)"
        rate = sum(acc) / (len(acc) * (k - 1))
        out.print(f"K={k}  accepted {acc}  histogram {{{hist}}}  acceptance {rate:.0%}  "
                  f"bootstrap {g.checked_log(k).bootstrap}{flag}")
    if g.info.digested:
        checked = "" if g.slim else ", each checked against its row's bytes"
        out.print(f"digests   {d['lanes']} x {d['bits']}-bit per row ({d['scheme']}){checked}")
    else:
        out.print("digests   none stored (written before format 3): computed from the rows when replayed")
    return EXIT_PASS


@app.command(cls=Command, epilog=examples("vd verify goldens/smollm2.zarr", "vd verify s3://bucket/smollm2.zarr"))
def verify(golden: Annotated[str, typer.Argument(metavar="GOLDEN", help=f"Golden to check ({GOLDEN_HELP}).")]
           ) -> int:
    """Check a golden whole, as fsck does: exit 0 intact, exit 2 naming the first damaged file or row.

    Every file against the manifest's size and hash and the metadata against the golden's ID (format 6),
    every field against what a golden may hold, every step log against the vocabulary and the accept-count
    range, every chunk against its checksum and every row against its digest and statistics."""
    check_golden(golden)
    from vd.store import open_golden

    g = open_golden(golden)
    g.check_files()
    if g.manifest is not None:  # (without a manifest, check_files checked the contents already)
        g.check_contents()
    files = f"{len(g.manifest)} files match the manifest, ID {g.meta['golden_id']}" if g.manifest is not None \
        else f"format {g.info.version}: no manifest; every chunk and row checked"
    out.print(f"intact: {g.url} ({files}; {sum(g.layout(k).total for k in g.ks)} rows"
              f"{'' if g.slim else ' match their digests'})")
    return EXIT_PASS


def _rows_text(g) -> str:
    if g.slim:
        src = (g.meta.get("rows") or {}).get("slim_of") or {}
        return f"slim: no rows (made from {src.get('golden')}, created {src.get('created')})"
    if g.info.version >= 4:
        return "rows as byte planes: high byte zstd-1 + crc32c, other bytes + crc32c"
    from vd.store.chunks import node

    codecs = node(g.location, f"k{g.ks[0]}/logits", f"{g.url}/k{g.ks[0]}/logits")["codecs"]
    return f"logits rows {' + '.join(c['name'] for c in codecs)}"


@app.command(cls=Command, epilog=examples("vd slim goldens/smollm2.zarr goldens/smollm2-slim.zarr",
                                            "vd slim s3://bucket/smollm2.zarr smollm2-slim.zip --refresh"))
def slim(
    golden: Annotated[str, typer.Argument(metavar="GOLDEN", help=f"The full golden ({GOLDEN_HELP}).")],
    out_path: Annotated[str, typer.Argument(metavar="OUT", help="The slim golden to write.")],
    refresh: Annotated[bool, typer.Option("--refresh", help="Replace an existing golden at OUT.")] = False,
) -> int:
    """Write a golden's slim form: step logs, row digests and statistics, no rows (about 1 % of the size)."""
    check_golden(golden)
    check_outside("OUT", out_path, (golden,))
    from vd.store import open_golden
    from vd.store import slim as do_slim

    where = do_slim(golden, out_path, refresh=refresh)
    full = open_golden(golden).location.nbytes()
    size = where.nbytes()
    out.print(f"wrote {where.url} ({size / 1e3:.1f} kB, {size / full:.2%} of {full / 1e6:.1f} MB); replay it with "
              f"--rows {golden} to measure rows that differ")
    return EXIT_PASS


@app.command(cls=Command, epilog=examples("vd migrate tests/data/tiny-llama-v1.zarr tiny-v6.zarr"))
def migrate(
    golden: Annotated[str, typer.Argument(metavar="OLD", help=f"A golden of an earlier format ({GOLDEN_HELP}).")],
    out_path: Annotated[str, typer.Argument(metavar="NEW", help="The golden to write in the current format.")],
    refresh: Annotated[bool, typer.Option("--refresh", help="Replace an existing golden at NEW.")] = False,
) -> int:
    """Rewrite a golden of an earlier format in the current one, every row checked; its numbers unchanged."""
    check_golden(golden)
    check_outside("NEW", out_path, (golden,))
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
    a: Annotated[str, typer.Argument(metavar="A", help=f"The reference golden ({GOLDEN_HELP}).")],
    b: Annotated[str, typer.Argument(metavar="B", help="The golden to judge against it (the same recording, "
                                     "elsewhere).")],
    tolerance: Tolerances = None,
    report: Annotated[Path | None, typer.Option(metavar="PATH", help="Write the JSON report here.")] = None,
) -> int:
    """Compare two goldens of the same recording without a model: PASS (0) or FAIL (1) (default policy: A's)."""
    check_writable("--report", report, (a, b))
    for where in (a, b):
        check_golden(where)
    check_tolerances(tolerance)
    from vd.replayer.diff import diff as do_diff

    result = do_diff(a, b, tolerances=tolerance or ())
    if report is not None:
        write_json(report, result)
    for v in result["verify"]:
        sm = v["comparison"]["summary"]
        out.print(f"K={v['k']}: " + "; ".join(f"{n} {s['rows_differ']}/{s['rows']} rows differ, {s['rows_failed']} "
                                              f"fail, max |Δ| {s['max_abs']:.4g}" for n, s in sm.items()))
    for reason in result["reasons"]:
        out.print(f"  - {reason}")
    out.print(result["verdict"], style="bold")
    return EXIT_PASS if result["verdict"] == "PASS" else EXIT_FAIL


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
              "llama.cpp, vd[llamacpp]); a plug-in 'package.module:factory' or 'path/to/file.py:factory' returning a "
              "vd.protocol.VerifyModel.")
    return EXIT_PASS


@app.command(cls=Command, epilog=examples("vd forwards", "vd forwards --model tiny-llama --device cpu"))
def forwards(
    model: Annotated[str, typer.Option(metavar="SPEC", help="Model.")] = "smollm2",
    device: Annotated[str | None, typer.Option(metavar=DEVICE_METAVAR, parser=parse_device, help="Device (default: "
                                               "cuda where this machine has it, else cpu).")] = None,
) -> int:
    """List the forwards a model offers on this machine and what each runs."""
    check_model(model, [])
    import torch

    from vd.models import check_device, forwards_of, spec_kind
    from vd.models.static import CUDA_ONLY

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
    """Console entry point. SIGTERM (what CI timeouts send) ends the process as an exception would, so a
    recording's staging folder is removed and its writer lock released; the exit code is 143."""
    signal.signal(signal.SIGTERM, _terminated)
    if ranks.ranks() > 1:  # one of the ranks torchrun started (vd record/replay --tp, or torchrun itself)
        ranks.ranked(app)
    app()


def _terminated(signum, frame) -> None:
    raise SystemExit(128 + signum)

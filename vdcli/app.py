"""The `vd` commands: record, replay, diff, show, slim, models, forwards.

Command bodies are a few lines over `vd.recorder.record`, `vd.replayer.replay`, `vd.replayer.diff` and `vd.store`.
Exit codes are decided here alone: 0 PASS, 1 FAIL (a difference, a thin reference, a blind control), 2 bad
input or usage, printed as one line on stderr, 3 an internal error (one line naming the file its traceback
went to). Progress goes to stderr (only on a terminal); results to stdout.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from typer.core import TyperGroup

from vd.errors import UsageError, VdError

EXIT_PASS, EXIT_FAIL, EXIT_BAD, EXIT_INTERNAL = 0, 1, 2, 3

# typer 0.2x vendors click; older releases use click itself. Find the base either way.
_ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def _crash(e: BaseException) -> int:
    """An internal error: its traceback to a file, one line naming it."""
    with tempfile.NamedTemporaryFile("w", prefix="vd-crash-", suffix=".txt", delete=False) as f:
        traceback.print_exception(e, file=f)
    typer.echo(f"vd: internal error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
               f"(traceback in {f.name})", err=True)
    return EXIT_INTERNAL


class _Group(TyperGroup):
    """Turns every error into one stderr line and its exit code, for the CLI and CliRunner alike."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.Exit as e:
            sys.exit(e.exit_code)
        except _ClickException as e:
            ctx = getattr(e, "ctx", None)
            if type(e).__name__ != "NoArgsIsHelpError":  # typer has printed the help already
                hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
                typer.echo(f"vd: error: {e.format_message()}{hint}", err=True)
            sys.exit(e.exit_code)
        except typer.Abort:
            typer.echo("vd: aborted", err=True)
            sys.exit(130)
        except VdError as e:
            typer.echo(f"vd: error: {e}", err=True)
            sys.exit(EXIT_BAD)
        except OSError as e:  # a path the user gave that the system refused (permissions, space, ...)
            where = f": {e.filename}" if e.filename else ""
            typer.echo(f"vd: error: {e.strerror or e}{where}", err=True)
            sys.exit(EXIT_BAD)
        except Exception as e:  # a bug of vd's or a crashing engine: never a bare traceback
            sys.exit(_crash(e))
        sys.exit(rv if isinstance(rv, int) else EXIT_PASS)


app = typer.Typer(
    cls=_Group,
    help="Record-and-replay golden files for the logits of an LLM's speculative-decoding verify path.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Markup off (model names hold brackets); wide when piped so lines and tables stay whole in logs.
out = Console(highlight=False, markup=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, highlight=False, markup=False, soft_wrap=True)
GOLDEN_HELP = "a .zarr directory, a .zip file or s3://bucket/prefix"


class _Bar:
    """A progress bar on stderr, one task per phase; silent when stderr is not a terminal."""

    def __init__(self):
        self.progress = Progress(
            TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=err, transient=True, disable=not err.is_terminal,
        )
        self.task = None

    def phase(self, name: str, total: int) -> None:
        if self.task is not None:
            self.progress.update(self.task, completed=self.progress.tasks[self.task].total or 1)
        self.task = self.progress.add_task(name, total=total or None)

    def step(self, _s: int) -> None:
        self.progress.advance(self.task)

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        self.progress.__exit__(*exc)


def _parse_ks(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise UsageError(f"--k takes comma-separated integers like 2,3,4; got {text!r}") from e


def _check_writable(flag: str, path: Path | None) -> None:
    """Refuse an output file a replay could not write, before the replay."""
    if path is None:
        return
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a directory; give a file path")
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write {flag} {path}: {parent} is not a writable directory")


@app.command()
def record(
    out_path: Annotated[str, typer.Argument(metavar="OUT", help=f"Golden to write ({GOLDEN_HELP}).")],
    model: Annotated[str, typer.Option(help="Model SPEC: preset, checkpoint dir, .gguf, module:factory.")] = "smollm2",
    prompt: Annotated[str | None, typer.Option(help="Prompt text (default: vd's built-in prompt).")] = None,
    k: Annotated[str, typer.Option("--k", help="Verify widths, comma-separated.")] = "2,3,4",
    steps: Annotated[int, typer.Option(help="Verify steps per K.")] = 16,
    forward: Annotated[str | None, typer.Option(help="Forward to record with (default: the model's).")] = None,
    feed: Annotated[str, typer.Option(help="reference (greedy drafts, one corrupted on odd steps) or mtp "
                                      "(drafts from the model's MTP head).")] = "reference",
    head: Annotated[str | None, typer.Option(help="Attach this MTP head (.safetensors) to an HF model.")] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N.")] = "cpu",
    dtype: Annotated[str, typer.Option(help="bfloat16, float16 or float32.")] = "bfloat16",
    threads: Annotated[int | None, typer.Option(help="CPU threads (default: torch's).")] = None,
    refresh: Annotated[bool, typer.Option("--refresh", help="Replace an existing golden.")] = False,
    allow_thin: Annotated[bool, typer.Option("--allow-thin", help="Store a reference without both "
                                             "full and partial accepts (replay will fail it).")] = False,
    deterministic: Annotated[bool, typer.Option("--deterministic", help="Use deterministic algorithms, a fixed "
                                                "cuBLAS workspace and no reduced-precision reductions (stored; "
                                                "replay applies them too).")] = False,
    tolerance: Annotated[list[str] | None, typer.Option(help="[KIND=]SPEC, repeatable: the comparison policy "
                                                        "stored as this golden's default (see vd replay).")] = None,
    require_coverage: Annotated[bool, typer.Option("--require-coverage", help="Refuse to store a golden unless "
                                                   "every K has steps accepting each of 0..K-1 drafts.")] = False,
) -> int:
    """Record a golden: the reference (or MTP drafter) feed at each K, every logits row, in a zarr store."""
    from vd.recorder import DEFAULT_PROMPT, RecordSettings
    from vd.recorder import record as do_record

    settings = RecordSettings(model=model, head=head, prompt=DEFAULT_PROMPT if prompt is None else prompt,
                              ks=_parse_ks(k), steps=steps, forward=forward, feed=feed, device=device, dtype=dtype,
                              threads=threads, deterministic=deterministic, tolerances=tuple(tolerance or ()),
                              require_coverage=require_coverage, allow_thin=allow_thin)
    with _Bar() as bar:
        r = do_record(out_path, settings, refresh=refresh, progress=bar)
    for kk, acc in r.accepted.items():
        same = "" if r.committed_is_greedy[kk] else "  (committed sequence left the greedy continuation)"
        out.print(f"K={kk}: accepted {acc}{same}")
    if r.location is None:
        for reason in r.thin + r.short:
            err.print(f"vd: {reason}")
        err.print("vd: reference too thin or short of coverage; nothing written" +
                  ("" if r.short else " (pass --allow-thin to store it anyway)"))
        return EXIT_FAIL
    for reason in r.thin:
        err.print(f"vd: warning: {reason}")
    out.print(f"recorded {r.location.url} ({r.location.nbytes() / 1e6:.1f} MB) in {sum(r.seconds.values()):.1f} s")
    return EXIT_PASS


def _json_default(o):
    return str(o)


def _finite(obj):
    """JSON has no NaN or infinity: write them as strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(data), indent=2, default=_json_default) + "\n")


def _summary(report) -> None:
    t = Table(title=f"vd replay {report.golden}  (policy: {report.policy.describe()})", title_justify="left")
    cols = ["K", "forward", "prefill", "steps differ", "first mismatch", "max |Δ|", "flips", "judged", "step ms",
            "control"]
    if report.mtp:
        cols[4:4] = ["drafts differ"]
    for col in cols:
        t.add_column(col)
    for v in report.verify:
        control = "-" if v.control is None else ("fired" if v.control.fired else "BLIND")
        for j, tm in zip(v.comparisons, v.timings[1:]):
            c, m = j.comparison, j.comparison.first_mismatch
            first = "-" if m is None else f"step {m.step} row {m.row}" + ("" if m.index is None else f" [{m.index}]")
            cells = [str(v.k), c.variant, "equal" if c.prefill_equal else "DIFFERS", f"{c.mismatched_steps}/{c.steps}",
                     first, f"{c.max_abs_diff:.4g}", str(len(c.flips)), "pass" if c.passed else "FAIL",
                     f"{tm.to_json()['step_ms_median']:.2f}", control]
            if report.mtp:
                cells[4:4] = [f"{c.draft_mismatched_steps}/{c.steps}{'' if c.bootstrap_equal else ' +bootstrap'}"]
            t.add_row(*cells)
    out.print(t)
    for reason in report.reasons:
        out.print(f"  - {reason}")
    out.print(report.verdict, style="bold")


@app.command()
def replay(
    golden: Annotated[str, typer.Argument(help=f"Golden to replay ({GOLDEN_HELP}).")],
    model: Annotated[str | None, typer.Option(help="Model SPEC (default: the golden's).")] = None,
    head: Annotated[str | None, typer.Option(help="MTP head file to attach (default: the golden's).")] = None,
    forward: Annotated[list[str] | None, typer.Option(help="Forward to replay; repeat for several "
                                                      "(default: the golden's).")] = None,
    report: Annotated[Path | None, typer.Option(help="Write the JSON report here.")] = None,
    k: Annotated[str | None, typer.Option("--k", help="Replay only these verify widths (default: all).")] = None,
    device: Annotated[str | None, typer.Option(help="cpu, cuda or cuda:N (default: the golden's).")] = None,
    threads: Annotated[int | None, typer.Option(help="CPU threads (default: the golden's).")] = None,
    allow_model_mismatch: Annotated[bool, typer.Option("--allow-model-mismatch",
                                    help="Compare even if the model's fingerprint differs.")] = False,
    tolerance: Annotated[list[str] | None, typer.Option(help="[KIND=]SPEC, repeatable: KIND prefill, verify or "
                                                        "draft; SPEC exact, ulp:N, atol:X,rtol:Y, argmax, topk:N, "
                                                        "kl:X (default: the golden's policy).")] = None,
    require_coverage: Annotated[bool, typer.Option("--require-coverage", help="Fail unless every K has steps "
                                                   "accepting each of 0..K-1 drafts.")] = False,
    rows: Annotated[str | None, typer.Option(help="For a slim golden: the full golden it was made from, whose "
                                             "rows measure the rows that differ.")] = None,
    bundle: Annotated[Path | None, typer.Option(help="On failure, write the first-divergence bundle here "
                                                "(default: REPORT's name + .bundle, when --report is given).")] = None,
    junit: Annotated[Path | None, typer.Option(help="Write JUnit XML here.")] = None,
    html: Annotated[Path | None, typer.Option(help="Write a self-contained HTML report here.")] = None,
) -> int:
    """Replay a golden's steps through a forward and diff every row: PASS (0) or FAIL (1)."""
    from vd.replayer import ReplaySettings
    from vd.replayer import replay as do_replay

    for flag, path in (("--report", report), ("--junit", junit), ("--html", html), ("--bundle", bundle)):
        _check_writable(flag, path)  # before the replay, not after it
    settings = ReplaySettings(model=model, head=head, forwards=tuple(forward or ()), ks=_parse_ks(k) if k else (),
                              device=device, threads=threads, allow_model_mismatch=allow_model_mismatch,
                              tolerances=tuple(tolerance or ()), require_coverage=require_coverage, rows=rows)
    with _Bar() as bar:
        result = do_replay(golden, settings, progress=bar)
    from vd.replayer import render  # bundle, JUnit, HTML; imported here as replay is, for a quick `vd --help`

    data = result.to_json()
    if bundle is None and report is not None:
        bundle = report.with_name(report.name + ".bundle")
    if result.verdict == "FAIL" and result.failure_rows is not None and bundle is not None:
        args = {"model": model, "head": head, "device": device, "threads": threads, "rows": rows,
                "allow_model_mismatch": allow_model_mismatch}
        data["bundle"] = str(render.write_bundle(bundle, result, args).parent)
    if report is not None:
        _write_json(report, data)
    for path, write in ((junit, render.write_junit), (html, render.write_html)):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            write(path, result)
    _summary(result)
    if data.get("bundle"):
        out.print(f"first-divergence bundle: {data['bundle']} (command.sh reproduces it)")
    return EXIT_PASS if result.verdict == "PASS" else EXIT_FAIL


@app.command()
def show(golden: Annotated[str, typer.Argument(help=f"Golden to describe ({GOLDEN_HELP}).")]) -> int:
    """Print a golden's model, environment, settings, steps and accept counts; check every row's digest."""
    from vd.coverage import histogram
    from vd.store import open_golden

    g = open_golden(golden)
    m = g.meta
    e = m.get("environment") or {}
    out.print(f"{g.url}  (format {m['format_version']}, created {m.get('created')})")
    out.print(f"model     {m['model'].get('name')}  [{m['model']['spec']}]")
    out.print(f"          {m['model']['fingerprint']}")
    out.print(f"forward   {m['forward']}: {m.get('forward_description', '')}")
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
    out.print(f"          CPU {e.get('cpu_model')} ({e.get('cpu_capability')}), {e.get('threads')} threads{gpu}")
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


def _rows_text(g) -> str:
    if g.slim:
        src = (g.meta.get("rows") or {}).get("slim_of") or {}
        return f"slim: no rows (made from {src.get('golden')}, created {src.get('created')})"
    if g.info.version >= 4:
        return "rows as byte planes: high byte zstd-1 + crc32c, other bytes + crc32c"
    from vd.store.chunks import node

    codecs = node(g.location, f"k{g.ks[0]}/logits", f"{g.url}/k{g.ks[0]}/logits")["codecs"]
    return f"logits rows {' + '.join(c['name'] for c in codecs)}"


@app.command()
def slim(
    golden: Annotated[str, typer.Argument(help=f"The full golden ({GOLDEN_HELP}).")],
    out_path: Annotated[str, typer.Argument(metavar="OUT", help="The slim golden to write.")],
    refresh: Annotated[bool, typer.Option("--refresh", help="Replace an existing golden at OUT.")] = False,
) -> int:
    """Write a golden's slim form: step logs, row digests and statistics, no rows (about 1 % of the size)."""
    from vd.store import open_golden
    from vd.store import slim as do_slim

    where = do_slim(golden, out_path, refresh=refresh)
    full = open_golden(golden).location.nbytes()
    size = where.nbytes()
    out.print(f"wrote {where.url} ({size / 1e3:.1f} kB, {size / full:.2%} of {full / 1e6:.1f} MB); replay it with "
              f"--rows {golden} to measure rows that differ")
    return EXIT_PASS


@app.command()
def diff(
    a: Annotated[str, typer.Argument(help="The reference golden.")],
    b: Annotated[str, typer.Argument(help="The golden to judge against it (the same recording, elsewhere).")],
    tolerance: Annotated[list[str] | None, typer.Option(help="[KIND=]SPEC, repeatable (default: A's policy).")]
    = None,
    report: Annotated[Path | None, typer.Option(help="Write the JSON report here.")] = None,
) -> int:
    """Compare two goldens of the same recording without a model: PASS (0) or FAIL (1)."""
    from vd.replayer.diff import diff as do_diff

    _check_writable("--report", report)
    result = do_diff(a, b, tolerances=tolerance or ())
    if report is not None:
        _write_json(report, result)
    for v in result["verify"]:
        sm = v["comparison"]["summary"]
        out.print(f"K={v['k']}: " + "; ".join(f"{n} {s['rows_differ']}/{s['rows']} rows differ, {s['rows_failed']} "
                                              f"fail, max |Δ| {s['max_abs']:.4g}" for n, s in sm.items()))
    for reason in result["reasons"]:
        out.print(f"  - {reason}")
    out.print(result["verdict"], style="bold")
    return EXIT_PASS if result["verdict"] == "PASS" else EXIT_FAIL


@app.command()
def models() -> int:
    """List the model presets and the SPEC forms --model accepts."""
    from vd.models import PRESETS

    t = Table(title="presets", title_justify="left")
    t.add_column("name")
    t.add_column("what it is")
    for p in PRESETS.values():
        t.add_row(p.name, p.summary)
    out.print(t)
    out.print("Other SPECs: a local HF checkpoint directory; a .gguf file; a plug-in "
              "'package.module:factory' or 'path/to/file.py:factory' returning a vd.protocol.VerifyModel.")
    return EXIT_PASS


@app.command()
def forwards(
    model: Annotated[str, typer.Option(help="Model SPEC.")] = "smollm2",
) -> int:
    """List the forwards a model offers and what each runs."""
    from vd.models import forwards_of

    for name, desc in forwards_of(model).items():
        out.print(f"{name:<15} {desc}")
    return EXIT_PASS


def main() -> None:
    """Console entry point."""
    app()

"""The `vd` command line: record, replay, diff, show, models, forwards.

Command bodies are a few lines over `recorder.record`, `replayer.replay` and `vd.golden`. Exit codes are
decided here alone: 0 PASS, 1 FAIL (a difference, a thin reference, a blind control), 2 bad input or
usage, printed as one line on stderr. Progress goes to stderr (only on a terminal); results to stdout.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from typer.core import TyperGroup

from vd.errors import UsageError, VdError

EXIT_PASS, EXIT_FAIL, EXIT_BAD = 0, 1, 2


# typer 0.2x vendors click; older releases use click itself. Find the base either way.
_ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


class _Group(TyperGroup):
    """Turns every user-caused error into one stderr line and exit code 2, for the CLI and CliRunner."""

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


def _parse_ks(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise UsageError(f"--k takes comma-separated integers like 2,3,4; got {text!r}") from e


@app.command()
def record(
    out_path: Annotated[Path, typer.Argument(metavar="OUT", help="Golden to write (a .zarr directory).")],
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
    compress: Annotated[bool, typer.Option("--compress", help="Store the rows Blosc-compressed: about 1.2-1.5x "
                                           "smaller for bf16 logits; uncompressed replays fastest on a GPU.")] = False,
) -> int:
    """Record a golden: the reference (or MTP drafter) feed at each K, every logits row, in a zarr store."""
    from recorder import DEFAULT_PROMPT
    from recorder import record as do_record

    with _Bar() as bar:
        r = do_record(out_path, model_spec=model, prompt=DEFAULT_PROMPT if prompt is None else prompt, ks=_parse_ks(k),
                      steps=steps, forward=forward, feed=feed, head=head, device=device, dtype=dtype, threads=threads,
                      refresh=refresh, allow_thin=allow_thin, deterministic=deterministic,
                      tolerances=tolerance or (), require_coverage=require_coverage, compress=compress,
                      on_phase=bar.phase, on_step=bar.step)
    for kk, acc in r.accepted.items():
        same = "" if r.committed_is_greedy[kk] else "  (committed sequence left the greedy continuation)"
        out.print(f"K={kk}: accepted {acc}{same}")
    if r.path is None:
        for reason in r.thin + r.short:
            err.print(f"vd: {reason}")
        err.print("vd: reference too thin or short of coverage; nothing written" +
                  ("" if r.short else " (pass --allow-thin to store it anyway)"))
        return EXIT_FAIL
    for reason in r.thin:
        err.print(f"vd: warning: {reason}")
    size = sum(f.stat().st_size for f in r.path.rglob("*") if f.is_file())
    out.print(f"recorded {r.path} ({size / 1e6:.1f} MB) in {sum(r.seconds.values()):.1f} s")
    return EXIT_PASS


def _json_default(o):
    return str(o)


def _finite(obj):
    """JSON has no NaN or infinity: write them as strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def _summary(report: dict) -> None:
    from vd.policy import describe

    t = Table(title=f"vd replay {report['golden']}  (policy: {describe(report['policy'])})", title_justify="left")
    cols = ["K", "forward", "prefill", "steps differ", "first mismatch", "max |Δ|", "flips", "judged", "step ms",
            "control"]
    if report["mtp"]:
        cols[4:4] = ["drafts differ"]
    for col in cols:
        t.add_column(col)
    for v in report["verify"]:
        dc = v["detection_control"]
        control = "-" if dc is None else ("fired" if dc["fired"] else "BLIND")
        for c, tm in zip(v["comparisons"], v["timings"][1:]):
            m = c["first_mismatch"]
            first = "-" if m is None else f"step {m['step']} row {m['row']} [{m['index']}]"
            cells = [str(v["k"]), c["variant"], "equal" if c["prefill_equal"] else "DIFFERS",
                     f"{c['mismatched_steps']}/{c['steps']}", first, f"{c['max_abs_diff']:.4g}", str(len(c["flips"])),
                     "pass" if c["passed"] else "FAIL", f"{tm['step_ms_median']:.2f}", control]
            if report["mtp"]:
                boot = "" if c["bootstrap_equal"] else " +bootstrap"
                cells[4:4] = [f"{c['draft_mismatched_steps']}/{c['steps']}{boot}"]
            t.add_row(*cells)
    out.print(t)
    for reason in report["reasons"]:
        out.print(f"  - {reason}")
    out.print(report["verdict"], style="bold")


@app.command()
def replay(
    golden: Annotated[Path, typer.Argument(help="Golden to replay (a .zarr directory).")],
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
    bundle: Annotated[Path | None, typer.Option(help="On failure, write the first-divergence bundle here "
                                                "(default: REPORT's name + .bundle, when --report is given).")] = None,
    junit: Annotated[Path | None, typer.Option(help="Write JUnit XML here.")] = None,
    html: Annotated[Path | None, typer.Option(help="Write a self-contained HTML report here.")] = None,
) -> int:
    """Replay a golden's steps through a forward and diff every row: PASS (0) or FAIL (1)."""
    from replayer import replay as do_replay
    from vd.golden import check_writable

    for flag, path in (("--report", report), ("--junit", junit), ("--html", html)):
        if path is not None:
            if path.is_dir():
                raise UsageError(f"{flag} {path} is a directory; give a file path")
            check_writable(path)  # before the replay, not after it
    if bundle is not None:
        check_writable(bundle)
    with _Bar() as bar:
        result = do_replay(golden, model_spec=model, head=head, forwards=forward or (), device=device, threads=threads,
                           ks=_parse_ks(k) if k else (), tolerances=tolerance or (),
                           require_coverage=require_coverage,
                           allow_model_mismatch=allow_model_mismatch, on_phase=bar.phase, on_step=bar.step)
    from replayer import reports  # bundle, JUnit, HTML; imported here as replay is, for a quick `vd --help`

    rows = result.pop("_first_failure_rows")
    if bundle is None and report is not None:
        bundle = report.with_name(report.name + ".bundle")
    if result["verdict"] == "FAIL" and rows is not None and bundle is not None:
        args = {"model": model, "head": head, "device": device, "threads": threads,
                "allow_model_mismatch": allow_model_mismatch}
        result["bundle"] = str(reports.write_bundle(bundle, result, rows, args).parent)
    for path, write in ((report, lambda p: p.write_text(json.dumps(_finite(result), indent=2, default=_json_default)
                                                           + "\n")),
                        (junit, lambda p: reports.write_junit(p, result)),
                        (html, lambda p: reports.write_html(p, result))):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            write(path)
    _summary(result)
    if result.get("bundle"):
        out.print(f"first-divergence bundle: {result['bundle']} (command.sh reproduces it)")
    return EXIT_PASS if result["verdict"] == "PASS" else EXIT_FAIL


@app.command()
def show(golden: Annotated[Path, typer.Argument(help="Golden to describe.")]) -> int:
    """Print a golden's model, environment, settings, steps and accept counts."""
    from vd.compare import histogram
    from vd.golden import open_golden
    from vd.reader import node

    g = open_golden(golden)
    m = g.meta
    e = m.get("environment", {})
    out.print(f"{g.path}  (format {m['format_version']}, created {m.get('created')})")
    out.print(f"model     {m['model']['name']}  [{m['model']['spec']}]")
    out.print(f"          {m['model']['fingerprint']}")
    out.print(f"forward   {m['forward']}: {m.get('forward_description', '')}")
    if m.get("mtp"):
        h = m["mtp"]
        out.print(f"MTP head  {h['name']} ({h['source']}, {h['block']})  {h['fingerprint']}")
        out.print(f"          hidden: {h['hidden']}")
        out.print(f"          trim: {h['trim']}")
    out.print(f"settings  feed {m.get('feed')}, dtype {m['dtype']}, device {m['device']}, K {m['k']}, "
              f"{m['steps']} steps, vocab {m['vocab_size']}, prompt {len(g.prompt)} tokens")
    out.print(f"prompt    {m.get('prompt_text', '')!r}")
    from vd.policy import describe

    out.print(f"policy    {describe(m.get('policy') or {})}")
    out.print(f"recorded  vd {e.get('vd')}, torch {e.get('torch')}, transformers {e.get('transformers')}, "
              f"zarr {e.get('zarr')}, python {e.get('python')} on {e.get('host')}")
    gpu = f", GPU {e.get('gpu_name')} (CUDA {e.get('cuda')}, driver {e.get('driver')})" if e.get("gpu_name") else ""
    out.print(f"          CPU {e.get('cpu_model')} ({e.get('cpu_capability')}), {e.get('threads')} threads{gpu}")
    size = sum(f.stat().st_size for f in g.path.rglob("*") if f.is_file())
    first = f"k{next(iter(g.runs))}/logits"
    codecs = node(g.path, first, f"{g.path}/{first}")["codecs"]
    out.print(f"storage   {size / 1e6:.1f} MB; logits rows {' + '.join(c['name'] for c in codecs)}")
    d = m.get("digest")
    out.print(f"digests   {d['lanes']} x {d['bits']}-bit per row ({d['scheme']}), each checked against its row's bytes"
              if d else "digests   none (written before format 3): a replay reads every row")
    for k, r in g.runs.items():
        acc = r.accepted.tolist()
        hist = ", ".join(f"{i}:{n}" for i, n in enumerate(histogram(k, acc)))
        flag = "" if r.committed_is_greedy in (True, None) else "  (left the greedy continuation)"
        rate = sum(acc) / (len(acc) * (k - 1))
        out.print(f"K={k}  accepted {acc}  histogram {{{hist}}}  acceptance {rate:.0%}  bootstrap {r.bootstrap}{flag}")
    return EXIT_PASS


@app.command()
def diff(
    a: Annotated[Path, typer.Argument(help="The reference golden.")],
    b: Annotated[Path, typer.Argument(help="The golden to judge against it (the same recording, elsewhere).")],
    tolerance: Annotated[list[str] | None, typer.Option(help="[KIND=]SPEC, repeatable (default: A's policy).")]
    = None,
    report: Annotated[Path | None, typer.Option(help="Write the JSON report here.")] = None,
) -> int:
    """Compare two goldens of the same recording without a model: PASS (0) or FAIL (1)."""
    from replayer.diff import diff as do_diff
    from vd.golden import check_writable

    if report is not None:
        check_writable(report)
    result = do_diff(a, b, tolerances=tolerance or ())
    if report is not None:
        report.write_text(json.dumps(_finite(result), indent=2, default=_json_default) + "\n")
    for v in result["verify"]:
        c = v["comparison"]
        sm = c["summary"]
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

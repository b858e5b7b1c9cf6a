"""``vd locate``: the first module whose output differs between two forwards, on a golden's steps
(`vd.replayer.locate`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from vd.cli import options as o
from vd.cli.common import (
    EXIT_FAIL,
    EXIT_PASS,
    GOLDEN_OR_NAME,
    Command,
    app,
    check_distinct,
    check_golden,
    check_model,
    check_writable,
    examples,
    golden_path,
    out,
    write_json,
    write_text,
)
from vd.errors import UsageError
from vd.preflight import axis, batch_size, untraced

Between = Annotated[str | None, typer.Option("--between", metavar="NAME", help="A second forward: run the golden's "
                                             "steps under both and name the first module whose output differs; or "
                                             "'decode': the forward's verify rows against its own one-token decode "
                                             "rows of the same positions; or 'batch:N': the sequence alone against "
                                             "it as one member of a batch of N (default: against the golden's own "
                                             "traces, vd record --trace).")]
LocateForward = Annotated[str | None, typer.Option("--forward", metavar="NAME", help="The first forward (default: "
                                                   "the golden's).")]


@app.command(cls=Command, epilog=examples("vd locate traced.zarr --forward sdpa",
                                            "vd locate goldens/smollm2.zarr --forward eager --between sdpa",
                                            "vd locate goldens/smollm2.zarr --forward sdpa --between decode",
                                            "vd locate g.zarr --between sdpa --k 3 --report locate.json --html l.html"))
def locate(
    golden: Annotated[str, typer.Argument(metavar="GOLDEN", help=f"Golden whose steps to run ({GOLDEN_OR_NAME}).")],
    between: Between = None,
    forward: LocateForward = None,
    model: o.ReplayModel = None,
    k: o.ReplayWidths = None,
    device: o.ReplayDevice = None,
    report: o.ReportPath = None,
    html: o.Html = None,
    allow_model_mismatch: o.AllowModelMismatch = False,
) -> int:
    """Name the first module whose output differs: exit 1 where one does, 0 where the rows agree.

    The forward runs the golden's stored steps at each K; up to the first call whose rows differ, each traced
    module's output (embeddings, per layer norms, q/k/v, attention, o_proj, residual, MLP, the layer's output;
    final norm, LM head) is compared in the order the forward computes them: against the golden's own traces
    (a golden recorded with vd record --trace), or with --between against a second forward run here, or with
    --between decode between a verify row and the one-token decode row of the same position."""
    golden = golden_path(golden)
    meta = check_golden(golden)
    if between is not None and between.startswith("batch:"):
        batch_size(between)
    elif between == "batch":  # (it was looked up as a forward named batch)
        raise UsageError("--between batch:N names the batch's size, such as batch:4")
    check_distinct({"--report": report, "--html": html})  # (one would replace the other, or run into it)
    check_writable("--report", report, (golden,))
    check_writable("--html", html, (golden,))
    if between is None and meta is not None and meta.get("trace") is None:
        raise untraced(golden)
    first = forward or (meta or {}).get("forward")
    if not isinstance(first, str):
        raise UsageError("--forward NAME: the golden does not say its forward")
    if model is not None:
        check_model(model, [first])
    _check_between(between, model or ((meta or {}).get("model") or {}).get("spec"))
    from vd.replayer.locate import locate as do_locate

    r = do_locate(golden, first, between, model_spec=model, ks=tuple(k or ()), device=device, on_k=_print,
                  allow_model_mismatch=allow_model_mismatch)
    if report is not None:
        write_json(Path(report), r.to_json())
    if html is not None:
        from vd.replayer.render import locate_page

        write_text(Path(html), locate_page(r, command=["vd", *sys.argv[1:]]))
    out.print(f"{first} against {r.against}: " + ("they differ (above)" if r.found else "every row bit-identical"))
    for note in r.notes:
        out.print(f"note: {note}")
    return EXIT_FAIL if r.found else EXIT_PASS


def _check_between(between: str | None, spec) -> None:
    """A second forward ``--between`` names, checked against the model's forwards where its SPEC says them (a
    mistyped axis reads as a forward: its line names the axes too)."""
    if between is None or axis(between) or not isinstance(spec, str):
        return
    try:
        check_model(spec, [between])
    except UsageError as e:
        raise UsageError(f"--between {between}: {e}; or the axes decode and batch:N") from None


PATH_LINES = 6  # layers of the path printed; the JSON report and the HTML page hold every one


def _print(x) -> None:
    for line in located_lines(x):
        out.print(line)


def group(k: int) -> str:
    """How a located group is named: ``K=2``, or ``decode`` for the decode rows (K 1, `vd.store.format.DECODE_K`:
    not imported here, which would bring zarr to a command's start)."""
    return "decode" if k == 1 else f"K={k}"


def reports_lines(located) -> list[str]:
    """A replay's ``--locate`` results (`vd.replayer.locate.LocateReport` each) in lines, as `vd replay` prints
    them (and `vd replay --suite`, under each golden)."""
    lines = []
    for r in located:
        lines.append(f"where {r.forwards[0]} parts from the golden's module traces:")
        lines += ["  " + line for x in r.ks for line in located_lines(x)]
        lines += [f"  note: {note}" for note in r.notes]
    return lines


def located_lines(x) -> list[str]:
    """One K of `vd.replayer.locate.Located` in lines: where the rows first differ, the first module, the path."""
    if not x.found:
        return [f"{group(x.k)}: " + (x.note or "every row bit-identical")]
    if not x.call:
        return [f"{group(x.k)}: {x.note}"]
    rows = "" if x.rows_max_abs is None else f" (rows: max |Δ| {x.rows_max_abs:.4g})"
    f = x.first
    if f is None:
        return [f"{group(x.k)} {x.call}: " + (x.note or f"the rows differ{rows} but no traced module's output does")]
    from vd.replayer.words import before_words  # (after the run: the store is imported by then)

    when = "" if x.module_call == x.call else f" (its rows differ first at {x.call})"
    head = (f"{group(x.k)} {x.module_call}{when}: first difference at {f.name} ({f.what}), {_how(f)}; "
            f"{before_words(x.identical_before)}{rows}")
    lines = [head] + [f"  {'layer ' + str(m.layer) if m.layer is not None else 'outside the layers'}: first at "
                      f"{m.name} ({m.what}), {_how(m)}" for m in x.path[:PATH_LINES]]
    if len(x.path) > PATH_LINES:
        last = x.path[-1]
        lines.append(f"  ... {len(x.path) - PATH_LINES - 1} more layers (the JSON report holds each); last: "
                     f"{last.name} ({last.what}), {_how(last)}")
    if x.reproduces is False:
        lines.append(f"  warning: the traced pass did not reproduce the forward's rows at {group(x.k)}: its module "
                     "outputs may not be the forward's")
    return lines


def _how(m) -> str:
    """How a module's outputs differ: max |Δ| (two forwards), or rows and max |x| / norm (against a golden)."""
    if m.max_abs is not None:
        return f"max |Δ| {m.max_abs:.4g}"
    assert m.absmax is not None and m.norm is not None
    return (f"{m.rows[0]} of {m.rows[1]} rows differ, max |x| {m.absmax[0]:.6g} -> {m.absmax[1]:.6g}, norm "
            f"{m.norm[0]:.6g} -> {m.norm[1]:.6g}")

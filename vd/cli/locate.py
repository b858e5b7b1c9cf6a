"""``vd locate``: the first module whose output differs between two forwards, on a golden's steps
(`vd.replayer.locate`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from vd.cli import options as o
from vd.cli.common import (
    EXIT_FAIL,
    EXIT_PASS,
    GOLDEN_HELP,
    Command,
    app,
    check_golden,
    check_model,
    check_writable,
    examples,
    out,
    write_json,
)
from vd.errors import UsageError

Between = Annotated[str | None, typer.Option("--between", metavar="NAME", help="The second forward: run the golden's "
                                             "steps under both and name the first module whose output differs.")]
LocateForward = Annotated[str | None, typer.Option("--forward", metavar="NAME", help="The first forward (default: "
                                                   "the golden's).")]


@app.command(cls=Command, epilog=examples("vd locate goldens/smollm2.zarr --forward eager --between sdpa",
                                            "vd locate g.zarr --between sdpa --k 3 --report locate.json"))
def locate(
    golden: Annotated[str, typer.Argument(metavar="GOLDEN", help=f"Golden whose steps to run ({GOLDEN_HELP}).")],
    between: Between = None,
    forward: LocateForward = None,
    model: o.ReplayModel = None,
    k: o.ReplayWidths = None,
    device: o.ReplayDevice = None,
    report: o.ReportPath = None,
) -> int:
    """Name the first module whose output differs between two forwards: exit 1 where one does, 0 where they agree.

    Both forwards run the golden's stored steps at each K; at the first call whose rows differ, each traced
    module's output (embeddings, per layer norms, q/k/v, attention, o_proj, residual, MLP; final norm, LM head)
    is compared in the order the forward computes them. Forwards that run HF's modules (eager, SDPA) trace."""
    meta = check_golden(golden)
    if between is None:
        raise UsageError("vd locate needs a second forward: --between NAME (a golden's own module traces, vd record "
                         "--trace, are not built yet)")
    check_writable("--report", report, (golden,))
    first = forward or (meta or {}).get("forward")
    if not isinstance(first, str):
        raise UsageError("--forward NAME: the golden does not say its forward")
    if model is not None:
        check_model(model, [first, between])
    from vd.replayer.locate import locate as do_locate

    r = do_locate(golden, first, between, model_spec=model, ks=tuple(k or ()), device=device, on_k=_print)
    if report is not None:
        write_json(Path(report), r.to_json())
    out.print(f"{first} and {between}: " + ("they differ (above)" if r.found else "every row bit-identical"))
    return EXIT_FAIL if r.found else EXIT_PASS


def _print(x) -> None:
    for line in located_lines(x):
        out.print(line)


def located_lines(x) -> list[str]:
    """One K of `vd.replayer.locate.Located` in lines: where the rows first differ, the first module, the path."""
    if not x.found:
        return [f"K={x.k}: every row bit-identical between the two forwards"]
    where = "the prefill" if x.step is None else f"step {x.step}"
    f = x.first
    if f is None:
        return [f"K={x.k} {where}: the rows differ (max |Δ| {x.rows_max_abs:.4g}) but no traced module's output does"]
    head = (f"K={x.k} {where}: first difference at {f.name} ({f.what}), max |Δ| {f.max_abs:.4g}; the "
            f"{x.identical_before} traced outputs before it identical (rows: max |Δ| {x.rows_max_abs:.4g})")
    return [head] + [f"  {'layer ' + str(m.layer) if m.layer is not None else 'after the layers'}: first at "
                     f"{m.name} ({m.what}), max |Δ| {m.max_abs:.4g}" for m in x.path]

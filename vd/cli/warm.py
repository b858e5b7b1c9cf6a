"""``vd warm``: start, inspect or stop the warm server later `vd` commands fork from (`vd.warm`)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from vd.cli.common import EXIT_FAIL, EXIT_INTERNAL, EXIT_PASS, Command, app, err, examples, out
from vd.errors import UsageError


@app.command(cls=Command, epilog=examples("vd warm", "vd warm --idle 600", "vd warm --status", "vd warm --stop"))
def warm(
    stop: Annotated[bool, typer.Option("--stop", help="Stop the server (commands running in it go on).")] = False,
    status: Annotated[bool, typer.Option("--status", help="Say whether a server runs, and since when: exit 0 "
                                       "if one does, 1 if none.")] = False,
    idle: Annotated[float, typer.Option("--idle", min=1.0, help="Seconds without a command before it stops.")]
    = 3600.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> int:
    """Start a server that has imported torch, transformers and vd: later vd commands fork from it.

    A command from this Python and vd (and the same thread, ISA, torch and locale settings) forks from the
    server and starts at its work, with its own folder, arguments, environment and terminal, and the same
    numbers."""
    from vd import warm as w

    if stop and status:
        raise UsageError("--status and --stop ask different things: give one")
    if stop or status:
        answer = w.ask("stop" if stop else "status")
        if as_json:
            out.print(json.dumps(answer))
        elif answer is None:
            out.print(f"no warm server runs for this installation ({w.socket_path()})")
        else:
            out.print(f"warm server pid {answer['pid']}{' stopping' if stop else ''}: up {answer['age_s']:.0f} s, "
                      f"{answer['served']} command{'s' if answer['served'] != 1 else ''} served, idle "
                      f"{answer['idle_s']:.0f} s of {answer['idle_limit_s']:.0f}")
        return EXIT_FAIL if answer is None and status else EXIT_PASS  # --stop with none: what it asks holds
    try:
        answer = w.start(idle)
    except RuntimeError as e:
        err.print(f"vd: error: {e}")
        return EXIT_INTERNAL
    if as_json:
        out.print(json.dumps(answer))
    elif answer.get("already"):
        out.print(f"warm server pid {answer['pid']} already runs ({answer['served']} commands served)")
    else:
        inductor = answer.get("inductor", "imported")
        out.print(f"warm server pid {answer['pid']} ready: imports took {answer['imports_s']:.1f} s"
                  f"{'' if inductor == 'imported' else f' (Inductor {inductor})'}; later vd commands fork from it "
                  f"until it has been idle {idle:.0f} s (`vd warm --stop` ends it)")
    return EXIT_PASS

"""The ``vd`` command's entry point: a command a warm server takes (`vd.warm`, started by ``vd warm``) runs
in a child of that server; any other runs here, in `vd.cli`. Nothing heavy is imported before that choice."""

from __future__ import annotations

import sys


def main() -> None:
    """Ctrl-C while the command line is still being imported (before `vd.cli`'s own handling, which says what a
    command left and how to go on) ends the process as that handling would: one line and exit code 130, not a
    traceback of whatever module was importing."""
    try:
        from vd import warm

        code = warm.forward(sys.argv)
        if code is not None:
            sys.exit(code)
        from vd.cli import main as cli

        cli()  # (its commands' Ctrl-C is said by `vd.cli.common.Group`; typer's set-up before them is not)
    except KeyboardInterrupt:
        print("vd: aborted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)

"""The ``vd`` command's entry point: a command a warm server takes (`vd.warm`, started by ``vd warm``) runs
in a child of that server; any other runs here, in `vd.cli`. Nothing heavy is imported before that choice."""

from __future__ import annotations

import sys


def main() -> None:
    from vd import warm

    code = warm.forward(sys.argv)
    if code is not None:
        sys.exit(code)
    from vd.cli import main as cli

    cli()
